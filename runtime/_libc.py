"""The C library calls the runtime makes through ctypes: memory advice, mappings, heap trim.

One loaded ``CDLL`` with its prototypes, shared by :mod:`.loading` (prefaulting buffers, trimming
the heap) and :mod:`.mapping` (mapping shard files, moving them to anonymous memory). ctypes
releases the GIL for every call.
"""

from __future__ import annotations

import ctypes
from typing import Final

MADV_POPULATE_READ: Final = 22  # Linux 5.14+: fault a range in, readable, in one call
MADV_POPULATE_WRITE: Final = 23  # the same, writable
MREMAP_MAYMOVE: Final = 1
MREMAP_FIXED: Final = 2
MAP_FAILED: Final = ctypes.c_void_p(-1).value


class Libc:
    """The C library, loaded once (:meth:`get`); ``lib`` may be replaced by tests."""

    lib: ctypes.CDLL | None = None

    @classmethod
    def get(cls) -> ctypes.CDLL:
        """The C library with the prototypes below."""
        if cls.lib is None:
            # The C library this process already has (dlopen(NULL) searches its global scope):
            # find_library("c") would run `ldconfig -p` in a subprocess.
            lib = ctypes.CDLL(None, use_errno=True)
            size, addr, num = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
            _prototype(lib, "mmap", addr, addr, size, num, num, num, ctypes.c_long)
            _prototype(lib, "munmap", num, addr, size)
            # variadic in C; its integer and pointer arguments pass as in a fixed prototype on
            # x86-64 and aarch64 Linux
            _prototype(lib, "mremap", addr, addr, size, size, num, addr)
            _prototype(lib, "madvise", num, addr, size, num)
            _prototype(lib, "malloc_trim", num, size)
            cls.lib = lib
        return cls.lib


def _prototype(lib: ctypes.CDLL, name: str, restype: object, *argtypes: object) -> None:
    """Declare ``name``'s prototype where the library has it (glibc's ``malloc_trim`` is absent
    from other C libraries: calling it raises ``AttributeError``)."""
    try:
        function = getattr(lib, name)
    except AttributeError:
        return
    function.restype = restype
    function.argtypes = argtypes
