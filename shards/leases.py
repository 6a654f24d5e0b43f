"""Read leases on shard files, and the signal a lease break sends.

A read lease (``fcntl(F_SETLEASE, F_RDLCK)``) is granted only while no process has the file open
for writing; once held, any ``open`` for writing or truncation of the file *breaks* it: the
kernel signals the holder and blocks the opener until the holder gives the lease up, or until
``/proc/sys/fs/lease-break-time`` seconds (45 by default) have passed. The agent takes one for a
moment to ask whether anyone writes a file (:mod:`ggufswap.agent.writers`); the runtime holds one
on every shard it serves from a mapping, and copies the file's tensors out before it lets a writer
in (:mod:`ggufswap.runtime.mapping`).

The signal is ``SIGIO``, sent to the process that took the lease, and its default action
terminates the process: a writer opening a file in the moment a lease is held would kill the
holder. :func:`guard_sigio` installs a handler first, once per process, from the main thread
(Python's rule for signal handlers); a host that installed its own handler keeps it, and a
process that cannot install one gets a reason instead of a lease.

The handler does nothing, and does it in C: it is a builtin (``dict.get`` of an empty dict,
which takes the handler's two arguments and returns). Any Python code in it could be interrupted
by the next ``SIGIO`` and re-entered, and a storm of them (any process of the same user may send
a million in seconds) then ends in ``RecursionError`` in the main thread (issue 28). Lease
holders find a break by polling (:func:`breaking`) instead of being woken by the signal.
"""

from __future__ import annotations

import errno
import fcntl
import signal
import threading
from collections.abc import Callable
from typing import Final

# Errors meaning "no lease here" rather than "someone writes": not the owner and no CAP_LEASE
# (EACCES/EPERM), a file system without leases (EINVAL: NFS, FUSE, overlayfs), leases disabled
# (``fs.leases-enable = 0``: ENOLCK or EINVAL).
UNAVAILABLE: Final = frozenset({errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOLCK})

_lock = threading.Lock()
# The handler: a C builtin taking (signum, frame) and doing nothing; no Python frame runs, so a
# signal arriving meanwhile cannot re-enter it (unlike any ``def`` handler).
_NOTHING: Final[dict[int, object]] = {}
_IGNORE_IN_C: Final[Callable[[int, object], object]] = _NOTHING.get


def guard_sigio() -> str | None:
    """Make sure a lease break cannot terminate this process; None when it cannot, else why.

    A host's own ``SIGIO`` handler (or ``SIG_IGN``), from Python or from C code (which Python
    reports as ``None``), is left in place: the break does no harm then.
    """
    with _lock:
        current = signal.getsignal(signal.SIGIO)
        if current is not signal.SIG_DFL:  # ours, the host's (None: installed in C), SIG_IGN
            return None
        if threading.current_thread() is not threading.main_thread():
            return (
                "SIGIO has its default action (terminate) and a handler can only be installed "
                "from the main thread"
            )
        signal.signal(signal.SIGIO, _IGNORE_IN_C)
        return None


def try_read_lease(fd: int) -> int:
    """Take a read lease on open file ``fd``: 0 when held, else the error that refused it,
    ``EAGAIN`` (a process has the file open for writing) or one of :data:`UNAVAILABLE` (no
    lease here); any other error raises."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        if exc.errno == errno.EAGAIN or exc.errno in UNAVAILABLE:
            return exc.errno
        raise
    return 0


def take_read_lease(fd: int) -> str | None:
    """Take a read lease on open file ``fd``; None when held, else why not, in words."""
    code = try_read_lease(fd)
    if code == 0:
        return None
    if code == errno.EAGAIN:
        return "it is open for writing by a process (a read lease is refused)"
    return f"no read lease can be taken on it ({errno.errorcode.get(code, '?')})"


LEASE_BREAK_TIME: Final = "/proc/sys/fs/lease-break-time"
DEFAULT_LEASE_BREAK_S: Final = 45.0


def lease_break_time() -> float:
    """Seconds the kernel lets a writer wait for a lease holder before it breaks the lease
    itself (``fs.lease-break-time``; 45 where it cannot be read)."""
    try:
        with open(LEASE_BREAK_TIME, encoding="ascii") as f:
            return max(1.0, float(int(f.read().strip())))
    except (OSError, ValueError):
        return DEFAULT_LEASE_BREAK_S


def breaking(fd: int) -> bool:
    """Whether the read lease on ``fd`` is being broken (a writer waits) or is gone."""
    return bool(fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK)


def release(fd: int) -> None:
    """Give the lease on ``fd`` up (a waiting writer proceeds)."""
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
