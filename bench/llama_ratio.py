"""The engine against llama.cpp, same files, tokens and threads, measured in the same run.

    python bench/llama_ratio.py [--quick] [--rounds N] [--llama-python PATH] [--cpu-time]
                                [--decode-only] [--against REPO]

llama.cpp is llama-cpp-python in the cross-check venv (``.venv-crosscheck``, ``make crosscheck``
builds it), run in a fresh process per measurement (``bench/_llama_child.py``); ours runs in a
fresh process too, with the defaults an operator gets (``storage: auto``, ``map_shards: auto``,
whatever libggml is installed: ``status`` names the kernels, printed here), both under the
OpenMP environment the ``ggufswap`` command sets (``OMP_WAIT_POLICY=PASSIVE``, unless the
caller's environment says otherwise: spinning workers wreck both on a shared host). The two
alternate (ours, llama.cpp, ours, ...) for ``--rounds`` rounds and each figure is the median
over the rounds. Every row is a ratio, llama.cpp's time over ours (higher is better; 1.0 =
llama.cpp's pace), with the issue's target:

- greedy decode of the real Gemma 3 270M Q4_K_M at 1 and 2 threads (target 1.0), in the
  numerics ``runtime.numerics: auto`` serves (ggml's end to end where every product is a
  libggml's, as here; the row names them);
- perplexity evaluation, one 512-token context, 2 threads: in ggml's numerics (native storage,
  ``numerics="ggml"``: the sweep's llama.cpp-comparable figures, target 1.0) and in exact numerics
  (dequantized float products); and the sweep's ggml numerics against its exact ones;
- process start to first logits, warm page cache (target: at most 1.5x llama.cpp's time), and
  beside it ``import torch`` alone in a fresh interpreter (no target: the least any start of
  a PyTorch process takes);
- one-token decode of a synthetic qwen3moe (128 experts, 8 used; Q4_K/Q6_K), 1 thread, in the
  numerics ``auto`` serves (target 1.0);
- decode-step growth from 64 to 4,096 tokens of context, 1 thread (ours against llama.cpp's
  growth: no worse, target 1.0).

``--against REPO`` measures another build of ggufswap in the same rounds of the decode rows (a
checkout with its own ``.venv``, e.g. main's: ``REPO/.venv/bin/python REPO/bench/llama_ratio.py
--child``), and prints its ratio beside ours (``before -> ours``); ``--decode-only`` runs the
decode rows alone (Gemma at 1 and 2 threads, the MoE model).

Without the cross-check venv nothing is measured (a note says how to build it). The host's load
(``os.getloadavg``) is printed beside the figures: on a shared host they are noisy, and
``--cpu-time`` compares the processes' CPU time instead of wall time (steadier there, and the
same figure on a quiet host for one thread; with two, threads that spin while waiting count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from _rows import row

HERE: Final = Path(__file__).resolve()
REPO: Final = HERE.parent.parent
LLAMA_PYTHON: Final = REPO / ".venv-crosscheck" / "bin" / "python"
PROMPT: Final = [2, 818, 5279, 529, 7001, 563, 496, 1024]  # "<bos>The capital of France is a..."
EVAL_TOKENS: Final = 512


def _json_child(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def llama(python: Path, job: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's measurement, under the OpenMP environment ours runs in (cli/main.py's: idle
    workers sleep; spinning ones ruin both on a shared host) unless the caller's says otherwise."""
    from ggufswap.main import OPENMP_ENV

    env = {**OPENMP_ENV, **os.environ}
    started = time.perf_counter()
    argv = [str(python), str(HERE.parent / "_llama_child.py"), json.dumps(job)]
    got = _json_child(argv, env=env)
    got["wall_s"] = time.perf_counter() - started
    return got


def ours(job: dict[str, Any], repo: Path | None = None) -> dict[str, Any]:
    """Our measurement in a fresh process: this build's, or (``repo``) another checkout's with
    its own ``.venv``."""
    argv = [sys.executable, str(HERE)]
    if repo is not None:
        argv = [str(repo / ".venv" / "bin" / "python"), str(repo / "bench" / HERE.name)]
    started = time.perf_counter()
    got = _json_child([*argv, "--child", json.dumps(job)])
    got["wall_s"] = time.perf_counter() - started
    return got


