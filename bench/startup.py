"""A runtime's start against llama.cpp's on the real Gemma 3 270M Q4_K_M.

    python bench/startup.py [--rounds 3] [--llama-python .venv-crosscheck/bin/python]
                            [--against OTHER_CHECKOUT/.venv/bin/python] [--poll]

Ours: ``ggufswap runtime`` in http mode, from the process's start to the first answer of
``/health`` (503 ``loading``, polled every 10 ms) and to ready: the ``READY=1`` it sends to
``NOTIFY_SOCKET`` (what systemd waits for; sent just after ``/health`` turns 200: the model
loaded, the tokenizer built, the warm-up done, the control socket bound), ``/health`` no longer
polled after its first answer (each poll takes the GIL from the start: ~7 % of a core at 10 ms);
with ``--poll``, its 200, polled throughout (the method of the sittings before). The tokenizer is
cached and the project's bytecode written (a second start, as a restarted unit finds them; the
first start, with an empty cache, is reported on its own). Each start's phases
(``startup.ready``'s seconds per phase, from its log) are reported as medians.
Baseline: a process that imports llama-cpp-python and constructs ``Llama(model, n_threads=2,
n_ctx=2048)`` (the cross-check venv's build), from the process's start. Rounds alternate between
the two and report medians; both run with two threads. Issue 29's target: start → ready within
2x llama.cpp's (ratio >= 0.5), and the port answering within 1 s. ``--against`` starts another
checkout's runtime (its venv's python) in the same rounds, for a before/after ratio in one sitting.
Each round also starts a process that only imports torch as the runtime does (garbage collection
paused, ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), from the process's start: the floor a start that
imports torch before it is ready cannot go below, against ``Llama()`` in the same rounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from _real import real_model

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_LLAMA_PYTHON = BENCH_DIR.parent / ".venv-crosscheck" / "bin" / "python"
LLAMA_CHILD = (
    "import sys, time; t = time.monotonic(); from llama_cpp import Llama; "
    "Llama(model_path=sys.argv[1], n_threads=2, n_ctx=2048, verbose=False); "
    "print(time.monotonic() - t)"
)
# torch's import alone, as the runtime's start imports it (runtime/serving/prestart.py, main.py)
# (os._exit: the interpreter's teardown of torch's ~1,100 modules, 0.3-0.6 s, is not a start's)
TORCH_CHILD = "import gc; gc.disable(); import torch, os; os._exit(0)"
TORCH_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _health(port: int) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def _phases(log: Path) -> dict[str, float]:
    """The seconds per phase that the runtime's ``startup.ready`` line logged."""
    for line in log.read_text(errors="replace").splitlines():
        if '"startup.ready"' in line:
            phases: dict[str, float] = json.loads(line)["phases"]
            return phases
    return {}


class Start(NamedTuple):
    first: float  # seconds from the process's start to /health's first answer
    ready: float  # ... to READY=1 (sd_notify), or with --poll to /health's 200
    phases: dict[str, float]  # the runtime's startup.ready line
    cpu: float  # CPU seconds (user + system, all threads) the process had used when ready


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (its threads included), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _notify_socket() -> tuple[socket.socket, str]:
    """A datagram socket for the runtime's sd_notify messages, and its ``NOTIFY_SOCKET``."""
    name = f"ggufswap-bench-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    return sock, "@" + name


def _said_ready(sock: socket.socket, timeout: float) -> bool:
    """Whether a datagram holding ``READY=1`` arrived within ``timeout`` seconds."""
    if not select.select([sock], [], [], timeout)[0]:
        return False
    return b"READY=1" in sock.recv(4096).split(b"\n")


def _watch(
    proc: subprocess.Popen[bytes], started: float, port: int, notify: socket.socket | None
) -> Start:
    """Seconds from ``proc``'s start to ``/health``'s first answer (polled every 10 ms) and to
    ready: its ``READY=1`` (``notify``; no polling after the first answer, whose requests take
    the GIL from the start), else its ``/health`` 200 (phases left empty for the caller)."""
    first = ready = None
    cpu = 0.0
    while time.monotonic() - started < TIMEOUT_S and ready is None:
        if first is None or notify is None:
            status = _health(port)
            if status is not None and first is None:
                first = time.monotonic() - started
            if status == 200:
                ready, cpu = time.monotonic() - started, _cpu_s(proc.pid)
            time.sleep(0.01)
        elif _said_ready(notify, 0.1):
            ready, cpu = time.monotonic() - started, _cpu_s(proc.pid)
        if proc.poll() is not None:
            raise RuntimeError(f"the runtime exited {proc.returncode}")
    if first is None or ready is None:
        raise RuntimeError("the runtime was not ready in time")
    return Start(first, ready, {}, cpu)


