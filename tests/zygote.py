"""``ggufswap`` commands forked from a process that imported torch once.

``import torch`` costs ~3 CPU-s; the suite starts a runtime, a sweep or a perplexity command
about a hundred times. The :class:`Zygote` is a helper process that imports the CLI and the
runtime once and then forks one child per command: the child runs the very same ``ggufswap``
entry point (argument parsing, logging, signal handlers, model load, sockets, serve loop) without
the interpreter start, and ends as the command would up to the module teardown: its exit status
as ``SystemExit`` gives it, non-daemon threads joined, ``atexit`` handlers run, streams flushed,
in the interpreter's own order. The teardown after that (torch's modules and objects freed one by
one) costs ~1-1.5 CPU-s a process and tests nothing of ours, so the child skips it with
``os._exit``. Killing it is a real
signal to a real process. The zygote reaps its children and writes each one's exit status (as
:attr:`subprocess.Popen.returncode` gives it: ``-9`` for SIGKILL) to a file beside its log.

:func:`shared` is the xdist worker's own zygote, started on first use and kept for the worker's
life (its two pipe descriptors are in :data:`SHARED_FDS`, which the leak check does not count);
``processes.run_ggufswap`` and ``processes.Proc`` fork the commands of :data:`FORKED_COMMANDS`
from it. A command that must start from a fresh interpreter (another thread count, a wrapper such
as ``setpriv``) runs as an ordinary subprocess. A test of what a process's exit does (a daemon
thread reading mapped weights while the interpreter finalizes) has the zygote fork a Python
program instead (``spawn(..., code=...)``), which exits as its interpreter would, teardown
included.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import tiers

# The commands that import torch, which the zygote has imported already.
FORKED_COMMANDS = frozenset({"runtime", "serve", "perplexity", "sweep"})
# What the zygote's children inherit from its start and could not change later: torch's OpenMP
# runtime reads these as it loads. A command whose environment says otherwise is not forked.
IMPORT_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
# What the zygote's start adds to the worker's environment. Unbuffered stdio lets a test read a
# child's log while it runs; a command that leaves it unset is forked all the same.
ZYGOTE_ENV = {"PYTHONUNBUFFERED": "1", **IMPORT_ENV}
# Variables read as an interpreter starts or a library loads (the import path, the allocator, the
# linker, OpenMP and MKL): a command that sets one differently from the zygote is not forked.
IMPORT_PREFIXES = ("PYTHON", "OMP_", "KMP_", "MKL_", "LD_", "MALLOC_")

_ZYGOTE = r"""
import atexit, json, os, signal, sys, threading, traceback
from ggufswap.main import main
# torch and the commands' modules, imported once before any fork; the HTTP mode's too (uvicorn,
# starlette, jinja2, the BPE tokenizers the tiny models use): ~0.45 CPU-s a forked server saves
import ggufswap.runtime.serving.daemon, ggufswap.runtime.serving.perplexity, ggufswap.sweep
import ggufswap.runtime.serving.http, ggufswap.runtime.serving.generate, tokenizers
import ggufswap.runtime.serving.tokenizer, ggufswap.runtime.serving.metrics

exits = {}  # child pid -> the file its exit status goes to

def reap(*_):
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exits.pop(pid, None)
        if path is not None:
            with open(path + ".tmp", "w") as f:
                cpu = usage.ru_utime + usage.ru_stime
                f.write(f"{os.waitstatus_to_exitcode(status)} {cpu:.3f}")
            os.rename(path + ".tmp", path)

def child(req):
    setup(req)
    sys.argv = [req["argv0"], *req["args"]]
    try:
        return main(req["args"])
    except SystemExit as exc:
        return exc.code
    except BaseException:
        traceback.print_exc()
        return 1

def program(req):
    # A Python program (python -c CODE ARGS) whose exit is the interpreter's own, teardown
    # included: SystemExit leaves the zygote's loop and the interpreter finalizes as it would.
    setup(req)
    sys.argv = ["-c", *req["args"]]
    try:
        exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)
    raise SystemExit(0)

def setup(req):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    os.environ.clear(); os.environ.update(req["env"])
    os.chdir(req["cwd"])
    flags = os.O_WRONLY | os.O_CREAT  # made empty by spawn()
    log = os.open(req["log"], flags, 0o644)
    out = os.open(req["out"], flags, 0o644) if "out" in req else os.dup(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0); os.dup2(out, 1); os.dup2(log, 2)
    os.close(log); os.close(out); os.close(null)

def finish(code):
    # The interpreter's exit (Py_FinalizeEx) up to the module teardown, in its order.
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # non-daemon threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)

