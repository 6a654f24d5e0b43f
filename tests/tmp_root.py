"""Where the tests' ``tmp_path`` directories live: in memory (``/dev/shm``) when it has room.

The tests write thousands of small GGUF files, and the project's writers make each one durable
(fsync the file, rename, fsync the directory: shards/atomic.py). On a disk each fsync waits for
the device (a 1,000-shard scan test waited ~8 s of its ~9); on a tmpfs it returns at once, and
the code paths run the same. The guarantees the tests check do not depend on the medium (they
also pass with ``--basetemp`` on a disk); a power cut is not something a test can simulate.

The directory is made per session by the pytest process that owns it (the xdist controller; its
workers get subdirectories of it), named with that process's pid, removed when the session ends,
and a later session removes the ones a killed session left behind. A failed test's ``tmp_path``
(its processes' logs, the files it wrote) is copied out first, to
``$TMPDIR/ggufswap-failed-UID/<test>``, and the failure report says where (:func:`keep_failed`).
``--basetemp`` given on the command line wins; ``GGUFSWAP_TEST_TMP`` names another parent
directory (``GGUFSWAP_TEST_TMP=``, empty, keeps pytest's default under the system's temporary
directory).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

ENV = "GGUFSWAP_TEST_TMP"
DEFAULT_PARENT = "/dev/shm"
PREFIX = "gst-"  # short: a Unix socket path under it must fit in 107 bytes
# The fast tier peaks at ~0.8 GB of files, make test at ~1.9 GB (sampled): a smaller tmpfs (a
# container's default /dev/shm is 64 MB) is not used.
MIN_FREE_BYTES = 6 << 30


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(parent: Path) -> None:
    """Remove the directories of sessions whose process is gone (killed before its cleanup)."""
    for entry in parent.glob(f"{PREFIX}*"):
        pid = entry.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and entry.stat().st_uid == os.getuid():
            shutil.rmtree(entry, ignore_errors=True)


def session_root() -> Path | None:
    """A fresh directory for this session's ``tmp_path``s, or None to keep pytest's default."""
    named = os.environ.get(ENV, DEFAULT_PARENT)
    parent = Path(named)
    if not named or not parent.is_dir() or not os.access(parent, os.W_OK):
        return None
    remove_stale(parent)
    stat = os.statvfs(parent)
    if stat.f_bavail * stat.f_frsize < MIN_FREE_BYTES:
        return None
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))


def in_memory(path: Path) -> bool:
    """Whether ``path`` lies in a session directory this module made."""
    return any(parent.name.startswith(PREFIX) for parent in path.parents)


def keep_failed(path: Path, nodeid: str) -> Path:
    """Copy a failed test's ``tmp_path`` where it outlives the session (what cannot be copied,
    a socket, is left out); returns the copy's path."""
    name = re.sub(r"[^\w.-]+", "_", nodeid)[-150:]
    dest = Path(tempfile.gettempdir()) / f"ggufswap-failed-{os.getuid()}" / name
    shutil.rmtree(dest, ignore_errors=True)
    try:
        shutil.copytree(path, dest, symlinks=True)
    except (shutil.Error, OSError):
        pass  # the rest is copied: copytree goes on past a file it cannot copy
    return dest
