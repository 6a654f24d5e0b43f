"""Watcher backends behind one interface, the queue they report into, and the backend choice.

A backend only ever says "path P may have changed" or "rescan needed" (events were lost, a watch
could not be added, the backend failed). It never reads files or decides anything: the daemon's
main loop drains the :class:`ChangeQueue`, waits for paths to settle and re-scans. Because plans
are computed from what is on disk (level-triggered), a lost or duplicated report costs at most a
rescan, never an update.

Backends: ``watchdog`` (its inotify observer; the default), ``pyinotify`` (optional; it does not
import on Python >= 3.12) and ``polling`` (stat every entry every ``poll_interval_s``). ``auto``
picks watchdog, unless the directory's file system does not deliver inotify events for every
change (NFS, SMB/CIFS, FUSE, overlay...), where it polls.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ggufswap.agent.errors import BackendUnavailable
from ggufswap.config import WatchBackend
from ggufswap.config.fstypes import FsInfo, fs_info
from ggufswap.logs import get_logger

log = get_logger(__name__)

INOTIFY_QUEUE_SYSCTL = "fs.inotify.max_queued_events"
INOTIFY_WATCHES_SYSCTL = "fs.inotify.max_user_watches"


class RescanReason(str, enum.Enum):
    """Why a backend asks for a full rescan."""

    OVERFLOW = "overflow"  # the kernel queue overflowed: events were lost
    WATCH_LIMIT = "watch_limit"  # ENOSPC on add_watch
    BACKEND_ERROR = "backend_error"  # a backend thread died or reported an error
    ROOT_CHANGED = "root_changed"  # a watched directory vanished or was replaced
    PERIODIC = "periodic"  # agent.rescan_interval_s
    RELOAD = "reload"  # SIGHUP
    STALE = "stale"  # the runtime found a planned file changed


@dataclass(frozen=True, slots=True)
class RescanRequest:
    reason: RescanReason
    detail: str


class ChangeQueue:
    """Thread-safe sink of backend reports; coalesces repeated paths. Cheap for the reporter."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paths: dict[str, None] = {}
        self._rescans: list[RescanRequest] = []
        self._woken = False
        self.events = 0  # reports received, for status and tests

    def path_changed(self, path: str) -> None:
        """Report that ``path`` (a file or directory) may have changed."""
        with self._cond:
            self._paths[path] = None
            self.events += 1
            self._cond.notify()

    def rescan_needed(self, reason: RescanReason, detail: str) -> None:
        """Report that events may have been lost: every watched directory must be re-scanned."""
        with self._cond:
            self._rescans.append(RescanRequest(reason, detail))
            self.events += 1
            self._cond.notify()

    def wake(self) -> None:
        """Wake the consumer without reporting anything (state changes elsewhere)."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    def wait(self, timeout_s: float) -> None:
        """Block until something was reported or ``wake`` was called, at most ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(
                lambda: bool(self._paths or self._rescans or self._woken), max(0.0, timeout_s)
            )

    def drain(self) -> tuple[list[str], list[RescanRequest]]:
        """Everything reported since the last drain (paths deduplicated, in first-seen order)."""
        with self._cond:
            paths, rescans = list(self._paths), self._rescans
            self._paths, self._rescans, self._woken = {}, [], False
        return paths, rescans


class Watcher(ABC):
    """One backend instance watching any number of directories.

    ``add`` raises :class:`~ggufswap.agent.errors.WatchLimitError` when the kernel is out of
    watches and :class:`~ggufswap.agent.errors.WatchError` for a missing directory. ``healthy``
    turns False when the backend's thread died; the daemon then rebuilds it and rescans.
    """

    kind: WatchBackend

    def __init__(self, sink: ChangeQueue, *, poll_interval_s: float = 1.0) -> None:
        self._sink = sink
        self._poll_interval_s = poll_interval_s
        self._dirs: dict[str, bool] = {}  # directory -> recursive
        self.overflows = 0

    @property
    def directories(self) -> dict[str, bool]:
        return dict(self._dirs)

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self, timeout_s: float = 5.0) -> None: ...

    @abstractmethod
    def add(self, directory: str, *, recursive: bool) -> None: ...

    @abstractmethod
    def remove(self, directory: str) -> None: ...

    @abstractmethod
    def healthy(self) -> bool: ...

    def on_overflow(self) -> None:
        """The kernel dropped events: ask for a rescan and say which limit to raise."""
        self.overflows += 1
        log.warning(
            "watch.overflow",
            backend=self.kind.value,
            directories=sorted(self._dirs),
            fix=f"events were lost and a full rescan follows; raise {INOTIFY_QUEUE_SYSCTL} "
            "(docs/operations.md, inotify limits)",
        )
        self._sink.rescan_needed(RescanReason.OVERFLOW, f"{self.kind.value}: event queue overflow")

    def on_error(self, detail: str) -> None:
        """The backend reported an error: rescan, since events may be missing."""
        log.warning("watch.backend_error", backend=self.kind.value, error=detail)
        self._sink.rescan_needed(RescanReason.BACKEND_ERROR, f"{self.kind.value}: {detail}")


def make_watcher(kind: WatchBackend, sink: ChangeQueue, *, poll_interval_s: float = 1.0) -> Watcher:
    """A backend instance of ``kind`` (not ``AUTO``); ``BackendUnavailable`` if it cannot load."""
    if kind is WatchBackend.WATCHDOG:
        from ggufswap.agent._watchdog_backend import WatchdogWatcher

        return WatchdogWatcher(sink, poll_interval_s=poll_interval_s)
    if kind is WatchBackend.PYINOTIFY:
        from ggufswap.agent._pyinotify_backend import PyinotifyWatcher

        return PyinotifyWatcher(sink, poll_interval_s=poll_interval_s)
    if kind is WatchBackend.POLLING:
        from ggufswap.agent._polling_backend import PollingWatcher

        return PollingWatcher(sink, poll_interval_s=poll_interval_s)
    raise ValueError(f"make_watcher needs a concrete backend, not {kind.value!r}")


@dataclass(frozen=True, slots=True)
class BackendChoice:
    kind: WatchBackend
    why: str
    fs: FsInfo | None = None


def choose_backend(requested: WatchBackend, directory: str) -> BackendChoice:
    """The backend for ``directory``: what was asked for, or for ``auto`` what its fs allows."""
    if requested is not WatchBackend.AUTO:
        return BackendChoice(requested, "configured")
    fs = fs_info(directory)
    if not fs.inotify_reliable:
        return BackendChoice(
            WatchBackend.POLLING, f"{fs.name} file system: inotify misses changes there", fs
        )
    return BackendChoice(WatchBackend.WATCHDOG, f"{fs.name} file system supports inotify", fs)


def backend_available(kind: WatchBackend) -> str | None:
    """None when ``kind`` can be used here, else why not."""
    try:
        if kind is WatchBackend.WATCHDOG:
            from ggufswap.agent._watchdog_backend import load_watchdog

            load_watchdog()
        elif kind is WatchBackend.PYINOTIFY:
            from ggufswap.agent._pyinotify_backend import load_pyinotify

            load_pyinotify()
    except BackendUnavailable as exc:
        return str(exc)
    return None
