"""Dequantize GGUF tensor bytes to a torch tensor, on the tensor's own device.

On the CPU the compiled decoder (:mod:`._compiled`) runs where it handles the type; the torch
kernels run everywhere else (and on accelerators). Every kernel reproduces
``gguf.quants.dequantize`` bit for bit in float32 (hot-swapped weights
must equal a fresh load exactly); a requested ``bfloat16``/``float16`` result is converted from
that float32 result. Types without a kernel fall back to gguf's numpy code on the CPU unless
``strict`` is set.

CPU speed notes: a new result's pages are faulted in and zeroed by the kernel on first touch,
which costs more than decoding into them. A result of 4 MiB or more is therefore a mapping of its
own, on a 2 MiB boundary and advised to use transparent huge pages (one fault per 2 MiB; 64 MiB of
new 4 KiB pages took nine times as long to fill on the VM where this was measured), and the
compiled decoder's threads take it about 2 MiB at a time, so that they share the zeroing; smaller
results come from numpy's allocator. Kernel temporaries live in a small per-thread arena kept
between calls; ``out=`` skips the result allocation altogether.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable

import numpy as np
import torch

from ggufswap.logs import get_logger
from ggufswap.runtime.errors import UnsupportedTypeError
from ggufswap.runtime.kernels import _compiled
from ggufswap.runtime.kernels._base import Arena, Kernel
from ggufswap.runtime.kernels._ik import IK_KERNELS, dequantize_ik
from ggufswap.runtime.kernels._ik_interleaved import INTERLEAVED, deinterleave
from ggufswap.runtime.kernels._iq import IQ_KERNELS
from ggufswap.runtime.kernels._mainline import KERNELS as MAINLINE_KERNELS
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType, Origin, row_nbytes
from ggufswap.shards.ggml_types import ggml_type as ggml_type_of

__all__ = ["KERNEL_TYPES", "decode_rows", "dequantize", "has_kernel", "row_decoder"]

log = get_logger(__name__)

# The block-scheme torch kernels by type: the mainline table and the grid/ternary/FP4 one.
KERNELS: dict[GGMLType, Kernel] = {**MAINLINE_KERNELS, **IQ_KERNELS}

KERNEL_TYPES: frozenset[GGMLType] = (
    frozenset(GGMLType(int(t)) for t in KERNELS) | frozenset(IK_KERNELS) | frozenset(INTERLEAVED)
)

# Output elements per kernel call on the CPU: a 4 MiB float32 chunk stays in the last-level cache
# between the int->float conversion and the scaling pass. Accelerators take bigger chunks (their
# per-op launch cost dominates); their scratch is transient, from the caching allocator.
_CPU_CHUNK_ELEMENTS = 1 << 20
_DEVICE_CHUNK_ELEMENTS = 1 << 22
# CPU results from this size up are mappings of their own, in transparent huge pages (numpy's
# allocator advises huge pages from 4 MiB too); smaller ones come from numpy's allocator.
_MAPPED_MIN_BYTES = 4 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
# Per-block scales are computed for this many chunks at a time.
_CHUNKS_PER_SCALE_GROUP = 16

# CPU scratch buffers per thread, sized by the chunk (a few MiB at most), kept between calls so
# that their pages are faulted in once rather than on every call.
_scratch = threading.local()

_warned_lock = threading.Lock()
_warned_types: set[GGMLType] = set()


def has_kernel(ggml_type: int) -> bool:
    """Whether ``ggml_type`` is dequantized by a torch kernel (rather than gguf's numpy code)."""
    return ggml_type in KERNEL_TYPES


def decode_rows(
    blocks: torch.Tensor, ids: torch.Tensor, ggml_type: int, cols: int, *, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a 2-D tensor's GGUF blocks ``blocks [rows, row bytes]``,
    decoded: ``[*ids.shape, cols]`` in ``dtype`` (an embedding look-up that decodes only the rows
    asked for, each once). One token (a decode step's) decodes its row alone, without the
    look-up table (a fifth of the time); an id out of range is refused by ``index_select``."""
    if ids.numel() == 1 and 0 <= (only := int(ids.reshape(-1)[0])) < blocks.shape[0]:
        return dequantize(blocks[only], ggml_type, (cols, 1), dtype=dtype).view(*ids.shape, cols)
    wanted, where = torch.unique(ids.reshape(-1).to(blocks.device), return_inverse=True)
    picked = blocks.index_select(0, wanted).reshape(-1)
    values = dequantize(picked, ggml_type, (cols, wanted.numel()), dtype=dtype)
    return values[where].view(*ids.shape, cols)


def row_decoder(ggml_type: int, cols: int) -> Callable[[int, int], bool] | None:
    """``decode(src, dst)``: one row of ``cols`` values of ``ggml_type`` from its blocks at the
    address ``src`` into float32 at ``dst`` on the CPU, the bits :func:`decode_rows` gives that
    row (the compiled decoder both go through), with no tensor made: a decode step's embedding
    row; False (nothing written) while the compiled kernels are switched off. None where
    :func:`decode_rows` decodes the type another way (the caller goes through it)."""
    if ggml_type in INTERLEAVED or not _compiled.handles(ggml_type, cols, torch.device("cpu")):
        return None
    kernels, code = _compiled.module(), int(ggml_type)
    header = (cols,) if ggml_type in IK_KERNELS else ()  # a per-row header: told the row length

    def decode(src: int, dst: int) -> bool:
        if not _compiled.available():
            return False
        kernels.decode(src, code, cols, dst, 1, *header)
        return True

    return decode


def dequantize(
    raw: torch.Tensor,
    ggml_type: int,
    ne: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    strict: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize one tensor's GGUF bytes.

    ``raw`` is a 1-D uint8 tensor holding exactly the tensor's bytes (rows of blocks) on any
    device; ``ne`` is the ggml-order shape (``ne[0]`` varies fastest). Returns a new tensor of
    shape ``tuple(reversed(ne))`` and dtype ``dtype`` on ``raw``'s device, or fills and returns
    ``out`` (contiguous, that shape, dtype and device) when one is given: dequantizing into an
    existing buffer skips the allocation, whose first-touch page faults are a large share of
    the CPU cost.

    Size: being reworked by issue 26; split there.
    """
    known = _known(ggml_type)
    block_size, type_size = _check(raw, known, ne)
    shape = tuple(reversed(ne))
    if out is not None:
        _check_out(out, shape, dtype, raw.device)
    if known in INTERLEAVED:
        # ik's row-interleaved types: the base type's bytes, decoded by the base type's kernel
        ilv = INTERLEAVED[known].ilv
        rows = math.prod(ne[1:])
        if rows % ilv:
            msg = f"{known.name} stores rows in groups of {ilv}: {rows} rows (shape {ne})"
            raise ValueError(msg)
        if raw.data_ptr() % 8 != 0 or not raw.is_contiguous():
            raw = raw.clone(memory_format=torch.contiguous_format)
        spec = INTERLEAVED[known]
        base = deinterleave(raw, known, ne)
        if spec.base is None:
            assert spec.decode is not None
            values = spec.decode(base, ne[0]).view(shape)
            return values.to(dtype) if out is None else out.copy_(values)
        result = dequantize(base, spec.base, ne, dtype=dtype, strict=strict, out=out)
        return result.add_(0.0) if spec.positive_zero else result  # -0.0 + 0.0 is +0.0
    if known in IK_KERNELS:
        if raw.data_ptr() % 8 != 0 or not raw.is_contiguous():
            raw = raw.clone(memory_format=torch.contiguous_format)
        result = _empty(math.prod(ne), dtype, raw.device) if out is None else out
        if _compiled.handles(known, ne[0], raw.device):
            _decode_compiled_rows(raw, known, ne, result.view(-1))
        else:
            dequantize_ik(raw, known, ne, result.view(-1))
        return result.view(shape)
    if LAYOUTS[known].origin is not Origin.MAINLINE:
        msg = f"no dequantization kernel for {known.name} (an ik_llama.cpp type)"
        raise UnsupportedTypeError(msg)
    ggml_type = known  # a mainline type from here on
    if _compiled.handles(ggml_type, ne[0], raw.device):
        flat = _decode_compiled(raw, ggml_type, dtype, None if out is None else out.view(-1))
        return flat.view(shape) if out is None else out
    kernel = KERNELS.get(ggml_type)
    if kernel is None:
        if strict:
            supported = ", ".join(sorted(t.name for t in KERNEL_TYPES))
            msg = (
                f"no torch dequantization kernel for {ggml_type.name} and strict mode forbids "
                f"the CPU fallback; supported types: {supported}"
            )
            raise UnsupportedTypeError(msg)
        result = _fallback(raw, ggml_type, ne, dtype=dtype).reshape(shape)
        return result if out is None else out.copy_(result)
    n_blocks = raw.numel() // type_size
    if raw.data_ptr() % 8 != 0 or not raw.is_contiguous():
        # fields are read through wider dtype views, which need contiguous, aligned bytes
        raw = raw.clone(memory_format=torch.contiguous_format)
    flat = _run(
        kernel,
        raw.view(n_blocks, type_size),
        block_size=block_size,
        dtype=dtype,
        out=None if out is None else out.view(-1),
    )
    return flat.view(shape) if out is None else out


def _known(code: int) -> GGMLType:
    """The type table's member for ``code``; an unknown code is refused with its number."""
    known = ggml_type_of(code)
    if known is None:
        msg = f"unknown GGML type code {int(code)}"
        raise UnsupportedTypeError(msg)
    return known


def _check_out(
    out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """``out`` must be a contiguous tensor of exactly the result's shape, dtype and device."""
    problems = []
    if tuple(out.shape) != shape:
        problems.append(f"shape {tuple(out.shape)} (expected {shape})")
    if out.dtype != dtype:
        problems.append(f"dtype {out.dtype} (expected {dtype})")
    if out.device != device:
        problems.append(f"device {out.device} (expected {device}, where raw is)")
    if not out.is_contiguous():
        problems.append("a non-contiguous layout (expected contiguous)")
    if problems:
        msg = "out tensor has " + ", ".join(problems)
        raise ValueError(msg)


def _check(raw: torch.Tensor, ggml_type: GGMLType, ne: tuple[int, ...]) -> tuple[int, int]:
    """Validate ``raw`` against ``ne`` and return the type's (block_size, type_size)."""
    layout = LAYOUTS[ggml_type]
    block_size, type_size = layout.block_size, layout.type_size
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        msg = f"raw bytes must be a 1-D uint8 tensor, found {raw.dim()}-D {raw.dtype}"
        raise ValueError(msg)
    if len(ne) == 0 or any(int(n) < 1 for n in ne):
        msg = f"shape ne={tuple(ne)} must have at least one dimension, all positive"
        raise ValueError(msg)
    if ne[0] % block_size != 0:
        msg = (
            f"{ggml_type.name} row length ne[0]={ne[0]} is not a multiple of its "
            f"block size {block_size}"
        )
        raise ValueError(msg)
    expected = math.prod(ne[1:]) * row_nbytes(ggml_type, ne[0])
    if raw.numel() != expected:
        msg = (
            f"{ggml_type.name} tensor of shape ne={tuple(ne)} needs {expected} bytes, "
            f"found {raw.numel()} bytes"
        )
        raise ValueError(msg)
    return block_size, type_size


def _arena(device: torch.device) -> Arena:
    """This thread's CPU scratch arena; a transient one for other devices."""
    if device.type != "cpu":
        return Arena(device)
    arenas: dict[torch.device, Arena] | None = getattr(_scratch, "arenas", None)
    if arenas is None:
        arenas = {}
        _scratch.arenas = arenas
    arena = arenas.get(device)
    if arena is None:
        arena = arenas[device] = Arena(device)
    return arena


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D tensor; on the CPU a large one is a mapping of its own, 2 MiB-aligned
    and advised to use transparent huge pages (first-touch page faults otherwise dominate the
    kernels' time), a small one comes from numpy's allocator."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * dtype.itemsize
    if nbytes < _MAPPED_MIN_BYTES or _MADV_HUGEPAGE is None:
        return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype)
    return _mapped(nbytes).view(dtype)


def _mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` of new anonymous memory (a uint8 tensor that owns its mapping), starting on a
    huge-page boundary and advised ``MADV_HUGEPAGE``: every 2 MiB of it faults in as one huge
    page, where numpy's malloc'ed block (at an arbitrary offset) faults its partial first and
    last 2 MiB as 4 KiB pages. The length is rounded up to whole huge pages (less than 2 MiB
    more resident); Linux places such a mapping on a huge-page boundary (6.7+), else it is mapped
    one huge page longer and the tensor starts at the first boundary in it."""
    assert _MADV_HUGEPAGE is not None, "no MADV_HUGEPAGE on this platform"
    length = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -_address(region) % _HUGE_PAGE
    if offset:
        region = mmap.mmap(-1, length + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        offset = -_address(region) % _HUGE_PAGE
    region.madvise(_MADV_HUGEPAGE, offset, length)
    # the tensor holds the mapping (released, so unmapped, when the tensor's storage is freed)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)


def _address(region: mmap.mmap) -> int:
    """The start address of a mapping."""
    return int(torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr())


def _run(
    kernel: Kernel,
    blocks: torch.Tensor,
    *,
    block_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Apply ``kernel`` chunk by chunk over ``blocks [n, type_size]``; returns the flat result."""
    n_blocks = blocks.shape[0]
    device = blocks.device
    chunk_elems = _CPU_CHUNK_ELEMENTS if device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS
    chunk = max(1, chunk_elems // block_size)
    if out is None:
        out = _empty(n_blocks * block_size, dtype, device)
    out_blocks = out.view(n_blocks, block_size)
    arena = _arena(device)
    scratch = None
    if dtype != torch.float32:
        # compute each chunk in float32 scratch, then round it into the result
        scratch_elems = min(chunk, n_blocks) * block_size
        scratch = arena.take("chunk_f32", scratch_elems, torch.float32).view(-1, block_size)
    group = chunk * _CHUNKS_PER_SCALE_GROUP
    for group_start in range(0, n_blocks, group):
        # scales for a group of chunks at once: fewer small ops, still bounded scratch
        group_stop = min(group_start + group, n_blocks)
        scales = kernel.prepare(blocks[group_start:group_stop], arena)
        for start in range(group_start, group_stop, chunk):
            stop = min(start + chunk, group_stop)
            part = out_blocks[start:stop] if scratch is None else scratch[: stop - start]
            rows = slice(start - group_start, stop - group_start)
            kernel.body(blocks[start:stop], part, arena, *(s[rows] for s in scales))
            if scratch is not None:
                out_blocks[start:stop].copy_(part)
    return out


def _decode_compiled(
    raw: torch.Tensor,
    ggml_type: GGMLType,
    dtype: torch.dtype,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The compiled decoder (CPU, float32, rows over torch's thread count); another ``dtype``
    is rounded from float32 chunks, as the torch kernels do."""
    kernels, threads = _compiled.module(), torch.get_num_threads()
    raw = raw if raw.is_contiguous() else raw.contiguous()
    block_size, type_size = LAYOUTS[ggml_type].block_size, LAYOUTS[ggml_type].type_size
    numel = raw.numel() // type_size * block_size
    if out is None:
        out = _empty(numel, dtype, raw.device)
    if dtype == torch.float32:
        kernels.decode(raw.data_ptr(), int(ggml_type), numel, out.data_ptr(), threads)
        return out
    chunk = max(block_size, _CPU_CHUNK_ELEMENTS // block_size * block_size)
    scratch = _arena(raw.device).take("compiled_f32", min(chunk, numel), torch.float32)
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        part = raw[start // block_size * type_size : stop // block_size * type_size]
        kernels.decode(part.data_ptr(), int(ggml_type), stop - start, scratch.data_ptr(), threads)
        out[start:stop].copy_(scratch[: stop - start])
    return out


def _decode_compiled_rows(
    raw: torch.Tensor, ggml_type: GGMLType, ne: tuple[int, ...], out: torch.Tensor
) -> None:
    """The compiled decoder for a type with a per-row header (ik's IQ4_KS): whole rows at a
    time, float32 straight into ``out`` or through a float32 chunk for another dtype."""
    kernels, threads = _compiled.module(), torch.get_num_threads()
    cols, rows = ne[0], math.prod(ne[1:])
    row_bytes = row_nbytes(ggml_type, cols)
    if out.dtype == torch.float32:
        kernels.decode(raw.data_ptr(), int(ggml_type), rows * cols, out.data_ptr(), threads, cols)
        return
    chunk = max(1, _CPU_CHUNK_ELEMENTS // cols)
    scratch = _arena(raw.device).take("compiled_f32", min(chunk, rows) * cols, torch.float32)
    for start in range(0, rows, chunk):
        count = min(chunk, rows - start)
        part = raw[start * row_bytes : (start + count) * row_bytes]
        kernels.decode(
            part.data_ptr(), int(ggml_type), count * cols, scratch.data_ptr(), threads, cols
        )
        out[start * cols : (start + count) * cols].copy_(scratch[: count * cols])


def _fallback(
    raw: torch.Tensor,
    ggml_type: GGMLType,
    ne: tuple[int, ...],
    *,
    dtype: torch.dtype,
) -> torch.Tensor:
    """gguf's numpy dequantization on the CPU, moved back to ``raw``'s device."""
    with _warned_lock:
        first = ggml_type not in _warned_types
        _warned_types.add(ggml_type)
    if first:
        log.warning(
            "dequant_cpu_fallback",
            ggml_type=ggml_type.name,
            reason="no torch kernel; using gguf's numpy dequantization on the CPU",
        )
    from gguf import GGMLQuantizationType, quants

    rows = math.prod(ne[1:])
    data = raw.detach().cpu().numpy().reshape(rows, -1)
    try:
        values = quants.dequantize(data, GGMLQuantizationType(int(ggml_type)))
    except NotImplementedError as exc:
        msg = f"neither a torch kernel nor gguf can dequantize {ggml_type.name}: {exc}"
        raise UnsupportedTypeError(msg) from exc
    result = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return result.to(device=raw.device, dtype=dtype)