def _torch_import_s() -> float:
    """Seconds a fresh interpreter takes to import torch and exit: the least a start of this
    project's runtime (a PyTorch process) can take, measured beside llama.cpp's whole start."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


# -- our side (in a child process) --------------------------------------------------------------


def _open(job: dict[str, Any], storage: str = "auto") -> Any:
    import torch

    from ggufswap.config import MapShards, Storage
    from ggufswap.runtime import HotSwapRuntime

    torch.set_num_threads(int(job["threads"]))
    return HotSwapRuntime.open(
        job["path"], storage=Storage(storage), map_shards=MapShards.AUTO, progress=False
    )


def _served(runtime: Any, numerics: str | None) -> str | None:
    """``numerics``, or (None) what ``runtime.numerics: auto`` serves over this store (the
    daemon's ``served_numerics``): ``"ggml"`` where every product is a libggml's, else None (the
    store's fastest products, float32 norms)."""
    from ggufswap.config import Numerics
    from ggufswap.runtime.serving.daemon import served_numerics

    if numerics is not None:
        return numerics
    chosen = served_numerics(runtime.store, Numerics.AUTO)[0]
    return None if chosen is Numerics.AUTO else chosen.value


def _model(runtime: Any, numerics: str | None = None) -> Any:
    from ggufswap.runtime.models import HParams, build_model

    config = HParams.from_metadata(runtime.shards.metadata)
    return build_model(config, runtime.store, store=runtime.store, numerics=numerics)


def _greedy_steps(model: Any, cache: Any, logits: Any, steps: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``steps`` greedy decode steps."""
    import torch

    took, cpu = [], []
    token = int(logits[0, -1].argmax())
    for _ in range(steps):
        started, started_cpu = time.perf_counter(), time.process_time()
        logits = model(torch.tensor([[token]]), start_pos=cache.length, cache=cache)
        token = int(logits[0, -1].argmax())
        took.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return statistics.median(took), statistics.median(cpu)


def child(job: dict[str, Any]) -> dict[str, Any]:
    """One measurement of ours (run with ``--child``), the OpenMP environment the ``ggufswap``
    command sets (cli/main.py: idle workers sleep) unless the caller's says otherwise."""
    from ggufswap.main import OPENMP_ENV

    for key, value in OPENMP_ENV.items():
        os.environ.setdefault(key, value)
    import structlog
    import torch

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    prompt = [int(t) for t in job.get("prompt", PROMPT)]
    what = job["what"]
    numerics = job.get("numerics")
    storage = {"ggml": "native", "exact": "dequantized"}.get(numerics or "", "auto")
    with _open(job, storage) as runtime, torch.inference_mode():
        served = _served(runtime, numerics)
        model = _model(runtime, served)
        out: dict[str, Any] = {
            "numerics": served or "auto",
            "storage": runtime.store.storage.value,
            "kernels": runtime.status()["kernels"],
        }
        if what in ("decode", "growth"):
            context = int(job.get("context", len(prompt)))
            tokens = [prompt[i % len(prompt)] for i in range(context)]
            cache = model.new_cache(max_len=context + int(job["steps"]) + 8)
            logits = None
            for start in range(0, context, EVAL_TOKENS):  # the prompt in batches
                chunk = torch.tensor([tokens[start : start + EVAL_TOKENS]])
                logits = model(chunk, start_pos=cache.length, cache=cache)
            steps = int(job["steps"])
            out["step_s"], out["step_cpu_s"] = _greedy_steps(model, cache, logits, steps)
        elif what == "eval":
            started, started_cpu = time.perf_counter(), time.process_time()
            model(torch.tensor([prompt]))
            out["eval_s"] = time.perf_counter() - started
            out["eval_cpu_s"] = time.process_time() - started_cpu
        elif what == "first":
            model(torch.tensor([prompt]))
        else:
            raise SystemExit(f"unknown measurement {what!r}")
    return out


# -- the rows -----------------------------------------------------------------------------------


def interleaved(
    rounds: int,
    measure_ours: Callable[[], dict[str, Any]],
    measure_llama: Callable[[], dict[str, Any]],
    key: str,
) -> tuple[float, float, dict[str, Any]]:
    """Median of ``key`` over ``rounds`` alternating runs: (llama.cpp's, ours, our last run)."""
    theirs, mine = [], []
    last: dict[str, Any] = {}
    for _ in range(rounds):
        last = measure_ours()
        mine.append(float(last[key]))
        theirs.append(float(measure_llama()[key]))
    return statistics.median(theirs), statistics.median(mine), last


def _key(name: str, cpu: bool) -> str:
    """``step_s`` / ``eval_s``, or their CPU-time twins (``--cpu-time``)."""
    return name.replace("_s", "_cpu_s") if cpu else name


def _decode(
    python: Path, rounds: int, cpu: bool, job: dict[str, Any]
) -> tuple[float, float, dict[str, Any], str]:
    """A decode job's step time, ours and llama.cpp's (and the ``--against`` build's, as
    ``before_s`` in the last result), interleaved over ``rounds``, ours in the numerics the
    runtime serves by default; the last of our results, and the row name's suffix (naming
    those numerics)."""
    key = _key("step_s", cpu)
    before: list[float] = []

    def measure() -> dict[str, Any]:
        got = ours(job)
        if AGAINST:
            before.append(float(ours(job, AGAINST[0])[key]))
        return got

    theirs, mine, last = interleaved(rounds, measure, lambda: llama(python, job), key)
    last["before_s"] = statistics.median(before) if before else None
    return theirs, mine, last, f", default numerics ({last['numerics']})"


# ``--against``: the other build measured beside ours in the decode rows (none: empty).
AGAINST: list[Path] = []


def _decode_row(name: str, theirs: float, mine: float, last: dict[str, Any]) -> dict[str, Any]:
    """A decode row, with the ``--against`` build's time and ratio where it was measured."""
    out = row(name, theirs, mine, 1.0)
    if last.get("before_s"):
        out["before_s"], out["before_ratio"] = last["before_s"], theirs / last["before_s"]
    return out


def gemma_rows(
    python: Path, path: Path, rounds: int, quick: bool, cpu: bool, *, decode_only: bool = False
) -> list[dict[str, Any]]:
    rows = []
    clock = " (CPU time)" if cpu else ""
    steps = 8 if quick else 32
    for threads in (1, 2):
        job = {"what": "decode", "path": str(path), "threads": threads, "steps": steps}
        theirs, mine, last, how = _decode(python, rounds, cpu, job)
        _say(f"gemma3 decode {threads} thread(s){how}: ours {1 / mine:.1f} tok/s "
             f"({last['storage']}, {last['kernels']}), llama.cpp {1 / theirs:.1f} tok/s"
             f"{clock}")  # fmt: skip
        name = f"gemma3 270M greedy decode, {threads} thread(s){how}{clock}"
        rows.append(_decode_row(name, theirs, mine, last))
    if decode_only:
        return rows
    prompt = [PROMPT[i % len(PROMPT)] for i in range(EVAL_TOKENS)]
    base = {"what": "eval", "path": str(path), "threads": 2, "prompt": prompt}
    figures = {}
    for numerics in ("ggml", "exact"):
        job = {**base, "numerics": numerics}
        figures[numerics] = interleaved(
            rounds, lambda job=job: ours(job), lambda: llama(python, base), _key("eval_s", cpu)
        )
        theirs, mine, _ = figures[numerics]
        _say(f"gemma3 eval ctx {EVAL_TOKENS} ({numerics}): ours {EVAL_TOKENS / mine:.0f} tok/s, "
             f"llama.cpp {EVAL_TOKENS / theirs:.0f} tok/s{clock}")  # fmt: skip
        target = 1.0 if numerics == "ggml" else None
        name = f"gemma3 270M eval ctx 512, 2 threads, {numerics}{clock}"
        rows.append(row(name, theirs, mine, target))
    rows.append(
        row("sweep numerics: ggml vs exact (eval)", figures["exact"][1], figures["ggml"][1], 1.0)
    )
    job = {"what": "first", "path": str(path), "threads": 2}
    theirs, mine, _ = interleaved(rounds, lambda: ours(job), lambda: llama(python, job), "wall_s")
    _say(f"gemma3 start to first logits: ours {mine:.2f} s, llama.cpp {theirs:.2f} s")
    rows.append(row("gemma3 270M process start to first logits", theirs, mine, 1 / 1.5))
    floor = statistics.median(_torch_import_s() for _ in range(rounds))
    _say(f"import torch alone: {floor:.2f} s ({floor / theirs:.2f}x llama.cpp's whole start)")
    rows.append(row("import torch alone (a PyTorch process's least start)", theirs, floor, None))
    growth: dict[str, tuple[float, float]] = {}
    contexts = (64, 1024) if quick else (64, 4096)
    for context in contexts:
        job = {"what": "growth", "path": str(path), "threads": 1, "steps": 8, "context": context}
        theirs, mine, _ = interleaved(
            rounds,
            lambda job=job: ours(job),
            lambda job=job: llama(python, job),
            _key("step_s", cpu),
        )
        growth[str(context)] = (theirs, mine)
    lo, hi = (str(c) for c in contexts)
    theirs_growth = growth[hi][0] / growth[lo][0]
    ours_growth = growth[hi][1] / growth[lo][1]
    _say(f"decode step growth {lo} -> {hi}: ours {ours_growth:.2f}x, "
         f"llama.cpp {theirs_growth:.2f}x")  # fmt: skip
    name = f"decode step growth {lo} -> {hi} context{clock}"
    rows.append(row(name, theirs_growth, ours_growth, 1.0))
    return rows


def moe_rows(python: Path, root: Path, rounds: int, quick: bool, cpu: bool) -> list[dict[str, Any]]:
    sys.path.insert(0, str(HERE.parent))
    from engine import moe_spec

    from ggufswap.shards.writer import write_model

    n_embd, n_ff, n_layers = (256, 256, 2) if quick else (1024, 512, 4)
    spec = moe_spec("moe128", n_layers=n_layers, n_embd=n_embd, n_expert=128, n_ff=n_ff)
    path = write_model(spec, root / "moe128")[0]
    rows = []
    clock = " (CPU time)" if cpu else ""
    job = {"what": "decode", "path": str(path), "threads": 1, "steps": 8 if quick else 32}
    job["prompt"] = [1, 2, 3, 4]
    theirs, mine, last, how = _decode(python, rounds, cpu, job)
    _say(f"qwen3moe 128 experts decode{how}: ours {mine * 1e3:.2f} ms/step "
         f"({last['kernels']}), llama.cpp {theirs * 1e3:.2f} ms/step{clock}")  # fmt: skip
    name = f"qwen3moe 128 experts (8 used) decode, 1 thread{how}{clock}"
    rows.append(_decode_row(name, theirs, mine, last))
    return rows


def _say(line: str) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"  {line}  [load {load}]", file=sys.stderr)


def run(
    quick: bool,
    rounds: int | None = None,
    llama_python: Path = LLAMA_PYTHON,
    *,
    cpu: bool = False,
    decode_only: bool = False,
) -> list[Any]:
    sys.path.insert(0, str(HERE.parent))
    from _real import REAL_PACKAGE, real_model

    if not llama_python.exists():
        _say(f"no llama.cpp to compare with: {llama_python} missing (make crosscheck builds it)")
        return []
    rounds = rounds or (1 if quick else 3)
    rows: list[dict[str, Any]] = []
    path = real_model()
    if path is None:
        _say(f"{REAL_PACKAGE} is not installed: no Gemma 3 270M rows")
    else:
        rows += gemma_rows(llama_python, path, rounds, quick, cpu, decode_only=decode_only)
    with tempfile.TemporaryDirectory(prefix="ggufswap-bench-llama-") as tmp:
        rows += moe_rows(llama_python, Path(tmp), rounds, quick, cpu)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="ratios of the processes' CPU time (steadier than wall time on a shared host)",
    )
    parser.add_argument("--decode-only", action="store_true", help="the decode rows alone")
    parser.add_argument(
        "--against",
        type=Path,
        help="another ggufswap checkout (with its .venv) measured beside ours in the decode rows",
    )
    parser.add_argument("--child", help="one measurement of ours (JSON job)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.against is not None:
        AGAINST.append(args.against.resolve())
    rows = run(
        args.quick, args.rounds, args.llama_python, cpu=args.cpu_time, decode_only=args.decode_only
    )
    for r in rows:
        before = ""
        if "before_ratio" in r:
            before = f", {args.against} {r['before_s']:.4g} (ratio {r['before_ratio']:.2f})"
        print(
            f"{r['name']}: llama.cpp {r['baseline_s']:.4g}, ours {r['ours_s']:.4g}, "
            f"ratio {r['ratio']:.2f} (target {r['target']}){before}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
