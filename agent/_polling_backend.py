"""The ``polling`` backend: stat every entry of the watched directories every ``poll_interval_s``.

For file systems where inotify misses changes (NFS, SMB, FUSE...) and on request. Entries are
compared by (inode, size, mtime, ctime) of what they point to, so a symlink re-pointed to another
blob, a rename over a file and a rewrite in place are all seen. Nothing is read.
"""

from __future__ import annotations

import os
import threading

from ggufswap.agent.errors import WatchError
from ggufswap.agent.watch import ChangeQueue, Watcher
from ggufswap.config import WatchBackend
from ggufswap.ipc.supervisor import Supervised, ThreadHealth
from ggufswap.logs import get_logger

log = get_logger(__name__)

_Stamp = tuple[int, int, int, int]
_MISSING: _Stamp = (-1, -1, -1, -1)


def _stamp(path: str) -> _Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return _MISSING
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def snapshot(directory: str, *, recursive: bool) -> dict[str, _Stamp]:
    """Stamps of ``directory`` itself and every entry in it (below it when ``recursive``)."""
    stamps = {directory: _stamp(directory)}
    pending = [directory]
    while pending:
        current = pending.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue
        for entry in entries:
            stamps[entry.path] = _stamp(entry.path)
            if recursive and entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
    return stamps


class PollingWatcher(Watcher):
    kind = WatchBackend.POLLING

    def __init__(self, sink: ChangeQueue, *, poll_interval_s: float = 1.0) -> None:
        super().__init__(sink, poll_interval_s=poll_interval_s)
        self._lock = threading.Lock()
        self._snapshots: dict[str, dict[str, _Stamp]] = {}
        self._stop = threading.Event()
        self._thread: Supervised | None = None

    def start(self) -> None:
        # Supervised: a crash of a poll (a bug) is logged and the loop restarted with backoff,
        # with a rescan, since changes may have been missed meanwhile.
        self._thread = Supervised(
            "ggufswap-agent-polling",
            self._run,
            stop=self._stop,
            on_crash=lambda exc: self.on_error(f"poll crashed: {type(exc).__name__}: {exc}"),
        ).start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            if not self._thread.join(timeout_s):
                log.error("watch.stop_timeout", backend=self.kind.value, timeout_s=timeout_s)
            self._thread = None

    def add(self, directory: str, *, recursive: bool) -> None:
        if not os.path.isdir(directory):
            raise WatchError(2, f"{directory}: no such directory to watch")
        with self._lock:
            self._snapshots[directory] = snapshot(directory, recursive=recursive)
            self._dirs[directory] = recursive

    def remove(self, directory: str) -> None:
        with self._lock:
            self._snapshots.pop(directory, None)
            self._dirs.pop(directory, None)

    def healthy(self) -> bool:
        """False once the supervised poll loop is given up (or ended without a stop)."""
        return (
            self._thread is None
            or not self._thread.down
            or (self._thread.health is ThreadHealth.RESTARTING)
        )

    def poll_once(self) -> None:
        """Compare every watched directory with its last snapshot and report what differs."""
        with self._lock:
            dirs = dict(self._dirs)
        for directory, recursive in dirs.items():
            new = snapshot(directory, recursive=recursive)
            with self._lock:
                if directory not in self._snapshots:
                    continue  # removed meanwhile
                old = self._snapshots[directory]
                self._snapshots[directory] = new
            for path in old.keys() | new.keys():
                if old.get(path) != new.get(path):
                    self._sink.path_changed(path)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_interval_s):
            try:
                self.poll_once()
            except OSError as exc:  # keep polling; the rescan covers what was missed
                self.on_error(f"{type(exc).__name__}: {exc}")
