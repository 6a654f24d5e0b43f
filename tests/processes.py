"""Real ggufswap subprocesses for tests: start, wait until they answer, stop with a bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import zygote

from ggufswap.ipc import Fields, MessageType, PeerTimeout, make_message, request

GGUFSWAP = str(Path(sys.executable).with_name("ggufswap"))

# A probe-mode runtime runs its fixed batch, then pauses this long: the default pause (0.01 s)
# kept about a third of a core busy per idle runtime, a large share of the suite's CPU. A staged
# plan commits after the pause (50 ms on average); the kill matrix sets its own interval.
PROBE_INTERVAL_S = 0.1
PROBE = ("--mode", "probe", "--batch-interval", str(PROBE_INTERVAL_S))
PROBE_YAML = f"{{mode: probe, batch_interval_s: {PROBE_INTERVAL_S}}}"


def run_ggufswap(
    *args: str | os.PathLike[str], timeout: float = 60.0, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``ggufswap ARGS`` to the end (killed after ``timeout``); its exit code and text output,
    with ``env`` added to this process's environment. A command that imports torch is forked
    from the worker's zygote (tests/zygote.py), the others run as subprocesses."""
    argv = [*map(str, args)]
    if zygote.forkable(argv, dict(env or {})):
        return _run_forked(argv, timeout=timeout, env=dict(env or {}))
    return subprocess.run(
        [GGUFSWAP, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def _run_forked(
    argv: list[str], *, timeout: float, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="ggufswap-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = zygote.shared().spawn(argv, log=err, out=out, env=env)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            raise subprocess.TimeoutExpired([GGUFSWAP, *argv], timeout) from None
        return subprocess.CompletedProcess(
            [GGUFSWAP, *argv],
            code,
            out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )


def close_piped(popen: subprocess.Popen[Any], *, timeout_s: float = 10.0) -> None:
    """End a child driven through pipes: close its stdin (its cue to exit), wait, kill it if it
    does not exit within ``timeout_s``, and close its stdout."""
    if popen.stdin is not None:
        popen.stdin.close()
    try:
        popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(timeout_s)
    if popen.stdout is not None:
        popen.stdout.close()


def wait_for(
    predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def status_of(endpoint: str, *, timeout: float = 1.0) -> dict[str, Any] | None:
    """The ``status`` body of the process at ``endpoint``, or None if it does not answer."""
    try:
        reply = request(endpoint, make_message(MessageType.STATUS), timeout_s=timeout, retries=0)
    except PeerTimeout:
        return None
    status = reply.get(Fields.STATUS)
    return status if isinstance(status, dict) else None


class Proc:
    """A ``ggufswap`` process with its log in a file: forked from the worker's zygote when it
    imports torch (tests/zygote.py), else a subprocess."""

    def __init__(
        self,
        args: list[str],
        *,
        log: Path,
        env: dict[str, str] | None = None,
        wrapper: tuple[str, ...] = (),
        fresh: bool = False,
    ) -> None:
        """``wrapper``: a command that runs ``ggufswap ARGS`` (``unshare ...``, ``setpriv ...``);
        ``fresh``: the installed command from its interpreter's start, never forked."""
        self.log_path = log
        self.popen: subprocess.Popen[bytes] | zygote.Child
        if not (wrapper or fresh) and zygote.forkable(args, env):
            self._log: BinaryIO | None = None
            self.popen = zygote.shared().spawn(args, log=log, env=env)
            return
        self._log = log.open("wb")
        try:
            self.popen = subprocess.Popen(
                [*wrapper, GGUFSWAP, *args],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
            )
        except BaseException:
            self._log.close()  # the start was refused (tests/tiers.py) or failed
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self, *, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; kill and fail if it does not exit within ``timeout`` (a bound for
        a hung process, not a speed check: with the suite's workers and other jobs on 2 cores a
        runtime that logged ``runtime.stopped`` took over 15 s to exit; a test of the shutdown
        bound passes its own)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
                self._close_log()
                raise AssertionError(
                    f"process did not stop within {timeout}s:\n{self.log()}"
                ) from None
        self._close_log()
        code = self.popen.returncode
        assert code is not None
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()


def write_config(
    tmp: Path, *, model_dir: Path, first: Path, run_dir: Path, model: str = "tiny-moe"
) -> Path:
    """A config for an agent watching ``model_dir`` and a runtime serving ``first`` (small dev
    pool, host fallback), with ipc endpoints in ``run_dir``."""
    config = tmp / "config.yaml"
    config.write_text(
        f"""
agent:
  status_endpoint: ipc://{run_dir}/agent.sock
  rescan_interval_s: 300
models:
  - name: {model}
    runtime: ipc://{run_dir}/rt.sock
    watch:
      - path: {model_dir}
    settle_ms: 100
    verify: checksum
runtime:
  name: {model}
  model: {first}
  control_endpoint: ipc://{run_dir}/rt.sock
  status_endpoint: ipc://{run_dir}/rt.status.sock
  events_endpoint: ipc://{run_dir}/rt.events.sock
  pools:
    - {{name: dev, device: cpu, budget: 1MiB}}
    - {{name: host, device: cpu}}
"""
    )
    return config
