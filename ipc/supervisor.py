"""Supervised threads: every long-lived thread of the agent and the runtime runs under one of these.

A :class:`Supervised` thread runs its ``body`` until the body returns (its work is over: the owner
stopped it, or it had nothing left to do). When the body raises, the supervisor logs
``thread.crashed`` with the traceback, waits a backoff (doubling from ``Backoff.initial`` to
``Backoff.maximum``, cut short by the owner's stop flag) and runs the body again. A body that ran
for ``Backoff.healthy_after_s`` without raising has recovered: the next crash starts the backoff
afresh.

Health, for the systemd watchdog: a thread is *down* from the moment its body raised until it has
run again, and *dead* once an essential thread has crashed ``Backoff.give_up_after`` times in a
row (then it is not restarted). :func:`down` names the essential threads that are down or dead;
:class:`~ggufswap.ipc.sdnotify.WatchdogPinger` sends no ``WATCHDOG=1`` while it names any, so
systemd restarts a process whose essential thread keeps failing (``WatchdogSec=``), and the
daemons also exit non-zero when one is dead (:func:`on_dead`), for a process without a watchdog.
A thread that is not essential (the scrub, the metrics) is restarted forever and never stops the
pings.

Failpoints, for tests: ``GGUFSWAP_FAILPOINTS="PATTERN=COUNT[,PATTERN=COUNT...]"`` makes the body
of every supervised thread whose name matches the glob ``PATTERN`` raise
:class:`~ggufswap.ipc.errors.InjectedFault` at its first ``COUNT`` starts (``COUNT`` ``always``:
at every start). Unset, it costs one dictionary lookup per start.
"""

from __future__ import annotations

import enum
import fnmatch
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ggufswap.ipc.errors import InjectedFault
from ggufswap.logs import get_logger

log = get_logger(__name__)

ENV_FAILPOINTS: Final = "GGUFSWAP_FAILPOINTS"
ALWAYS: Final = "always"


@dataclass(frozen=True, slots=True)
class Backoff:
    """How a crashed body is restarted: waits doubling from ``initial`` to ``maximum`` seconds;
    an essential thread is given up after ``give_up_after`` crashes in a row (a run of
    ``healthy_after_s`` without a crash ends the row)."""

    initial: float = 0.1
    maximum: float = 2.0
    give_up_after: int = 6  # ~3 s of restarts (0.1 + 0.2 + 0.4 + 0.8 + 1.6), then dead
    healthy_after_s: float = 30.0

    def delay(self, crashes: int) -> float:
        """The wait before restart number ``crashes`` of a row (1 for the first)."""
        return min(self.maximum, self.initial * 2 ** max(0, crashes - 1))


DEFAULT_BACKOFF: Final = Backoff()


