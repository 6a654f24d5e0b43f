"""The page-level side of mapped shards: the SIGBUS guard, moving a mapping's pages into
anonymous memory, and the descriptor limit (one descriptor holds each mapped file's lease).

The guard is the compiled ``ggufswap.runtime._sigbus`` (``runtime/csrc/sigbus.c``): a handler
that turns an access past the end of a guarded file (truncated under its mapping) into a read of
zero pages and counts it, instead of the ``SIGBUS`` that would kill the process. Without it (no
C compiler at install) nothing is mapped: :data:`NO_GUARD` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import mmap
import resource
from types import ModuleType
from typing import Final

from ggufswap.logs import get_logger
from ggufswap.runtime._libc import (
    MADV_POPULATE_WRITE,
    MAP_FAILED,
    MREMAP_FIXED,
    MREMAP_MAYMOVE,
    Libc,
)

log = get_logger(__name__)

_COPY_CHUNK: Final = 64 << 20  # bytes per copy call while moving a mapping to anonymous memory
NO_GUARD: Final = (
    "the SIGBUS guard (ggufswap.runtime._sigbus, built from runtime/csrc/sigbus.c) is not "
    "built, so a file truncated under its mapping would kill the process; install with a C "
    "compiler to map shards"
)
_SIGBUS: list[ModuleType | None] = []


def sigbus_guard() -> ModuleType | None:
    """The compiled SIGBUS guard, or None where it is not built."""
    if not _SIGBUS:
        try:  # by name: ggufswap.runtime's lazy __getattr__ would hide a missing module
            _SIGBUS.append(importlib.import_module("ggufswap.runtime._sigbus"))
        except ImportError:
            _SIGBUS.append(None)
    return _SIGBUS[0]


def guard_range(address: int, length: int, fd: int) -> int:
    """Guard ``[address, address + length)``, a mapping of the file open as ``fd`` (installing
    the handler first in line); its entry for the calls below."""
    guard = sigbus_guard()
    assert guard is not None, "nothing is mapped without the guard"
    guard.install()
    return int(guard.register(address, length, fd))


def unguard(entry: int) -> None:
    """Stop guarding ``entry`` (-1: none)."""
    guard = sigbus_guard()
    if guard is not None and entry >= 0:
        guard.unregister(entry)


def guard_faults(entry: int) -> int:
    """The accesses past the file's end the guard turned into zeros in ``entry``'s range."""
    guard = sigbus_guard()
    return int(guard.faults(entry)) if guard is not None and entry >= 0 else 0


def guard_suspects() -> bool:
    """Whether a guarded file is shorter than its mapping now, or a range absorbed a fault (one
    ``fstat`` per guarded file, in C)."""
    guard = sigbus_guard()
    return bool(guard is not None and guard.suspects())


def reinstall_guard() -> None:
    """Put the guard's handler first in line again (a host may have installed one since)."""
    guard = sigbus_guard()
    if guard is not None:
        guard.install()


def raise_descriptor_limit() -> None:
    """One descriptor per mapped file: let this process open as many as its hard limit allows
    (a model split per tensor has thousands of files; the usual soft limit is 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("load.descriptor_limit", soft=soft, raised_to=target)


def move_to_anonymous(address: int, length: int) -> None:
    """Replace the mapping at ``[address, address + length)`` by anonymous memory holding the
    same bytes, at the same address (copy, then ``mremap`` over it in one step: a thread reading
    meanwhile sees the same bytes before and after). ctypes releases the GIL for each call."""
    libc = Libc.get()
    size = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    anon = libc.mmap(None, size, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if anon in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"mmap of {size} anonymous bytes failed")
    try:
        for offset in range(0, length, _COPY_CHUNK):
            n = min(_COPY_CHUNK, length - offset)
            # Fault the new pages in with one call first (5-10x faster than a fault per page
            # inside the copy on this project's VMs); no support: the copy faults them.
            libc.madvise(anon + offset, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE, MADV_POPULATE_WRITE)
            ctypes.memmove(anon + offset, address + offset, n)
        moved = libc.mremap(anon, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, address)
        if moved != address:
            raise OSError(ctypes.get_errno(), "mremap onto the mapping failed")
    except BaseException:
        libc.munmap(anon, size)
        raise
