"""The GGUF v3 encoder under ``shards.writer``: metadata values, the KV section, whole files.

No timestamps or other varying bytes: the same inputs always give byte-identical files, written
atomically (``shards.atomic``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

import numpy as np
from gguf import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_VERSION,
    GGMLQuantizationType,
)

from ggufswap.shards import ggml_types
from ggufswap.shards.atomic import atomic_write
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.value_types import GGUFValueType, TypedValue

_SCALAR_FORMATS: Final = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


def _encode_string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _encode_value(v: TypedValue) -> bytes:
    if v.vtype in _SCALAR_FORMATS:
        return struct.pack(_SCALAR_FORMATS[v.vtype], v.value)
    if v.vtype == GGUFValueType.STRING:
        return _encode_string(v.value)
    if v.vtype == GGUFValueType.ARRAY and v.sub_type is not None:
        head = struct.pack("<IQ", v.sub_type, len(v.value))
        if v.sub_type == GGUFValueType.STRING:
            return head + b"".join(_encode_string(s) for s in v.value)
        fmt = _SCALAR_FORMATS[v.sub_type]
        return head + np.asarray(v.value, dtype=np.dtype(fmt)).tobytes()
    raise ValueError(f"cannot encode metadata value of type {v.vtype.name} (sub {v.sub_type})")


def encode_metadata(kv: Iterable[tuple[str, TypedValue]]) -> bytes:
    """The key/value section of a GGUF file, as bytes."""
    return b"".join(
        _encode_string(k) + struct.pack("<I", v.vtype) + _encode_value(v) for k, v in kv
    )


@dataclass(frozen=True, slots=True)
class Hole:
    """Tensor data left unwritten: a hole in a sparse file, read back as zeros (benchmarks of
    models bigger than the disk)."""

    nbytes: int


@dataclass(frozen=True, slots=True, eq=False)
class RawTensor:
    """A tensor ready to write: name, type, ``ne`` (ggml order) and its encoded bytes."""

    name: str
    ggml_type: GGMLQuantizationType | GGMLType
    ne: tuple[int, ...]
    data: bytes | memoryview | np.ndarray | Hole


def _nbytes(data: bytes | memoryview | np.ndarray | Hole) -> int:
    return data.nbytes if isinstance(data, Hole) else _byte_view(data).nbytes


def _byte_view(data: bytes | memoryview | np.ndarray) -> memoryview:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    return memoryview(data).cast("B")


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def write_gguf(
    path: str | Path,
    *,
    n_kv: int,
    kv_bytes: bytes,
    tensors: Sequence[RawTensor],
    alignment: int = GGUF_DEFAULT_ALIGNMENT,
) -> Path:
    """Atomically write a GGUF v3 file from an encoded KV section and raw tensors (in order)."""
    infos, offset = [], 0
    for t in tensors:
        nbytes = _nbytes(t.data)
        block_size = ggml_types.LAYOUTS[GGMLType(t.ggml_type)].block_size
        expected = ggml_types.tensor_nbytes(t.ggml_type, t.ne)
        if t.ne[0] % block_size or nbytes != expected:
            raise ValueError(
                f"{t.name}: {t.ggml_type.name} ne={list(t.ne)} needs {expected} bytes with ne[0] "
                f"a multiple of {block_size}, found {nbytes} bytes"
            )
        info = _encode_string(t.name) + struct.pack(f"<I{len(t.ne)}Q", len(t.ne), *t.ne)
        infos.append(info + struct.pack("<IQ", t.ggml_type, offset))
        offset = _pad(offset + nbytes, alignment)
    head = b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(tensors), n_kv) + kv_bytes
    head += b"".join(infos)

    def write(f: BinaryIO) -> None:
        f.write(head + bytes(_pad(len(head), alignment) - len(head)))
        for t in tensors:
            if isinstance(t.data, Hole):
                f.seek(_pad(t.data.nbytes, alignment), os.SEEK_CUR)
                f.truncate()  # the file ends after the hole even when it is the last tensor
                continue
            data = _byte_view(t.data)
            f.write(data)
            f.write(bytes(_pad(data.nbytes, alignment) - data.nbytes))

    return atomic_write(path, write)
