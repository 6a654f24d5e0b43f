"""GGUF metadata arrays decoded from their stored bytes (``reader.read_array_bytes``), cheaply.

A vocabulary holds 150k-260k strings; decoding them all costs about a second in Python, and a
runtime whose tokenizer comes from its cache needs only the few a request looks up.
:class:`StringArray` decodes a string when it is asked for (the offsets of all of them are found
by one walk on first use); :func:`scalars` turns a numeric array into a list at C speed.
"""

from __future__ import annotations

import array
import importlib
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Final, overload

from ggufswap.shards._cursor import U64
from ggufswap.shards.value_types import GGUFValueType

# Numeric element types -> the ``array`` typecode of the same size and kind.
_TYPECODES: Final[dict[GGUFValueType, str]] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


def scalars(elem_type: int, data: bytes) -> list[int] | list[float]:
    """The values of a numeric array's stored bytes (little-endian), as Python numbers.

    ``BOOL`` arrays come back as 0/1; strings are :class:`StringArray`'s.
    """
    vtype = GGUFValueType(elem_type)
    if vtype == GGUFValueType.BOOL:
        return list(data)
    values = array.array(_TYPECODES[vtype])
    if len(data) % values.itemsize:
        raise ValueError(f"{len(data)} bytes are not a whole number of {vtype.name} values")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _compiled_strings() -> Any:
    """The compiled string-array decoder (``ggufswap.shards._strings``), or None where the
    optional extension was not built."""
    try:
        return importlib.import_module("ggufswap.shards._strings")
    except ImportError:
        return None


class StringArray(Sequence[str]):
    """The strings of a GGUF string array (each a u64 length, then UTF-8), decoded on demand.

    Invalid UTF-8 decodes with U+FFFD, as ``read_array`` does. The bytes must be the array's
    as stored (bounds were checked when the header was read); a length past the end raises
    ``ValueError`` at the first look-up.
    """

    def __init__(self, data: bytes, count: int) -> None:
        self._data = data
        self._count = count
        self._starts: array.array[int] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"string {index} of an array of {self._count}")
        starts = self._starts if self._starts is not None else self._walk()
        begin, end = starts[index], starts[index + 1] - 8
        return self._data[begin:end].decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        data = self._data
        pos = 0
        for _ in range(self._count):
            n = U64.unpack_from(data, pos)[0]
            yield data[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace")
            pos += 8 + n

    def tolist(self) -> list[str]:
        """Every string, decoded at once (see :meth:`with_index`)."""
        return self._decode_all(index=False)[0]

    def with_index(self) -> tuple[list[str], dict[str, int]]:
        """Every string, and each string's position (a string held twice: its later one, as
        llama.cpp's ``token_to_id``): a vocabulary's look-up table. The compiled decoder
        (``shards/csrc/strings.c``) does both in one pass (~0.1 s for Gemma 3's 262k tokens at
        load 4); without it, :meth:`tolist`'s Python passes and a dictionary (~0.5 s)."""
        strings, table = self._decode_all(index=True)
        assert table is not None, "asked for"
        return strings, table

    def _decode_all(self, *, index: bool) -> tuple[list[str], dict[str, int] | None]:
        compiled = _compiled_strings()
        if compiled is not None:
            decoded: tuple[list[str], dict[str, int] | None] = compiled.decode(
                self._data, self._count, index
            )
            return decoded
        strings = self._joined_decode()
        return strings, dict(zip(strings, range(len(strings)), strict=True)) if index else None

    def _joined_decode(self) -> list[str]:
        """The bytes of all strings joined by NUL, decoded and split in one pass each (C speed);
        where a string holds a NUL or invalid UTF-8, each is decoded on its own (U+FFFD for
        invalid bytes, as a look-up gives)."""
        starts, data = self._walk(), self._data
        ends = starts[1:]
        joined = b"\0".join([data[a : b - 8] for a, b in zip(starts, ends, strict=False)])
        try:
            strings = joined.decode("utf-8").split("\0") if self._count else []
        except UnicodeDecodeError:
            strings = []
        if len(strings) != self._count:  # a NUL inside a string, or invalid UTF-8
            strings = list(self)
        return strings

    def _walk(self) -> array.array[int]:
        """Where each string's bytes begin (and one past the last string's, plus 8)."""
        with self._lock:
            if self._starts is None:
                unpack, data = U64.unpack_from, self._data
                starts = array.array("Q", bytes(8 * (self._count + 1)))
                pos = 0
                try:
                    for i in range(self._count):
                        pos += 8
                        starts[i] = pos
                        pos += unpack(data, pos - 8)[0]
                except struct.error:
                    pos = len(data) + 8  # a length field itself past the end
                if pos > len(data):
                    raise ValueError(f"the strings run {pos - len(data)} bytes past their array")
                starts[self._count] = pos + 8
                self._starts = starts
            return self._starts