class ThreadHealth(str, enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    RESTARTING = "restarting"  # the body raised; waiting its backoff
    DEAD = "dead"  # an essential body raised give_up_after times in a row: not restarted
    STOPPED = "stopped"  # the body returned (its owner stopped it, or its work was over)


class Supervised:
    """A thread that runs ``body`` and restarts it with backoff when it raises.

    ``stop`` is the owner's stop flag (the body returns when it is set; a backoff wait ends at
    once). ``on_crash(exc)`` runs in the thread after each crash, before the backoff (to give up
    what the body held: a plan it was staging). ``on_exit()`` runs in the thread once, after the
    last run of the body (closing what the body's runs shared: a socket).
    """

    def __init__(
        self,
        name: str,
        body: Callable[[], None],
        *,
        stop: threading.Event,
        essential: bool = True,
        backoff: Backoff = DEFAULT_BACKOFF,
        on_crash: Callable[[BaseException], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.essential = essential
        self._body = body
        self._stop = stop
        self._backoff = backoff
        self._on_crash = on_crash
        self._on_exit = on_exit
        self._log = log.bind(thread=name, **(context or {}))
        self._thread: threading.Thread | None = None
        self.health = ThreadHealth.CREATED
        self.restarts = 0
        self.crashes_in_a_row = 0
        self.last_error: str | None = None
        self.started_at = 0.0  # monotonic, of the body's current run

    # -- the owner's side ------------------------------------------------------------------

    def start(self) -> Supervised:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.health = ThreadHealth.RUNNING
        _REGISTRY.add(self)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (the owner set ``stop``); True if it has."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        _REGISTRY.discard(self)
        return True

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def down(self) -> bool:
        """Not doing its work while it should: restarting, dead, or ended without a stop."""
        if self.health in (ThreadHealth.RESTARTING, ThreadHealth.DEAD):
            return True
        if self.health is ThreadHealth.RUNNING:
            return not self.is_alive()  # killed without the supervisor seeing it end
        return False

    def status(self) -> dict[str, Any]:
        return {
            "health": self.health.value,
            "essential": self.essential,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self.started_at = time.monotonic()
                self.health = ThreadHealth.RUNNING
                try:
                    _failpoint(self.name)
                    self._body()
                except BaseException as exc:  # noqa: BLE001 (a thread that dies silently is the bug)
                    if not self._crashed(exc):
                        return
                    continue
                self.health = ThreadHealth.STOPPED
                return
        finally:
            try:
                if self._on_exit is not None:
                    self._on_exit()
            except Exception:  # noqa: BLE001 (logged; the thread ends either way)
                self._log.exception("thread.exit_failed")

    def _crashed(self, exc: BaseException) -> bool:
        """Log the crash and wait its backoff; False when the thread must not run again."""
        now = time.monotonic()
        if now - self.started_at >= self._backoff.healthy_after_s:
            self.crashes_in_a_row = 0
        self.crashes_in_a_row += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.health = ThreadHealth.RESTARTING
        give_up = self.essential and self.crashes_in_a_row >= self._backoff.give_up_after
        delay = self._backoff.delay(self.crashes_in_a_row)
        self._log.error(
            "thread.crashed",
            error=self.last_error,
            crashes_in_a_row=self.crashes_in_a_row,
            restart_in_s=None if give_up else round(delay, 3),
            exc_info=exc,
        )
        if self._on_crash is not None:
            try:
                self._on_crash(exc)
            except Exception:  # noqa: BLE001 (logged; the restart goes on)
                self._log.exception("thread.on_crash_failed")
        if give_up:
            self.health = ThreadHealth.DEAD
            self._log.error(
                "thread.dead",
                error=self.last_error,
                crashes_in_a_row=self.crashes_in_a_row,
                essential=self.essential,
            )
            _call_dead_hooks(self)
            return False
        if self._stop.wait(delay):
            self.health = ThreadHealth.STOPPED
            return False
        self.restarts += 1
        self._log.info("thread.restarted", restarts=self.restarts)
        return True


# -- the process's view ----------------------------------------------------------------------

_REGISTRY: Final[weakref.WeakSet[Supervised]] = weakref.WeakSet()
_dead_hooks: list[Callable[[str], None]] = []
_hooks_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """Threads do not survive a fork: the child's supervised threads are the ones it starts."""
    _REGISTRY.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def threads() -> list[Supervised]:
    """The supervised threads of this process that were started and not yet joined."""
    return sorted(_REGISTRY, key=lambda s: s.name)


def down() -> list[str]:
    """The essential threads that are down (restarting, dead, or ended unseen), by name."""
    return sorted(s.name for s in list(_REGISTRY) if s.essential and s.down)


def unsupervised() -> list[str]:
    """The names of this process's other Python threads (besides the main one): library
    threads (watchdog's observers, ZeroMQ's authenticator, an HTTP server's), for a status."""
    ours = {s.thread for s in list(_REGISTRY)}
    main = threading.main_thread()
    return sorted(t.name for t in threading.enumerate() if t is not main and t not in ours)


def snapshot() -> dict[str, dict[str, Any]]:
    """For a process's ``status``: every supervised thread's health, restarts and last error."""
    return {s.name: s.status() for s in threads()}


def on_dead(hook: Callable[[str], None]) -> Callable[[], None]:
    """Call ``hook(thread name)`` (from that thread) when an essential thread is given up; the
    daemons stop and exit non-zero then. A thread given up before the hook was added (during a
    model load) is reported to it at once. Returns the function that removes the hook."""
    with _hooks_lock:
        _dead_hooks.append(hook)
    for thread in threads():
        if thread.essential and thread.health is ThreadHealth.DEAD:
            hook(thread.name)

    def remove() -> None:
        with _hooks_lock:
            if hook in _dead_hooks:
                _dead_hooks.remove(hook)

    return remove


def _call_dead_hooks(thread: Supervised) -> None:
    with _hooks_lock:
        hooks = list(_dead_hooks)
    for hook in hooks:
        try:
            hook(thread.name)
        except Exception:
            log.exception("thread.dead_hook_failed", thread=thread.name)


# -- failpoints ------------------------------------------------------------------------------

_failpoints: dict[str, int | None] = {}  # pattern -> starts to fail, per thread (None: all)
_fired: dict[tuple[str, str], int] = {}  # (pattern, thread name) -> starts it failed
_loaded = threading.Event()  # set once the environment was read (at the first start)
_failpoints_lock = threading.Lock()


def load_failpoints(text: str | None = None) -> dict[str, int | None]:
    """Arm the failpoints of ``text`` (default: ``$GGUFSWAP_FAILPOINTS``); returns them.
    Raises ``ValueError`` naming the entry that is not ``PATTERN=COUNT``."""
    spec = os.environ.get(ENV_FAILPOINTS, "") if text is None else text
    armed: dict[str, int | None] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        pattern, sep, count = entry.rpartition("=")
        if not sep or not pattern or not (count == ALWAYS or count.isdigit()):
            raise ValueError(
                f"{ENV_FAILPOINTS}: expected PATTERN=COUNT or PATTERN={ALWAYS}, found {entry!r}"
            )
        armed[pattern] = None if count == ALWAYS else int(count)
    with _failpoints_lock:
        _failpoints.clear()
        _failpoints.update(armed)
        _fired.clear()
        _loaded.set()
    return armed


def _failpoint(name: str) -> None:
    if not _loaded.is_set():
        try:
            load_failpoints()
        except ValueError as exc:  # said once; the process runs without failpoints
            log.error("thread.failpoints_invalid", error=str(exc))
            load_failpoints("")
    if not _failpoints:
        return
    with _failpoints_lock:
        for pattern, count in _failpoints.items():
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            fired = _fired.get((pattern, name), 0)
            if count is not None and fired >= count:
                continue
            _fired[(pattern, name)] = fired + 1
            raise InjectedFault(f"failpoint {pattern!r} ({ENV_FAILPOINTS}) in thread {name}")
