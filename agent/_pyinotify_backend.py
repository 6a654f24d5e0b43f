"""The ``pyinotify`` backend (optional): a pyinotify ``ThreadedNotifier`` over one WatchManager.

pyinotify 0.9.6 imports ``asyncore``, which Python 3.12 removed; there the backend is unavailable
and says so. Overflows arrive as ``IN_Q_OVERFLOW`` events and ask for a rescan.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings
from types import ModuleType
from typing import Any

from ggufswap.agent.errors import BackendUnavailable, WatchError, WatchLimitError
from ggufswap.agent.watch import INOTIFY_WATCHES_SYSCTL, ChangeQueue, Watcher
from ggufswap.config import WatchBackend
from ggufswap.logs import get_logger

log = get_logger(__name__)

NOTIFIER_TIMEOUT_MS = 200


def load_pyinotify() -> ModuleType:
    """The ``pyinotify`` module, or ``BackendUnavailable`` saying why it cannot be used."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # asyncore, on 3.11
            import pyinotify
    except ImportError as exc:
        hint = (
            "pyinotify 0.9.6 needs asyncore, removed in Python 3.12"
            if sys.version_info >= (3, 12)
            else "install the 'pyinotify' extra"
        )
        raise BackendUnavailable(
            f"backend 'pyinotify' cannot be used on Python "
            f"{sys.version_info.major}.{sys.version_info.minor}: {exc} ({hint}); "
            "use backend: watchdog (the default) or polling"
        ) from exc
    return pyinotify


class PyinotifyWatcher(Watcher):
    kind = WatchBackend.PYINOTIFY

    def __init__(self, sink: ChangeQueue, *, poll_interval_s: float = 1.0) -> None:
        super().__init__(sink, poll_interval_s=poll_interval_s)
        pyinotify = load_pyinotify()
        self._pi = pyinotify
        self._mask = (
            pyinotify.IN_CLOSE_WRITE
            | pyinotify.IN_MOVED_TO
            | pyinotify.IN_MOVED_FROM
            | pyinotify.IN_CREATE
            | pyinotify.IN_DELETE
            | pyinotify.IN_MODIFY
            | pyinotify.IN_ATTRIB
            | pyinotify.IN_DELETE_SELF
            | pyinotify.IN_MOVE_SELF
        )
        self._wm = pyinotify.WatchManager()
        self._notifier = pyinotify.ThreadedNotifier(
            self._wm, default_proc_fun=self._make_handler(), timeout=NOTIFIER_TIMEOUT_MS
        )
        self._notifier.daemon = True
        self._wds: dict[str, list[int]] = {}
        self._started = False

    def _make_handler(self) -> Any:
        sink, watcher = self._sink, self

        class Handler(self._pi.ProcessEvent):  # type: ignore[name-defined]
            def process_IN_Q_OVERFLOW(self, event: Any) -> None:  # noqa: N802 (pyinotify's name)
                watcher.on_overflow()

            def process_default(self, event: Any) -> None:
                path = getattr(event, "pathname", None)
                if path:
                    sink.path_changed(os.fsdecode(path))

        return Handler()

    def start(self) -> None:
        self._notifier.start()
        self._started = True

    def stop(self, timeout_s: float = 5.0) -> None:
        if not self._started:
            return
        self._started = False
        self._notifier.stop()  # sets the stop event, wakes the thread and joins it

    def add(self, directory: str, *, recursive: bool) -> None:
        if directory in self._wds:
            self.remove(directory)
        if not os.path.isdir(directory):
            raise WatchError(errno.ENOENT, f"{directory}: no such directory to watch")
        try:
            result = self._wm.add_watch(
                directory, self._mask, rec=recursive, auto_add=recursive, quiet=False
            )
        except self._pi.WatchManagerError as exc:
            # pyinotify formats the errno with its symbolic name, e.g. "(ENOSPC)".
            if errno.errorcode[errno.ENOSPC] in str(exc):
                raise WatchLimitError(
                    errno.ENOSPC,
                    f"{directory}: inotify watch limit reached; raise {INOTIFY_WATCHES_SYSCTL}",
                ) from exc
            raise WatchError(errno.EIO, f"{directory}: cannot watch: {exc}") from exc
        self._wds[directory] = [wd for wd in result.values() if wd >= 0]
        self._dirs[directory] = recursive

    def remove(self, directory: str) -> None:
        wds = self._wds.pop(directory, [])
        self._dirs.pop(directory, None)
        if wds:
            self._wm.rm_watch(wds, quiet=True)

    def healthy(self) -> bool:
        return not self._started or self._notifier.is_alive()
