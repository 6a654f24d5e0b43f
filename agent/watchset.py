"""The directories the agent watches, and the backends that watch them.

The daemon's main loop owns one :class:`WatchSet`: it hands it the watch roots its models need
(:meth:`WatchSet.sync`), and every ``ROOT_CHECK_S`` asks it to look again (:meth:`WatchSet.check`):
a directory that vanished, appeared or was replaced (a new inode) is watched anew, and a backend
whose thread died is restarted. What changed so that a change could have gone unreported comes
back as full-scan requests, which the daemon makes. A directory that cannot be watched yet (it
does not exist) stays in the set, unwatched, until it appears; an inotify watch limit falls back
to polling for that directory and asks for a rescan (``RescanReason.WATCH_LIMIT``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ggufswap.agent.errors import WatchError, WatchLimitError
from ggufswap.agent.index import WatchRoot
from ggufswap.agent.watch import (
    INOTIFY_WATCHES_SYSCTL,
    ChangeQueue,
    RescanReason,
    Watcher,
    choose_backend,
    make_watcher,
)
from ggufswap.config import WatchBackend
from ggufswap.logs import get_logger

log = get_logger(__name__)

# (root, model name): one model's need of one directory.
Wanted = Iterable[tuple[WatchRoot, str]]


@dataclass
class _Watch:
    root: WatchRoot
    kind: WatchBackend | None  # None: not watched (missing directory)
    why: str
    identity: tuple[int, int] | None
    models: set[str] = field(default_factory=set)


def _dir_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class WatchSet:
    """Every directory some model needs, each watched by the backend chosen for it.

    Owned by the daemon's main loop (not thread-safe); the backends report into ``queue``.
    """

    def __init__(self, queue: ChangeQueue, *, stop_timeout_s: float) -> None:
        self.queue = queue
        self.watchers: dict[WatchBackend, Watcher] = {}
        self.watches: dict[str, _Watch] = {}
        self._rewatch: set[str] = set()  # directories an event says were deleted or moved
        self._stop_timeout_s = stop_timeout_s

    def sync(self, wanted: Wanted) -> None:
        """Watch every directory of ``wanted``; forget the others."""
        by_dir: dict[str, tuple[WatchRoot, set[str]]] = {}
        for root, model in wanted:
            by_dir.setdefault(root.directory, (root, set()))[1].add(model)
        for directory in [d for d in self.watches if d not in by_dir]:
            self.unwatch(directory)
        for directory, (root, models) in by_dir.items():
            current = self.watches.get(directory)
            identity = _dir_identity(directory)
            if current is not None and current.identity == identity and current.kind is not None:
                current.models = models
                continue
            if current is not None:
                self.unwatch(directory)
            self.watches[directory] = self._watch(root, models, identity)

    def event_on(self, path: str) -> bool:
        """A change reported at ``path``; True when it is a watched directory itself, to be
        looked at again at once (inotify reports its deletion or move: the watch is gone then,
        even if a new directory reuses the inode; polling reports every change of the
        directory's mtime, which needs no new watch)."""
        entry = self.watches.get(path)
        if entry is None:
            return False
        if entry.kind is not WatchBackend.POLLING:
            self._rewatch.add(path)
        return True

    def check(self, wanted: Wanted) -> list[tuple[RescanReason, str]]:
        """Re-watch directories that vanished, appeared or were replaced (inode changed), and
        restart backends that died; the full scans these changes call for."""
        wanted = list(wanted)
        rescans: list[tuple[RescanReason, str]] = []
        changed = False
        for directory, entry in list(self.watches.items()):
            if _dir_identity(directory) != entry.identity or directory in self._rewatch:
                changed = True
                log.info("watch.directory_changed", directory=directory)
                self.unwatch(directory)
        self._rewatch.clear()
        if not {root.directory for root, _ in wanted} <= set(self.watches):
            changed = True
        if changed:
            self.sync(wanted)
            rescans.append((RescanReason.ROOT_CHANGED, "watched directory changed"))
        for kind, watcher in list(self.watchers.items()):
            if not watcher.healthy():
                log.warning("watch.backend_died", backend=kind.value)
                dirs = watcher.directories
                watcher.stop(self._stop_timeout_s)
                del self.watchers[kind]
                for directory in dirs:
                    self.watches.pop(directory, None)
                self.sync(wanted)
                rescans.append((RescanReason.BACKEND_ERROR, f"{kind.value} restarted"))
        return rescans

    def unwatch(self, directory: str) -> None:
        entry = self.watches.pop(directory, None)
        if entry is not None and entry.kind is not None:
            self.watchers[entry.kind].remove(directory)

    def unwatch_all(self) -> None:
        for directory in list(self.watches):
            self.unwatch(directory)

    def close(self) -> None:
        """Stop every backend thread (each within the stop timeout)."""
        for watcher in self.watchers.values():
            watcher.stop(self._stop_timeout_s)
        self.watchers.clear()
        self.watches.clear()

    def status(self) -> dict[str, Any]:
        """The ``watched`` and ``backends`` parts of the agent's status."""
        watched = [
            {
                "models": sorted(w.models),
                "directory": d,
                "recursive": w.root.recursive,
                "backend": w.kind.value if w.kind else None,
                "why": w.why,
                "link_target": w.root.is_link_target,
                "watching": w.kind is not None,
            }
            for d, w in sorted(self.watches.items())
        ]
        backends = {
            kind.value: {
                "healthy": w.healthy(),
                "overflows": w.overflows,
                "directories": sorted(w.directories),
            }
            for kind, w in self.watchers.items()
        }
        return {"watched": watched, "backends": backends}

    # -- one directory -------------------------------------------------------------------------

    def _watcher(self, kind: WatchBackend, poll_interval_s: float) -> Watcher:
        watcher = self.watchers.get(kind)
        if watcher is None:
            watcher = make_watcher(kind, self.queue, poll_interval_s=poll_interval_s)
            watcher.start()
            self.watchers[kind] = watcher
        return watcher

    def _watch(self, root: WatchRoot, models: set[str], identity: tuple[int, int] | None) -> _Watch:
        directory = root.directory
        if identity is None:
            log.warning("watch.missing_directory", directory=directory, models=sorted(models))
            return _Watch(root, None, "directory does not exist (yet)", None, models)
        choice = choose_backend(root.config.backend, directory)
        kind, why = choice.kind, choice.why
        try:
            self._watcher(kind, root.config.poll_interval_s).add(
                directory, recursive=root.recursive
            )
        except WatchLimitError as exc:
            log.warning(
                "watch.limit_reached",
                directory=directory,
                error=str(exc),
                fix=f"raise {INOTIFY_WATCHES_SYSCTL} (docs/operations.md); polling meanwhile",
            )
            kind, why = WatchBackend.POLLING, f"inotify watch limit reached ({exc.strerror})"
            self._watcher(kind, root.config.poll_interval_s).add(
                directory, recursive=root.recursive
            )
            self.queue.rescan_needed(RescanReason.WATCH_LIMIT, directory)
        except WatchError as exc:
            log.warning("watch.failed", directory=directory, error=str(exc))
            return _Watch(root, None, str(exc), None, models)
        log.info(
            "watch.added",
            directory=directory,
            backend=kind.value,
            why=why,
            recursive=root.recursive,
            link_target=root.is_link_target,
        )
        return _Watch(root, kind, why, identity, models)
