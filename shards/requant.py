"""Re-encode one tensor of a shard to another GGML type, leaving every other byte's meaning alone.

``requantize`` is the quantization researcher's basic move: dequantize one tensor (gguf-py's
reference dequantizer), quantize it to the new type, and write a replacement shard in which the
metadata section is copied verbatim (``split.*`` and ``general.file_type`` included) and every
other tensor's bytes are identical. Targets: gguf-py's quantizers (F32, F16, BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0) and ggml's reference quantizers for Q2_K..Q6_K, IQ4_NL and IQ4_XS
(``shards.kquants``, byte-identical to ``llama-quantize`` without an importance matrix). Any other
type is refused with the ``llama-quantize`` command (llama.cpp's or ik_llama.cpp's) that writes
it. Offsets after the changed tensor move when its size changes.
The replacement is written atomically, in place by default; ``restore`` puts a saved copy back.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Final

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufswap.shards import _synth
from ggufswap.shards.atomic import atomic_copy
from ggufswap.shards.errors import FileChangedError, RequantError
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType, Origin
from ggufswap.shards.ggml_types import ggml_type as ggml_type_of
from ggufswap.shards.reader import read_header
from ggufswap.shards.records import FileIdentity, TensorRecord
from ggufswap.shards.value_types import GGUFValueType
from ggufswap.shards.writer import Hole, RawTensor, parse_type, write_gguf

SUPPORTED_TARGETS: Final = _synth.QUANTIZABLE_TYPES
# The types only ik_llama.cpp defines (the project's type table): a request for one is answered
# with ik_llama.cpp's llama-quantize.
IK_LLAMA_TYPES: Final = frozenset(
    t.name for t, layout in LAYOUTS.items() if layout.origin is Origin.IK
)
# ggml types no quantize tool writes as a tensor's storage: integers, F64, matmul intermediates.
_NOT_STORAGE: Final = frozenset({"I8", "I16", "I32", "I64", "F64", "Q8_1", "Q8_K"})
# llama.cpp types whose quantizer requires an importance matrix (ggml_quantize_requires_imatrix).
_NEEDS_IMATRIX: Final = frozenset({"IQ2_XXS", "IQ2_XS", "IQ1_S"})
_PREAMBLE: Final = struct.Struct("<IIQQ")  # magic, version, n_tensors, n_kv
_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_SCALAR_SIZES: Final = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


def _skip_value(blob: bytes, pos: int, vtype: GGUFValueType) -> int:
    """Position just after one metadata value of ``vtype`` starting at ``pos``."""
    if vtype in _SCALAR_SIZES:
        return pos + _SCALAR_SIZES[vtype]
    if vtype == GGUFValueType.STRING:
        return pos + 8 + _U64.unpack_from(blob, pos)[0]
    sub = GGUFValueType(_U32.unpack_from(blob, pos)[0])
    count = _U64.unpack_from(blob, pos + 4)[0]
    pos += 12
    if sub in _SCALAR_SIZES:
        return pos + count * _SCALAR_SIZES[sub]
    for _ in range(count):
        pos = _skip_value(blob, pos, sub)
    return pos


def _kv_section(blob: bytes) -> tuple[int, bytes]:
    """``(n_kv, raw key/value section)`` of a header that the reader has already validated."""
    _magic, _version, _n_tensors, n_kv = _PREAMBLE.unpack_from(blob, 0)
    pos = _PREAMBLE.size
    for _ in range(n_kv):
        pos += 8 + _U64.unpack_from(blob, pos)[0]  # key
        vtype = GGUFValueType(_U32.unpack_from(blob, pos)[0])
        pos = _skip_value(blob, pos + 4, vtype)
    return n_kv, blob[_PREAMBLE.size : pos]


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise FileChangedError(path, f"short read of {n} bytes at {offset}: the file shrank")
    return data


def reference_tool_command(tensor: str, type_name: str) -> str | None:
    """The ``llama-quantize`` command that writes ``tensor`` as ``type_name``; None if unknown.

    llama.cpp's tool takes ``--tensor-type REGEX=TYPE``, ik_llama.cpp's ``--custom-q REGEX=TYPE``;
    both need ``--allow-requantize`` for an already quantized input and re-encode every other
    quantizable tensor to the positional type too (so start from an F16/BF16 file).
    """
    name = type_name.strip().upper()
    rule = shlex.quote(f"^{re.escape(tensor)}$={name.lower()}")
    if name in IK_LLAMA_TYPES:
        option = "--custom-q"
    elif name in GGMLQuantizationType.__members__ and name not in _NOT_STORAGE:
        option = "--tensor-type"
    else:
        return None
    imatrix = " --imatrix IMATRIX.dat" if name in _NEEDS_IMATRIX else ""
    return f"llama-quantize --allow-requantize{imatrix} {option} {rule} IN.gguf OUT.gguf {name}"


def _unsupported(tensor: str, type_name: str) -> str:
    """The refusal message for a target this module cannot quantize to."""
    names = ", ".join(t.name for t in SUPPORTED_TARGETS)
    command = reference_tool_command(tensor, type_name)
    if type_name.strip().upper() in _NOT_STORAGE:
        return (
            f"{tensor}: no quantizer writes {type_name.strip().upper()} (an integer, F64 or "
            f"matmul-intermediate type); requant writes {names}"
        )
    if command is None:
        return f"{tensor}: unknown GGML type {type_name!r}; requant writes {names}"
    tool = "ik_llama.cpp's" if type_name.strip().upper() in IK_LLAMA_TYPES else "llama.cpp's"
    return (
        f"{tensor}: cannot quantize to {type_name.strip().upper()} (requant writes {names}); "
        f"{tool} tool writes it: {command}"
    )


TensorData = bytes | memoryview | np.ndarray  # a tensor's encoded bytes, as RawTensor takes them


def requantize_bytes(
    data: bytes | memoryview,
    ggml_type: int,
    ne: tuple[int, ...],
    target: GGMLQuantizationType | str,
    *,
    where: str = "<tensor>",
    tensor: str = "<tensor>",
) -> tuple[GGMLQuantizationType, np.ndarray]:
    """``(type, bytes)`` of a tensor's ``data`` (type ``ggml_type``, shape ``ne``) re-encoded as
    ``target``; RequantError (naming ``where`` and ``tensor``) for a target or source type the
    project cannot quantize, or a row that does not fill the target's blocks."""
    try:
        parsed = parse_type(target)
    except ValueError:
        parsed = None
    if parsed not in SUPPORTED_TARGETS:
        requested = parsed.name if parsed is not None else str(getattr(target, "name", target))
        raise RequantError(where, _unsupported(tensor, requested))
    assert parsed is not None, "checked against SUPPORTED_TARGETS"
    block_size = GGML_QUANT_SIZES[parsed][0]
    if ne[0] % block_size:
        raise RequantError(
            where,
            f"{tensor}: row length ne[0]={ne[0]} is not a multiple of the "
            f"{parsed.name} block size {block_size}",
        )
    try:
        values = _synth.decode_floats(data, GGMLType(int(ggml_type)), ne[0])
    except (NotImplementedError, ValueError):
        raise RequantError(
            where, f"{tensor}: gguf-py cannot dequantize its type {_type_name(ggml_type)}"
        ) from None
    return parsed, _synth.encode_floats(values, parsed)


