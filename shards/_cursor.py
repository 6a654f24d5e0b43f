"""Bounded sequential reads over a file descriptor, for the header reader.

``pread`` in chunks, never past the size ``fstat`` gave; every read says what it was reading, so
a short or truncated file raises a :class:`~ggufswap.shards.errors.ShardError` that names the
field and the byte position.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Final

from ggufswap.shards.errors import CorruptHeaderError, TruncatedError

_CHUNK: Final = 1 << 20
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")


class Cursor:
    """Sequential reads over a file descriptor with a chunked buffer and bounds checks."""

    __slots__ = ("buf", "buf_start", "fd", "path", "pos", "size")

    def __init__(self, fd: int, path: str, size: int) -> None:
        self.fd = fd
        self.path = path
        self.size = size
        self.pos = 0
        self.buf = b""
        self.buf_start = 0

    def remaining(self) -> int:
        return self.size - self.pos

    def _fill(self, n: int, what: str) -> int:
        """Make ``n`` bytes at ``pos`` available in ``buf``; return their index into ``buf``."""
        start = self.pos - self.buf_start
        if start >= 0 and start + n <= len(self.buf):
            return start
        if self.pos + n > self.size:
            raise TruncatedError(
                self.path,
                f"{what}: needs {n} bytes but the file ends after {self.size - self.pos}",
                pos=self.pos,
            )
        want = min(max(n, _CHUNK), self.size - self.pos)
        data = os.pread(self.fd, want, self.pos)
        if len(data) < n:  # the file shrank since fstat: it is being rewritten
            raise TruncatedError(
                self.path, f"{what}: short read ({len(data)} of {n} bytes)", pos=self.pos
            )
        self.buf = data
        self.buf_start = self.pos
        return 0

    def unpack(self, fmt: struct.Struct, what: str) -> Any:
        i = self._fill(fmt.size, what)
        self.pos += fmt.size
        return fmt.unpack_from(self.buf, i)[0]

    def u32(self, what: str) -> int:
        value: int = self.unpack(U32, what)
        return value

    def u64(self, what: str) -> int:
        value: int = self.unpack(U64, what)
        return value

    def raw(self, n: int, what: str) -> bytes:
        i = self._fill(n, what)
        self.pos += n
        return self.buf[i : i + n]

    def string(self, what: str, *, max_len: int | None = None) -> bytes:
        at = self.pos
        n = self.u64(f"{what} length")
        if max_len is not None and n > max_len:
            raise CorruptHeaderError(
                self.path, f"{what}: length {n} exceeds the limit of {max_len} bytes", pos=at
            )
        if n > self.remaining():
            raise TruncatedError(
                self.path,
                f"{what}: declares {n} bytes but only {self.remaining()} remain in the file",
                pos=at,
            )
        return self.raw(n, what)

    def skip(self, n: int, what: str) -> None:
        if n > self.remaining():
            raise TruncatedError(
                self.path,
                f"{what}: declares {n} bytes but only {self.remaining()} remain in the file",
                pos=self.pos,
            )
        self.pos += n

    def skip_strings(self, count: int, what: str) -> None:
        """Walk ``count`` length-prefixed strings without decoding them (the vocabulary case)."""
        # The hot loop of a header parse: locals only, one add per string, and the bounds check
        # only where the buffer runs out (a length past the end lands there too).
        unpack_len = U64.unpack_from
        i = self._fill(0, what)  # before taking self.buf: _fill may replace the buffer
        buf, base = self.buf, self.buf_start
        limit = len(buf) - 8
        for index in range(count):
            if i > limit:
                self._seek_checked(base + i, f"{what}[{index}]")
                i = self._fill(8, f"{what}[{index}] length")
                buf, base = self.buf, self.buf_start
                limit = len(buf) - 8
            i += 8 + unpack_len(buf, i)[0]
        self._seek_checked(base + i, f"{what}[{count - 1}]")

    def _seek_checked(self, pos: int, what: str) -> None:
        if pos > self.size:
            raise TruncatedError(
                self.path, f"{what}: string runs {pos - self.size} bytes past the end of the file"
            )
        self.pos = pos