signal.signal(signal.SIGCHLD, reap)
sys.stdout.write("ready\n"); sys.stdout.flush()
for line in sys.stdin:
    req = json.loads(line)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # reap() must know the pid first
    pid = os.fork()
    if pid == 0:
        if "code" in req:
            program(req)  # raises SystemExit: the interpreter's whole exit
        finish(child(req))  # the console script's exit, less the module teardown
    exits[pid] = req["exit"]
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    sys.stdout.write(f"{pid}\n"); sys.stdout.flush()
"""


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class Zygote:
    """A process that has imported the runtime and forks ``ggufswap`` commands on request."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # One torch thread, as the tests' in-process fresh loads use: results are bit-exact
            # only between equal thread counts (and 2 busy cores gain nothing from more).
            env={**os.environ, **ZYGOTE_ENV},
        )
        assert self.popen.stdout is not None
        assert self.popen.stdin is not None
        first = self.popen.stdout.readline().strip()
        assert first == "ready", f"zygote did not start: {first!r}"

    def spawn(
        self,
        args: list[str],
        *,
        log: Path,
        out: Path | None = None,
        env: dict[str, str] | None = None,
        code: str | None = None,
        cwd: Path | None = None,
    ) -> Child:
        """Fork ``ggufswap ARGS``: its stderr goes to ``log``, and its stdout too unless ``out``
        names a file of its own (a command whose printed output is checked); ``env`` is added
        to this process's environment for the child, which starts in ``cwd`` (default: this
        process's directory). With ``code``, the child runs ``python -c CODE ARGS`` instead and
        exits as that interpreter would, module teardown included (a test of what happens at a
        process's exit)."""
        what = "python -c" if code is not None else f"ggufswap {' '.join(args[:1])}"
        tiers.starting(f"asked the zygote to fork `{what}`")
        assert self.popen.stdin is not None
        assert self.popen.stdout is not None
        exit_file = log.with_suffix(log.suffix + ".exit")
        exit_file.unlink(missing_ok=True)
        for path in (log, out):
            if path is not None:
                path.write_bytes(b"")  # there (and empty) from the start, as Popen's would be
        request: dict[str, Any] = {
            "args": args,
            "argv0": str(Path(sys.executable).with_name("ggufswap")),
            "log": str(log),
            "exit": str(exit_file),
            "env": {**os.environ, **(env or {})},
            "cwd": str(cwd or os.getcwd()),
        }
        if out is not None:
            request["out"] = str(out)
        if code is not None:
            request["code"] = code
        self.popen.stdin.write(json.dumps(request) + "\n")
        self.popen.stdin.flush()
        return Child(int(self.popen.stdout.readline()), log, exit_file)

    def close(self) -> None:
        from processes import close_piped

        close_piped(self.popen)


@dataclass
class Child:
    """A forked ``ggufswap`` process (not our child: the zygote reaps it). It answers the part
    of :class:`subprocess.Popen` the tests use (``pid``, ``poll``, ``wait``, ``send_signal``,
    ``kill``, ``returncode``)."""

    pid: int
    log_path: Path
    exit_path: Path
    _counted: bool = field(default=False, repr=False)
    # CPU seconds of the children whose exit status this worker has read (the zygote writes each
    # child's beside its status; the kernel counts them to the zygote), for tests/cpu_times.py.
    reaped_cpu_s: ClassVar[float] = 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        """The exit status as ``Popen.returncode`` gives it; None while it runs."""
        try:
            code, cpu = self.exit_path.read_text().split()
        except FileNotFoundError:
            return None
        if not self._counted:  # the first reader adds the child's CPU to the worker's sum
            self._counted = True
            Child.reaped_cpu_s += float(cpu)
        return int(code)

    def poll(self) -> int | None:
        return self.returncode

    def alive(self) -> bool:
        return self.returncode is None

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the zygote has reaped the process; ``TimeoutExpired`` after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = 0.002
        while (code := self.returncode) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"ggufswap (pid {self.pid})", timeout or 0.0)
            time.sleep(interval)
            interval = min(interval * 2, 0.05)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it ended; the zygote is writing its status

    def kill(self) -> None:
        """SIGKILL and wait until the process is gone."""
        self.send_signal(signal.SIGKILL)
        self.wait(10)

    def stop(self, *, timeout: float = 15.0) -> int:
        """SIGTERM, wait, return the exit status."""
        self.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pid {self.pid} did not stop within {timeout}s") from None

    def exit_code(self) -> int:
        """The exit status of the ended process (-1 while it runs)."""
        code = self.returncode
        return -1 if code is None else code


# The worker's zygote and the descriptors it holds open for the worker's life.
_SHARED: list[Zygote] = []

SHARED_FDS: set[int] = set()


def shared() -> Zygote:
    """This process's zygote, started on first use and closed at exit."""
    if not _SHARED:
        zygote = Zygote()
        _SHARED.append(zygote)
        assert zygote.popen.stdin is not None
        assert zygote.popen.stdout is not None
        SHARED_FDS.update({zygote.popen.stdin.fileno(), zygote.popen.stdout.fileno()})
        atexit.register(zygote.close)
    return _SHARED[0]


def forkable(args: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether ``ggufswap ARGS`` with ``env`` added can be forked from the zygote: a command that
    imports torch, in the environment the zygote imported it in."""
    if not args or args[0] not in FORKED_COMMANDS:
        return False
    # Unset, IMPORT_ENV's variables mean what the zygote set: one thread is the tests' default
    # (conftest.py), and `ggufswap` sets the passive wait policy before torch loads.
    final = {**IMPORT_ENV, **os.environ, **(env or {})}
    started = {**os.environ, **ZYGOTE_ENV}
    keys = {k for k in final.keys() | started.keys() if k.startswith(IMPORT_PREFIXES)}
    return all(final.get(k) == started.get(k) for k in keys - {"PYTHONUNBUFFERED"})
