"""Whether another process has a file open for writing (or mapped writable) right now.

A shard being rewritten in place by a writer that keeps its descriptor open (a pause mid-write,
a preallocated file filled slowly, a ``MAP_SHARED`` mapping) must not be planned: the agent
would read a mix of two versions. Two probes, the first that can answer wins:

- **A read lease** (``fcntl(F_SETLEASE, F_RDLCK)``): the kernel grants it only when no one has
  the file open for writing, and a writable shared mapping keeps its file open, so this sees
  mmap writers too. It is taken and dropped at once; a writer that opens the file in that moment
  breaks it, which signals this process (``SIGIO``, whose default action would terminate it:
  :func:`ggufswap.shards.leases.guard_sigio` handles it first). It needs the file's owner or
  ``CAP_LEASE``, a file system that supports leases, and a process that could handle the signal.
- **A scan of /proc/*/fd and /proc/*/maps**, where the lease cannot be taken: every descriptor
  of every process this user may inspect (all of them for root) whose flags are ``O_WRONLY`` or
  ``O_RDWR`` on this file, and every shared writable mapping of it.
"""

from __future__ import annotations

import errno
import os
from typing import Final

from ggufswap.shards import leases

PROC: Final = "/proc"


def writer_of(path: str) -> str | None:
    """Who has ``path`` open for writing, in words (None when no one does, or it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return None  # vanished or unreadable: the header read reports it
    try:
        if leases.guard_sigio() is None:  # a break in the moment the lease is held is harmless
            refused = leases.try_read_lease(fd)
            if refused == 0:
                leases.release(fd)
                return None
            if refused == errno.EAGAIN:
                return "open for writing by another process (a read lease is refused)"
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return _proc_writer(st.st_dev, st.st_ino)


def _proc_writer(dev: int, ino: int) -> str | None:
    """The /proc scan: a process with a writable descriptor or shared writable mapping of the
    file (``dev``, ``ino``)."""
    me = os.getpid()
    try:
        pids = [int(p) for p in os.listdir(PROC) if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        if pid == me:
            continue
        fd_dir = f"{PROC}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or not ours to inspect
        for fd in fds:
            try:
                st = os.stat(f"{fd_dir}/{fd}")
                if (st.st_dev, st.st_ino) != (dev, ino):
                    continue
                with open(f"{PROC}/{pid}/fdinfo/{fd}") as info:
                    flags = next(
                        (int(line.split()[1], 8) for line in info if line.startswith("flags:")), 0
                    )
            except (OSError, ValueError):
                continue
            if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
                return f"open for writing by pid {pid} (descriptor {fd})"
        if _maps_writable(pid, dev, ino):
            return f"mapped writable and shared by pid {pid}"
    return None


def _maps_writable(pid: int, dev: int, ino: int) -> bool:
    try:
        with open(f"{PROC}/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or fields[1][1] != "w" or fields[1][3] != "s":
                    continue
                if int(fields[4]) != ino:
                    continue
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                if os.makedev(major, minor) == dev:
                    return True
    except (OSError, ValueError):
        return False
    return False
