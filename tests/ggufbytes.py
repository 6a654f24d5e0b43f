"""Build GGUF bytes by hand with ``struct.pack``: valid files, and files broken one field at a time.

Hostile-header tests need control over every byte, so this module does not use gguf-py or the
project's writer. :func:`build` assembles a file from encoded metadata entries and tensor infos and
records where each u64 count, length, dimension and offset lies, so that fuzz tests can aim at
exactly those fields.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

V = GGUFValueType
T = GGMLQuantizationType

SCALAR_FORMATS: dict[GGUFValueType, str] = {
    V.UINT8: "B",
    V.INT8: "b",
    V.UINT16: "H",
    V.INT16: "h",
    V.UINT32: "I",
    V.INT32: "i",
    V.FLOAT32: "f",
    V.BOOL: "?",
    V.UINT64: "Q",
    V.INT64: "q",
    V.FLOAT64: "d",
}


class _Out:
    """A byte buffer that remembers the positions of u64 fields."""

    def __init__(self, endian: str) -> None:
        self.buf = bytearray()
        self.e = endian
        self.u64_fields: list[int] = []

    def u32(self, v: int) -> None:
        self.buf += struct.pack(self.e + "I", v)

    def u64(self, v: int) -> None:
        self.u64_fields.append(len(self.buf))
        self.buf += struct.pack(self.e + "Q", v)

    def string(self, s: str | bytes, *, length: int | None = None) -> None:
        raw = s.encode() if isinstance(s, str) else s
        self.u64(len(raw) if length is None else length)
        self.buf += raw

    def raw(self, b: bytes) -> None:
        self.buf += b


@dataclass(frozen=True)
class KV:
    """One metadata entry; ``value`` is encoded by ``vtype`` (and ``sub`` for arrays)."""

    key: str | bytes
    vtype: int
    value: object
    sub: int | None = None  # element type of an array
    count: int | None = None  # override the array count
    key_length: int | None = None  # override the key's length prefix
    value_length: int | None = None  # override a string value's length prefix

    def encode(self, out: _Out) -> None:
        out.string(self.key, length=self.key_length)
        out.u32(self.vtype)
        if self.vtype == V.STRING:
            assert isinstance(self.value, str | bytes)
            out.string(self.value, length=self.value_length)
        elif self.vtype == V.ARRAY:
            assert self.sub is not None
            assert isinstance(self.value, list | tuple)
            out.u32(self.sub)
            out.u64(len(self.value) if self.count is None else self.count)
            for item in self.value:
                if self.sub == V.STRING:
                    assert isinstance(item, str | bytes)
                    out.string(item)
                else:
                    out.raw(struct.pack(out.e + SCALAR_FORMATS[V(self.sub)], item))
        elif self.vtype in {int(t) for t in SCALAR_FORMATS}:
            out.raw(struct.pack(out.e + SCALAR_FORMATS[V(self.vtype)], self.value))
        else:  # an unknown type code: write the value as raw bytes
            assert isinstance(self.value, bytes)
            out.raw(self.value)


def kv_u32(key: str, value: int) -> KV:
    return KV(key, V.UINT32, value)


def kv_str(key: str, value: str | bytes) -> KV:
    return KV(key, V.STRING, value)


def kv_array(key: str, sub: int, values: Sequence[object]) -> KV:
    return KV(key, V.ARRAY, list(values), sub=sub)


@dataclass(frozen=True)
class TI:
    """One tensor info; ``offset=None`` places the tensor after the previous one, aligned."""

    name: str | bytes
    ne: tuple[int, ...]
    ggml_type: int = T.F32
    offset: int | None = None
    n_dims: int | None = None  # override the declared dimension count
    data: bytes | None = None  # the tensor's bytes (default: a deterministic pattern)

    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[T(self.ggml_type)]
        return math.prod(self.ne) // block * size

    def payload(self) -> bytes:
        if self.data is not None:
            return self.data
        n = self.nbytes()
        seed = sum(self.name.encode() if isinstance(self.name, str) else self.name)
        return bytes((seed + i * 7) % 251 for i in range(n))


@dataclass(frozen=True)
class Built:
    """A built file and where its parts lie."""

    data: bytes
    header_end: int  # end of the tensor infos (before padding)
    data_offset: int  # start of the data section
    tensor_offsets: tuple[int, ...]  # absolute offset of each tensor's data
    u64_fields: tuple[int, ...] = field(repr=False)  # positions of every u64 count/length/dim


def pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def build(
    *,
    kvs: Sequence[KV] = (),
    tensors: Sequence[TI] = (),
    version: int = 3,
    magic: bytes = b"GGUF",
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
    endian: str = "<",
    truncate_data: int = 0,
) -> Built:
    """A GGUF file; counts default to the real ones, ``truncate_data`` cuts bytes off the end."""
    out = _Out(endian)
    out.raw(magic)
    out.u32(version)
    out.u64(len(tensors) if n_tensors is None else n_tensors)
    out.u64(len(kvs) if n_kv is None else n_kv)
    for kv in kvs:
        kv.encode(out)
    rel = 0
    rels: list[int] = []
    for t in tensors:
        out.string(t.name)
        out.u32(len(t.ne) if t.n_dims is None else t.n_dims)
        for d in t.ne:
            out.u64(d)
        out.u32(t.ggml_type)
        offset = rel if t.offset is None else t.offset
        out.u64(offset)
        rels.append(offset)
        rel = pad(offset + len(t.payload()), alignment)
    header_end = len(out.buf)
    data_offset = pad(header_end, alignment)
    body = bytearray(out.buf) + bytes(data_offset - header_end)
    for t, r in zip(tensors, rels, strict=True):
        at = data_offset + r
        payload = t.payload()
        if len(body) < at + len(payload):
            body += bytes(at + len(payload) - len(body))
        body[at : at + len(payload)] = payload
    if tensors:  # trailing padding as writers produce it
        body += bytes(pad(len(body), alignment) - len(body))
    data = bytes(body[: len(body) - truncate_data] if truncate_data else body)
    return Built(
        data=data,
        header_end=header_end,
        data_offset=data_offset,
        tensor_offsets=tuple(data_offset + r for r in rels),
        u64_fields=tuple(out.u64_fields),
    )


def sample_model(*, n_tensors: int = 3, vocab: int = 70) -> tuple[list[KV], list[TI]]:
    """A small valid model: scalars of several types, a string, inline and on-disk arrays."""
    kvs = [
        kv_str("general.architecture", "llama"),
        kv_u32("general.alignment", 32),
        KV("llama.rope.freq_base", V.FLOAT32, 10000.0),
        KV("test.i64", V.INT64, -5),
        KV("test.bool", V.BOOL, True),
        kv_array("test.small", V.INT32, [1, 2, 3]),
        kv_array("tokenizer.ggml.tokens", V.STRING, [f"tok{i}" for i in range(vocab)]),
        kv_array("tokenizer.ggml.scores", V.FLOAT32, [float(-i) for i in range(vocab)]),
    ]
    tensors = [TI(f"blk.{i}.w", (32, 2 + i), T.Q8_0 if i % 2 else T.F32) for i in range(n_tensors)]
    return kvs, tensors