def _type_name(ggml_type: int) -> str:
    member = ggml_type_of(ggml_type)
    return member.name if member is not None else str(ggml_type)


def rewrite_tensor(
    shard: str | os.PathLike[str],
    tensor: str,
    make: Callable[[TensorRecord, bytes], tuple[int, TensorData]],
    *,
    out: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``shard`` with ``tensor``'s type and bytes replaced by ``make(record, bytes)``; the
    metadata section is copied verbatim and every other tensor's bytes are identical. In place
    (atomic rename) without ``out``. RequantError for an unknown tensor (with the nearest
    names); FileChangedError when the shard changes while it is read."""
    header = read_header(shard)
    path = header.path
    records = header.tensor_map()
    if tensor not in records:
        near = difflib.get_close_matches(tensor, list(records), n=5, cutoff=0.6)
        hint = f"; nearest: {', '.join(near)}" if near else f"; it has {len(records)} tensors"
        raise RequantError(path, f"no tensor named {tensor!r}{hint}")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if FileIdentity.of_fd(fd) != header.identity:
            raise FileChangedError(path, "changed since its header was read")
        n_kv, kv_bytes = _kv_section(_pread_exact(fd, header.data_offset, 0, path))
        raws = [
            RawTensor(t.name, t.ggml_type, t.ne, _pread_exact(fd, t.nbytes, t.offset, path))
            for t in header.tensors
        ]
        if FileIdentity.of_fd(fd) != header.identity:
            raise FileChangedError(path, "changed while its tensors were being read")
    finally:
        os.close(fd)
    index = next(i for i, r in enumerate(raws) if r.name == tensor)
    data = raws[index].data
    assert not isinstance(data, Hole), "tensors read from a file are bytes"
    new_type, new_data = make(records[tensor], bytes(data))
    raws[index] = RawTensor(tensor, GGMLType(int(new_type)), records[tensor].ne, new_data)
    dest = Path(path) if out is None else Path(out)
    return write_gguf(dest, n_kv=n_kv, kv_bytes=kv_bytes, tensors=raws, alignment=header.alignment)


def requantize(
    shard: str | os.PathLike[str],
    tensor: str,
    new_type: GGMLQuantizationType | str,
    *,
    out: str | os.PathLike[str] | None = None,
) -> Path:
    """Re-encode ``tensor`` of ``shard`` as ``new_type``; returns the written file.

    Without ``out`` the shard is replaced in place (atomic rename); with ``out`` the original is
    left alone. Raises :class:`RequantError` for an unknown tensor (with the nearest names) or an
    unsupported target type (with the supported ones and the ``llama-quantize`` command that
    writes it, see :func:`reference_tool_command`).
    """
    path = str(shard)
    # the target is checked before any byte is read (a refusal costs nothing)
    if tensor in read_header(shard).tensor_map():
        try:
            target = parse_type(new_type)
        except ValueError:
            target = None
        if target not in SUPPORTED_TARGETS:
            name = target.name if target is not None else str(getattr(new_type, "name", new_type))
            raise RequantError(path, _unsupported(tensor, name))

    def make(record: TensorRecord, data: bytes) -> tuple[int, TensorData]:
        return requantize_bytes(
            data, record.ggml_type, record.ne, new_type, where=path, tensor=tensor
        )

    return rewrite_tensor(shard, tensor, make, out=out)


def restore(saved: str | os.PathLike[str], shard: str | os.PathLike[str]) -> Path:
    """Atomically put a saved copy of a shard back in place."""
    return atomic_copy(saved, shard)