def ours(model: Path, work: Path, python: str = sys.executable, *, poll: bool = False) -> Start:
    """The runtime's start (``python``: the venv whose ggufswap runs); ready when it tells
    systemd so (``NOTIFY_SOCKET``), or with ``poll`` when ``/health`` answers 200."""
    port = _free_port()
    work.mkdir(parents=True, exist_ok=True)
    config = work / "runtime.yaml"
    config.write_text(f"runtime:\n  model: {model}\n  serve: {{port: {port}}}\n")
    # Bytecode as an installed runtime has it (pip compiles on install; llama-cpp-python's is
    # there): the first start writes the project's, the measured ones read it. Compiling the
    # ~250 modules on every start was ~2 s of CPU at load 11.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env |= {
        "RUNTIME_DIRECTORY": str(work / "run"),
        "GGUFSWAP_LOG_LEVEL": "info",
        "GGUFSWAP_TOKENIZER_CACHE": str(work / "tokenizers"),
    }
    notify = None
    if not poll:
        notify, env["NOTIFY_SOCKET"] = _notify_socket()
    log = work / "runtime.log"
    argv = [python, "-m", "ggufswap", "runtime", "--config", str(config), "--threads", "2"]
    started = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=sink)
    try:
        start = _watch(proc, started, port, notify)
    finally:
        proc.terminate()
        proc.wait(30)
        if notify is not None:
            notify.close()
    return start._replace(phases=_phases(log))


def child(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Seconds from a child process's start to its exit, and its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def llama(python: Path, model: Path) -> tuple[float, float]:
    """Seconds from the process's start to a constructed ``Llama``, and its CPU seconds (to
    its exit, which follows at once)."""
    return child([str(python), "-c", LLAMA_CHILD, str(model)])


def torch_alone(python: str = sys.executable) -> tuple[float, float]:
    """Seconds from the process's start to ``import torch`` done, and its CPU seconds."""
    return child([python, "-c", TORCH_CHILD], env=os.environ | TORCH_ENV)


def run(
    quick: bool = False,
    llama_python: Path = DEFAULT_LLAMA_PYTHON,
    rounds: int = 3,
    against: Path | None = None,
    poll: bool = False,
) -> list[dict[str, Any]]:
    model = real_model()
    if model is None or not llama_python.exists():
        return []
    rounds = 1 if quick else rounds
    starts: list[Start] = []
    baselines: list[tuple[float, float]] = []
    torches: list[tuple[float, float]] = []
    others: list[Start] = []
    with tempfile.TemporaryDirectory(prefix="ggufswap-bench-start-") as tmp:
        cold = ours(model, Path(tmp), poll=poll)  # empty cache; a restart finds it filled
        if against is not None:  # its bytecode written, as ours is by the cold start
            ours(model, Path(tmp) / "against", str(against), poll=poll)
        for _ in range(rounds):
            baselines.append(llama(llama_python, model))
            starts.append(ours(model, Path(tmp), poll=poll))
            torches.append(torch_alone())
            if against is not None:
                others.append(ours(model, Path(tmp) / "against", str(against), poll=poll))
    med = statistics.median
    base, base_cpu = med(b[0] for b in baselines), med(b[1] for b in baselines)
    ready, first, cpu = (med(getattr(s, f) for s in starts) for f in ("ready", "first", "cpu"))
    phases = [s.phases for s in starts]
    names = [name for name in phases[0] if all(name in seen for seen in phases)]
    median_phases = {name: med(seen[name] for seen in phases) for name in names}
    other, other_cpu = med(o.ready for o in others or starts), med(o.cpu for o in others or starts)
    compared = [
        {"name": f"start -> ready vs {against}'s", "baseline_s": other, "ours_s": ready,
         "ratio": other / ready, "target": None, "baseline_vs_llama": base / other,
         "cpu_s": (other_cpu, cpu)}
    ] if others else []  # fmt: skip
    torch_s, torch_cpu = med(t[0] for t in torches), med(t[1] for t in torches)
    return [
        *compared,
        {"name": "start -> ready vs Llama()", "baseline_s": base, "ours_s": ready,
         "ratio": base / ready, "target": 0.5, "phases": median_phases,
         "cpu_s": (base_cpu, cpu)},
        {"name": "import torch alone vs Llama()", "baseline_s": base, "ours_s": torch_s,
         "ratio": base / torch_s, "target": None, "cpu_s": (base_cpu, torch_cpu)},
        {"name": "start -> /health answers (1 s)", "baseline_s": 1.0, "ours_s": first,
         "ratio": 1.0 / first, "target": 1.0},
        {"name": "first start (empty tokenizer cache) -> ready", "baseline_s": base,
         "ours_s": cold.ready, "ratio": base / cold.ready, "target": None,
         "phases": cold.phases},
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-python", type=Path, default=DEFAULT_LLAMA_PYTHON)
    parser.add_argument(
        "--against", type=Path, default=None, help="another checkout's venv python, interleaved"
    )
    parser.add_argument(
        "--poll",
        action="store_true",
        help="ready when /health answers 200, polled every 10 ms throughout (the bench's method "
        "before READY=1; the polls cost the start ~7%% of a core)",
    )
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.1f}")
    rows = run(
        llama_python=args.llama_python, rounds=args.rounds, against=args.against, poll=args.poll
    )
    for row in rows:
        print(
            f"{row['name']}: ours {row['ours_s']:.2f} s, baseline {row['baseline_s']:.2f} s, "
            f"ratio {row['ratio']:.2f} (target {row['target']})"
        )
        if "cpu_s" in row:
            theirs, mine = row["cpu_s"]
            print(f"  CPU seconds: ours {mine:.2f}, baseline {theirs:.2f}")
        if "baseline_vs_llama" in row:
            print(f"  its ratio against Llama(): {row['baseline_vs_llama']:.2f}")
        if "phases" in row:
            print("  phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in row["phases"].items()))
    print(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
