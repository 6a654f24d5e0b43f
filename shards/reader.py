"""A strict, fast GGUF header reader built on ``pread``.

The reader never memory-maps a shard: a file replaced or truncated under a mapping raises SIGBUS
in whoever touches the pages. It reads the header in chunks with ``os.pread`` and checks every
count, length and offset against the file size *before* using it, so a hostile or half-written
file can only ever raise a :class:`~ggufswap.shards.errors.ShardError` and never makes the
reader allocate more than the file could hold.

Large metadata arrays (tokenizer vocabularies of 150k-260k strings) are walked, not decoded:
the header keeps an :class:`ArrayRef` (where the array lies) and :func:`read_array` decodes it
on demand.

Layout of a GGUF file (v2/v3, little-endian)::

    magic u32 | version u32 | n_tensors u64 | n_kv u64
    n_kv x  (key: string, value_type u32, value)
    n_tensors x (name: string, n_dims u32, ne: u64[n_dims], ggml_type u32, rel_offset u64)
    padding to general.alignment
    tensor data (each tensor at data_offset + rel_offset, aligned)

where ``string`` is ``len u64`` followed by UTF-8 bytes.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, TypeAlias

from ggufswap.shards import ggml_types
from ggufswap.shards._cursor import U32, U64, Cursor
from ggufswap.shards.errors import (
    CorruptHeaderError,
    FileChangedError,
    NotGGUFError,
    ShardError,
    TensorLayoutError,
    TruncatedError,
    UnsupportedVersionError,
)
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.keys import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_SUPPORTED_VERSIONS,
    Keys,
)
from ggufswap.shards.records import ArrayRef, FileIdentity, TensorRecord
from ggufswap.shards.value_types import GGUFValueType

MetaValue: TypeAlias = int | float | bool | str | tuple[Any, ...] | ArrayRef

# Bounds that no sane file exceeds; each one is also what ggml itself accepts.
MAX_DIMS: Final = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES: Final = 63  # GGML_MAX_NAME is 64 including the terminating NUL
MAX_KEY_BYTES: Final = 65535
MAX_ALIGNMENT: Final = 1 << 20
MAX_ELEMENTS: Final = (1 << 63) - 1
# Arrays up to this many elements are decoded into the header; longer ones stay on disk.
INLINE_ARRAY_MAX: Final = 64

_PREAMBLE = struct.Struct("<IIQQ")

# Fixed-size metadata value types: struct format per type.
_SCALAR_FORMATS: Final[dict[GGUFValueType, struct.Struct]] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_VALUE_TYPES: Final = {t.value: t for t in GGUFValueType}
# Smallest possible encodings, used to bound declared counts by the bytes that remain.
_MIN_KV_BYTES: Final = 8 + 1 + 4 + 1  # key length, one key byte, value type, a u8 value
_MIN_TENSOR_INFO_BYTES: Final = 8 + 1 + 4 + 8 + 4 + 8  # name, 1 byte, n_dims, one dim, type, offset


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """Everything a GGUF header says about one file, with the file version it came from."""

    path: str
    identity: FileIdentity
    version: int
    alignment: int
    data_offset: int
    tensors: tuple[TensorRecord, ...]
    metadata: Mapping[str, MetaValue] = field(compare=False, hash=False, repr=False)

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get(Keys.General.ARCHITECTURE)
        return value if isinstance(value, str) else None

    @property
    def split_no(self) -> int:
        """0-based position of this file in its gguf-split set (0 for an unsplit file)."""
        value = self.metadata.get(Keys.Split.NO, 0)
        return value if isinstance(value, int) else 0

    @property
    def split_count(self) -> int:
        """Number of files in the set (1 for an unsplit file)."""
        value = self.metadata.get(Keys.Split.COUNT, 1)
        return value if isinstance(value, int) else 1

    def tensor_map(self) -> dict[str, TensorRecord]:
        return {t.name: t for t in self.tensors}


def _value_type(cur: Cursor, code: int, what: str, at: int) -> GGUFValueType:
    vtype = _VALUE_TYPES.get(code)
    if vtype is None:
        raise CorruptHeaderError(
            cur.path,
            f"{what}: unknown value type {code} (expected 0-{max(_VALUE_TYPES)})",
            pos=at,
        )
    return vtype


def _decode(raw: bytes, cur: Cursor, what: str, at: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptHeaderError(cur.path, f"{what}: not valid UTF-8 ({exc})", pos=at) from None


def _read_array(cur: Cursor, key: str) -> MetaValue:
    at = cur.pos
    elem_type = _value_type(cur, cur.u32(f"{key}: array type"), f"{key}: array element", at)
    count_at = cur.pos
    count = cur.u64(f"{key}: array count")
    start = cur.pos
    if elem_type == GGUFValueType.ARRAY:
        raise CorruptHeaderError(cur.path, f"{key}: nested arrays are not supported", pos=at)
    if elem_type == GGUFValueType.STRING:
        if count > cur.remaining() // 8:
            raise TruncatedError(
                cur.path,
                f"{key}: declares {count} strings but only {cur.remaining()} bytes remain",
                pos=count_at,
            )
        if count <= INLINE_ARRAY_MAX:
            return tuple(
                _decode(cur.string(f"{key}[{i}]"), cur, f"{key}[{i}]", cur.pos)
                for i in range(count)
            )
        cur.skip_strings(count, key)
        return ArrayRef(elem_type.value, count, start, cur.pos - start)
    fmt = _SCALAR_FORMATS[elem_type]
    if count > cur.remaining() // fmt.size:
        raise TruncatedError(
            cur.path,
            f"{key}: declares {count} elements of {fmt.size} bytes but only "
            f"{cur.remaining()} bytes remain",
            pos=count_at,
        )
    nbytes = count * fmt.size
    if count <= INLINE_ARRAY_MAX:
        raw = cur.raw(nbytes, key)
        return tuple(v[0] for v in fmt.iter_unpack(raw))
    cur.skip(nbytes, key)
    return ArrayRef(elem_type.value, count, start, nbytes)


def _read_kv(cur: Cursor, n_kv: int) -> tuple[dict[str, MetaValue], dict[str, GGUFValueType]]:
    metadata: dict[str, MetaValue] = {}
    types: dict[str, GGUFValueType] = {}
    for index in range(n_kv):
        at = cur.pos
        raw_key = cur.string(f"metadata key #{index}", max_len=MAX_KEY_BYTES)
        if not raw_key:
            raise CorruptHeaderError(cur.path, f"metadata key #{index} is empty", pos=at)
        key = _decode(raw_key, cur, f"metadata key #{index}", at)
        if key in metadata:
            raise CorruptHeaderError(cur.path, f"duplicate metadata key {key!r}", pos=at)
        type_at = cur.pos
        vtype = _value_type(cur, cur.u32(f"{key}: value type"), key, type_at)
        value: MetaValue
        if vtype == GGUFValueType.STRING:
            value = _decode(cur.string(key), cur, key, type_at)
        elif vtype == GGUFValueType.ARRAY:
            value = _read_array(cur, key)
        else:
            value = cur.unpack(_SCALAR_FORMATS[vtype], key)
        metadata[key] = value
        types[key] = vtype
    return metadata, types


def _alignment(
    path: str, metadata: Mapping[str, MetaValue], types: Mapping[str, GGUFValueType]
) -> int:
    if Keys.General.ALIGNMENT not in metadata:
        return GGUF_DEFAULT_ALIGNMENT
    value = metadata[Keys.General.ALIGNMENT]
    if types[Keys.General.ALIGNMENT] != GGUFValueType.UINT32 or not isinstance(value, int):
        raise CorruptHeaderError(
            path,
            f"{Keys.General.ALIGNMENT}: expected a UINT32, "
            f"found {types[Keys.General.ALIGNMENT].name}",
        )
    if value <= 0 or value & (value - 1) or value > MAX_ALIGNMENT:
        raise CorruptHeaderError(
            path,
            f"{Keys.General.ALIGNMENT}: expected a power of two between 1 and {MAX_ALIGNMENT}, "
            f"found {value}",
        )
    return value


def _read_tensor_info(cur: Cursor, index: int) -> tuple[str, tuple[int, ...], GGMLType, int, int]:
    at = cur.pos
    name = _decode(
        cur.string(f"tensor #{index} name", max_len=MAX_NAME_BYTES), cur, f"tensor #{index}", at
    )
    if not name:
        raise TensorLayoutError(cur.path, f"tensor #{index} has an empty name", pos=at)
    dims_at = cur.pos
    n_dims = cur.u32(f"{name}: n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise TensorLayoutError(
            cur.path, f"{name}: n_dims must be 1..{MAX_DIMS}, found {n_dims}", pos=dims_at
        )
    ne = tuple(cur.u64(f"{name}: ne[{d}]") for d in range(n_dims))
    if any(dim == 0 for dim in ne):
        raise TensorLayoutError(
            cur.path, f"{name}: every dimension must be > 0, found ne={list(ne)}", pos=dims_at
        )
    if math.prod(ne) > MAX_ELEMENTS:
        raise TensorLayoutError(
            cur.path, f"{name}: element count of ne={list(ne)} overflows int64", pos=dims_at
        )
    type_at = cur.pos
    code = cur.u32(f"{name}: type")
    ggml_type = ggml_types.ggml_type(code)
    if ggml_type is None:
        raise TensorLayoutError(cur.path, f"{name}: unknown ggml type {code}", pos=type_at)
    block_size = ggml_types.LAYOUTS[ggml_type].block_size
    if ne[0] % block_size:
        raise TensorLayoutError(
            cur.path,
            f"{name}: row length ne[0]={ne[0]} is not a multiple of the "
            f"{ggml_type.name} block size {block_size}",
            pos=dims_at,
        )
    rel_offset = cur.u64(f"{name}: offset")
    nbytes = ggml_types.tensor_nbytes(ggml_type, ne)
    return name, ne, ggml_type, rel_offset, nbytes


def _check_layout(path: str, tensors: list[TensorRecord], size: int) -> None:
    """Every tensor lies inside the file and no two overlap."""
    problems: list[str] = []
    for t in tensors:
        if t.end > size:
            problems.append(
                f"{t.name}: data ends at byte {t.end} but the file has {size} bytes "
                "(truncated, or still being written)"
            )
    if problems:
        raise TruncatedError(path, "; ".join(problems))
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, after in itertools.pairwise(ordered):
        if after.offset < before.end:
            raise TensorLayoutError(
                path,
                f"{after.name} (bytes {after.offset}-{after.end}) overlaps "
                f"{before.name} (bytes {before.offset}-{before.end})",
                pos=after.offset,
            )


def _preamble(cur: Cursor, path: str, identity: FileIdentity) -> tuple[int, int, int]:
    """The magic, version and counts at the start of the header, checked: ``(version,
    n_tensors, n_kv)``."""
    if identity.size < _PREAMBLE.size:
        if identity.size >= 4 and cur.u32("magic") != GGUF_MAGIC:
            raise NotGGUFError(path, "missing GGUF magic", pos=0)
        raise TruncatedError(
            path, f"file has {identity.size} bytes, a GGUF header needs at least {_PREAMBLE.size}"
        )
    magic = cur.u32("magic")
    if magic != GGUF_MAGIC:
        raise NotGGUFError(path, f"expected magic b'GGUF', found {U32.pack(magic)!r}", pos=0)
    version = cur.u32("version")
    if version not in GGUF_SUPPORTED_VERSIONS:
        swapped = int.from_bytes(U32.pack(version), "big")
        hint = (
            " (this is a big-endian file; only little-endian GGUF is supported)"
            if swapped in GGUF_SUPPORTED_VERSIONS
            else ""
        )
        raise UnsupportedVersionError(
            path, f"expected GGUF version 2 or 3, found {version}{hint}", pos=4
        )
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    if n_kv > cur.remaining() // _MIN_KV_BYTES:
        raise CorruptHeaderError(
            path,
            f"metadata count {n_kv} cannot fit in the {cur.remaining()} bytes that remain",
            pos=16,
        )
    if n_tensors > cur.remaining() // _MIN_TENSOR_INFO_BYTES:
        raise CorruptHeaderError(
            path,
            f"tensor count {n_tensors} cannot fit in the {cur.remaining()} bytes that remain",
            pos=8,
        )
    return version, n_tensors, n_kv


def _records(
    path: str,
    identity: FileIdentity,
    infos: list[tuple[str, tuple[int, ...], GGMLType, int, int]],
    *,
    data_offset: int,
    alignment: int,
) -> list[TensorRecord]:
    """The tensor records of the tensor infos: names unique, offsets aligned and absolute."""
    tensors: list[TensorRecord] = []
    seen: set[str] = set()
    for name, ne, ggml_type, rel_offset, nbytes in infos:
        if name in seen:
            raise TensorLayoutError(path, f"duplicate tensor name {name!r}")
        seen.add(name)
        if rel_offset % alignment:
            raise TensorLayoutError(
                path, f"{name}: data offset {rel_offset} is not a multiple of {alignment}"
            )
        tensors.append(
            TensorRecord(
                name=name,
                ggml_type=ggml_type,
                ne=ne,
                offset=data_offset + rel_offset,
                nbytes=nbytes,
                path=path,
                identity=identity,
            )
        )
    return tensors


def _parse(fd: int, path: str, identity: FileIdentity) -> ShardHeader:
    cur = Cursor(fd, path, identity.size)
    version, n_tensors, n_kv = _preamble(cur, path, identity)
    metadata, types = _read_kv(cur, n_kv)
    alignment = _alignment(path, metadata, types)
    if n_tensors > cur.remaining() // _MIN_TENSOR_INFO_BYTES:
        raise CorruptHeaderError(
            path,
            f"tensor count {n_tensors} cannot fit in the {cur.remaining()} bytes that remain",
            pos=cur.pos,
        )
    infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _records(path, identity, infos, data_offset=data_offset, alignment=alignment)
    _check_layout(path, tensors, identity.size)
    return ShardHeader(
        path=path,
        identity=identity,
        version=version,
        alignment=alignment,
        data_offset=data_offset,
        tensors=tuple(tensors),
        metadata=MappingProxyType(metadata),
    )


def read_header(path: str | os.PathLike[str]) -> ShardHeader:
    """Parse and validate the header of one GGUF file.

    Raises a :class:`ShardError` subclass for anything wrong with the file, and
    :class:`FileChangedError` if the file changed while the header was read.
    """
    real = os.path.realpath(path)
    try:
        # O_NONBLOCK: a FIFO named like a shard must not block the caller (the agent's loop)
        # in open(); it is refused below as not a regular file. Regular files ignore the flag.
        fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ShardError(real, "no such file") from None
    except OSError as exc:
        raise ShardError(real, f"cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShardError(real, "not a regular file")
        identity = FileIdentity.of_stat(st)
        header = _parse(fd, real, identity)
        after = FileIdentity.of_fd(fd)
        if after != identity:
            raise FileChangedError(real, "the file changed while its header was being read")
        return header
    finally:
        os.close(fd)


def read_array_bytes(header: ShardHeader, key: str) -> bytes:
    """The bytes of a metadata array that the header left on disk, as stored: its elements
    little-endian, each string with its u64 length (what a vocabulary digest hashes without
    decoding a string). One ``pread``, after checking the file is still the one the header came
    from; :class:`FileChangedError` or :class:`TruncatedError` otherwise."""
    value = header.metadata[key]
    if not isinstance(value, ArrayRef):
        raise TypeError(f"{header.path}: metadata {key!r} is not an array left on disk")
    try:
        fd = os.open(header.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:  # removed or made unreadable since the header was read
        raise FileChangedError(header.path, f"cannot open to read {key}: {exc.strerror}") from None
    try:
        if FileIdentity.of_fd(fd) != header.identity:
            raise FileChangedError(header.path, f"changed since its header was read ({key})")
        data = os.pread(fd, value.nbytes, value.offset)
    finally:
        os.close(fd)
    if len(data) != value.nbytes:
        raise TruncatedError(header.path, f"{key}: short read", pos=value.offset)
    return data


def read_array(header: ShardHeader, key: str) -> list[Any]:
    """Decode a metadata array that the header left on disk (or return the inline one)."""
    value = header.metadata[key]
    if isinstance(value, tuple):
        return list(value)
    if not isinstance(value, ArrayRef):
        raise TypeError(f"{header.path}: metadata {key!r} is not an array")
    data = read_array_bytes(header, key)
    elem = GGUFValueType(value.elem_type)
    if elem != GGUFValueType.STRING:
        fmt = _SCALAR_FORMATS[elem]
        return [v[0] for v in fmt.iter_unpack(data)]
    out: list[Any] = []
    pos = 0
    for _ in range(value.count):
        n = U64.unpack_from(data, pos)[0]
        out.append(data[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
        pos += 8 + n
    return out
