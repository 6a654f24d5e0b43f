"""Child ``ggufswap`` processes seen from their parent: start, status polls, events, bounded stop.

The process sweep (:mod:`.procs`) and the demo (``ggufswap demo``) both run a runtime and an
agent this way: this module only knows how to run a ``ggufswap`` subcommand with its log in a
file, how to ask a process for its status, and how to collect the runtime's ``plan.committed``
events (with the parent's own receive time) on a thread. Failures are :class:`ChildFailed`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import zmq

from ggufswap.ipc import (
    Fields,
    IpcError,
    MessageType,
    PeerTimeout,
    Subscriber,
    Topic,
    make_message,
    request,
)
from ggufswap.ipc.supervisor import Supervised
from ggufswap.sweep.errors import ChildFailed

T = TypeVar("T")

STOP_TIMEOUT_S: Final = 15.0
POLL_INTERVAL_S: Final = 0.05
LOG_TAIL_LINES: Final = 30


def poll_until(
    probe: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """Call ``probe`` until it returns something other than None; ChildFailed after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    wake = threading.Event()  # never set: a wait with a timeout that nothing else can cut short
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise ChildFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        wake.wait(interval_s)


def status_of(endpoint: str, *, timeout_s: float = 1.0) -> dict[str, Any] | None:
    """The ``status`` body of the process at ``endpoint``, or None if it does not answer."""
    try:
        reply = request(endpoint, make_message(MessageType.STATUS), timeout_s=timeout_s, retries=0)
    except PeerTimeout:
        return None
    status = reply.get(Fields.STATUS)
    return status if isinstance(status, dict) else None


class Child:
    """A ``ggufswap SUBCOMMAND ...`` subprocess with stdout and stderr in a log file."""

    def __init__(self, name: str, args: list[str], *, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "ggufswap", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check_alive(self) -> None:
        """ChildFailed with the end of the log if the process has exited."""
        if not self.alive():
            raise ChildFailed(
                f"the {self.name} process exited with status {self.popen.returncode}; "
                f"end of {self.log_path}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, *, timeout_s: float = STOP_TIMEOUT_S) -> str:
        """SIGTERM and wait; SIGKILL after ``timeout_s``. Returns how it ended, in words."""
        try:
            if self.popen.poll() is None:
                self.popen.send_signal(signal.SIGTERM)
                try:
                    self.popen.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait(5.0)
                    return f"{self.name}: did not stop within {timeout_s:.0f} s, killed"
            return f"{self.name}: exited with status {self.popen.returncode}"
        finally:
            self._log.close()


@dataclass(frozen=True, slots=True)
class Committed:
    """A ``plan.committed`` event and when the parent received it (``time.monotonic()``)."""

    received_at: float
    plan_id: str
    weight_version: int
    stall_ms: float | None
    changed: tuple[str, ...]


class CommitEvents:
    """Collects the runtime's ``plan.committed`` events on a thread (SUB sockets stay in it).

    The thread is supervised (``ipc/supervisor.py``, not essential): a bug is logged and the
    subscription opened again after a backoff (events published meanwhile are missed: a wait
    for one then times out instead of the thread dying unseen)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._cond = threading.Condition()
        self._events: list[Committed] = []
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: str | None = None
        self._thread = Supervised(
            "ggufswap-commit-events",
            self._run,
            stop=self._stop,
            essential=False,
            context={"endpoint": endpoint},
        )

    def start(self) -> CommitEvents:
        self._thread.start()
        if not self._started.wait(5.0) or self._error is not None:
            why = f": {self._error}" if self._error else ""
            raise ChildFailed(f"could not subscribe to {self.endpoint}{why}")
        return self

    def _run(self) -> None:
        try:
            sub = Subscriber(self.endpoint, topics=(Topic.PLAN_COMMITTED,))
        except (IpcError, zmq.ZMQError) as exc:  # reported by start(), not as a traceback
            self._error = str(exc)
            self._started.set()
            return
        with sub:
            self._started.set()
            while not self._stop.is_set():
                got = sub.recv(0.1)
                if got is not None:
                    self._add(got[1])

    def _add(self, payload: Mapping[str, Any]) -> None:
        stall = payload.get("stall_ms")
        event = Committed(
            received_at=time.monotonic(),
            plan_id=str(payload.get("plan_id")),
            weight_version=int(payload.get("weight_version", -1)),
            stall_ms=float(stall) if isinstance(stall, (int, float)) else None,
            changed=tuple(str(n) for n in payload.get("changed") or ()),
        )
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def since(self, t0: float) -> list[Committed]:
        with self._cond:
            return [e for e in self._events if e.received_at >= t0]

    def wait(
        self, predicate: Callable[[Committed], bool], *, after: float, timeout_s: float
    ) -> Committed | None:
        """The first event received at or after ``after`` that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for event in self._events:
                    if event.received_at >= after and predicate(event):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
