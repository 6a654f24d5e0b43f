"""The ``watchdog`` backend: watchdog's inotify observer, one scheduled watch per directory.

Open and close-without-write events are not subscribed to: the agent itself opens shards to read
their headers, and must not wake itself up. watchdog >= 7 tells its inotify watch groups about a
kernel queue overflow; the emitter class is wrapped so that the hook reaches the agent (older
versions drop the overflow silently, and the periodic rescan covers that case).
"""

from __future__ import annotations

import errno
import os
from types import ModuleType
from typing import Any

from ggufswap.agent.errors import BackendUnavailable, WatchError, WatchLimitError
from ggufswap.agent.watch import INOTIFY_WATCHES_SYSCTL, ChangeQueue, Watcher
from ggufswap.config import WatchBackend
from ggufswap.logs import get_logger

log = get_logger(__name__)

OBSERVER_TIMEOUT_S = 0.2


def load_watchdog() -> tuple[ModuleType, ModuleType]:
    """``(watchdog.events, watchdog.observers.inotify)``, or ``BackendUnavailable``."""
    try:
        from watchdog import events
        from watchdog.observers import inotify
    except ImportError as exc:  # not Linux, or watchdog missing
        raise BackendUnavailable(
            f"backend 'watchdog' needs watchdog's inotify observer (Linux): {exc}; "
            "use backend: polling"
        ) from exc
    return events, inotify


def _hooked_emitter_class(base: type[Any], on_overflow: Any) -> type[Any]:
    """A subclass of watchdog's emitter whose watch group reports queue overflows to us."""

    class OverflowReportingEmitter(base):
        def on_thread_start(self) -> None:
            # A library thread, not supervised: the daemon rebuilds a backend that died
            # (``watch.backend_died``); named so that a status can tell it apart.
            self.name = "watchdog-emitter"
            super().on_thread_start()
            group = getattr(self, "_inotify", None)
            original = getattr(group, "on_queue_overflow", None)
            if group is None or original is None:
                return

            def hooked() -> None:
                original()
                on_overflow()

            group.on_queue_overflow = hooked

    return OverflowReportingEmitter


class WatchdogWatcher(Watcher):
    kind = WatchBackend.WATCHDOG

    def __init__(self, sink: ChangeQueue, *, poll_interval_s: float = 1.0) -> None:
        super().__init__(sink, poll_interval_s=poll_interval_s)
        events, inotify = load_watchdog()
        self._events = events
        self._observer = inotify.InotifyObserver(timeout=OBSERVER_TIMEOUT_S)
        self._observer.name = "watchdog-observer"  # a library thread the daemon checks
        # watchdog >= 7: BaseObserver keeps the emitter class; wrap it to see overflows.
        emitter_class = getattr(self._observer, "_emitter_class", None)
        self.overflow_hooked = emitter_class is not None and hasattr(inotify, "InotifyWatchGroup")
        if self.overflow_hooked and emitter_class is not None:
            self._observer._emitter_class = _hooked_emitter_class(emitter_class, self.on_overflow)
        self._handler = self._make_handler()
        self._filter = [
            events.FileCreatedEvent,
            events.DirCreatedEvent,
            events.FileDeletedEvent,
            events.DirDeletedEvent,
            events.FileMovedEvent,
            events.DirMovedEvent,
            events.FileModifiedEvent,
            events.FileClosedEvent,
        ]
        self._watches: dict[str, Any] = {}
        self._started = False

    def _make_handler(self) -> Any:
        sink = self._sink
        ignored = (self._events.DirModifiedEvent, self._events.FileOpenedEvent)

        class Handler(self._events.FileSystemEventHandler):  # type: ignore[name-defined]
            def dispatch(self, event: Any) -> None:
                if isinstance(event, ignored):
                    return
                if event.src_path:
                    sink.path_changed(os.fsdecode(event.src_path))
                dest = getattr(event, "dest_path", "")
                if dest:
                    sink.path_changed(os.fsdecode(dest))

        return Handler()

    def start(self) -> None:
        self._observer.start()  # started first, so that schedule() raises add_watch errors
        self._started = True

    def stop(self, timeout_s: float = 5.0) -> None:
        if not self._started:
            return
        self._started = False
        self._observer.stop()
        self._observer.join(timeout_s)
        if self._observer.is_alive():
            log.error("watch.stop_timeout", backend=self.kind.value, timeout_s=timeout_s)

    def add(self, directory: str, *, recursive: bool) -> None:
        if directory in self._watches:
            self.remove(directory)
        if not os.path.isdir(directory):
            raise WatchError(errno.ENOENT, f"{directory}: no such directory to watch")
        try:
            watch = self._observer.schedule(
                self._handler, directory, recursive=recursive, event_filter=self._filter
            )
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise WatchLimitError(
                    errno.ENOSPC,
                    f"{directory}: inotify watch limit reached; raise {INOTIFY_WATCHES_SYSCTL}",
                ) from exc
            raise WatchError(exc.errno or errno.EIO, f"{directory}: cannot watch: {exc}") from exc
        self._watches[directory] = watch
        self._dirs[directory] = recursive

    def remove(self, directory: str) -> None:
        watch = self._watches.pop(directory, None)
        self._dirs.pop(directory, None)
        if watch is None:
            return
        try:
            self._observer.unschedule(watch)
        except (KeyError, OSError) as exc:  # the emitter already stopped (directory deleted)
            log.debug("watch.unschedule_failed", directory=directory, error=str(exc))

    def healthy(self) -> bool:
        return not self._started or self._observer.is_alive()
