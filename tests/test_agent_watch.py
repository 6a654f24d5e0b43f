"""Watcher backends: each one reports a rename; overflow asks for a rescan; fs detection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from processes import wait_for

from ggufswap.agent import ChangeQueue, RescanReason, backend_available, choose_backend
from ggufswap.agent.watch import make_watcher
from ggufswap.config import WatchBackend
from ggufswap.config.fstypes import fs_info, mountinfo_fstype

# pyinotify finds its C library with ctypes.util.find_library, which runs `ldconfig -p`.
BACKENDS = [
    WatchBackend.WATCHDOG,
    pytest.param(WatchBackend.PYINOTIFY, marks=pytest.mark.process),
    WatchBackend.POLLING,
]


@pytest.mark.parametrize("kind", BACKENDS, ids=lambda k: k.value)
def test_each_backend_reports_an_atomic_rename(tmp_path: Path, kind: WatchBackend) -> None:
    """A file renamed over a shard is reported by the shard's path, by every backend."""
    why = backend_available(kind)
    if why is not None:
        pytest.skip(why)
    queue = ChangeQueue()
    watcher = make_watcher(kind, queue, poll_interval_s=0.05)
    target = tmp_path / "m.gguf"
    target.write_bytes(b"old")
    watcher.start()
    try:
        watcher.add(str(tmp_path), recursive=False)
        tmp = tmp_path / ".m.gguf.tmp"
        tmp.write_bytes(b"new content")
        os.replace(tmp, target)
        seen: set[str] = set()

        def reported() -> bool:
            seen.update(queue.drain()[0])
            return str(target) in seen

        wait_for(reported, timeout=10, what=f"{kind.value} to report {target}")
    finally:
        watcher.stop()


@pytest.mark.parametrize("kind", BACKENDS, ids=lambda k: k.value)
def test_overflow_path_asks_for_a_full_rescan(tmp_path: Path, kind: WatchBackend) -> None:
    """A backend's overflow handler queues a rescan request naming the overflow."""
    why = backend_available(kind)
    if why is not None:
        pytest.skip(why)
    queue = ChangeQueue()
    watcher = make_watcher(kind, queue)
    watcher.start()  # stop() releases what the backend holds (an inotify descriptor, a pipe)
    try:
        watcher.on_overflow()
    finally:
        watcher.stop()
    paths, rescans = queue.drain()
    assert paths == []
    assert [r.reason for r in rescans] == [RescanReason.OVERFLOW]
    assert watcher.overflows == 1


def test_watching_a_missing_directory_is_an_error_naming_it(tmp_path: Path) -> None:
    """Adding a directory that does not exist raises a WatchError with its path."""
    watcher = make_watcher(WatchBackend.WATCHDOG, ChangeQueue())
    watcher.start()
    try:
        with pytest.raises(OSError, match="no such directory"):
            watcher.add(str(tmp_path / "absent"), recursive=False)
    finally:
        watcher.stop()


def test_auto_picks_inotify_on_a_local_file_system(tmp_path: Path) -> None:
    """tmp_path is local: auto chooses watchdog and says which file system it found."""
    info = fs_info(str(tmp_path))
    choice = choose_backend(WatchBackend.AUTO, str(tmp_path))
    if not info.inotify_reliable:
        pytest.skip(f"tmp_path is on {info.name}, where inotify is not trusted")
    assert choice.kind is WatchBackend.WATCHDOG
    assert info.name in choice.why
    assert choose_backend(WatchBackend.POLLING, str(tmp_path)).kind is WatchBackend.POLLING


def test_mountinfo_names_the_file_system_of_the_longest_mount_prefix(tmp_path: Path) -> None:
    """The mountinfo fallback picks the deepest mount containing the path (escapes decoded)."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        "30 22 0:40 / /srv/models rw - nfs4 host:/export rw\n"
        "31 30 0:41 / /srv/models/my\\040fuse rw - fuse.sshfs host: rw\n"
    )
    assert mountinfo_fstype("/srv/models/a/b.gguf", mountinfo=str(mountinfo)) == "nfs4"
    assert mountinfo_fstype("/srv/models/my fuse/x", mountinfo=str(mountinfo)) == "fuse.sshfs"
    assert mountinfo_fstype("/etc/hosts", mountinfo=str(mountinfo)) == "ext4"
