"""Products with weights in their GGUF blocks on CUDA: one Triton kernel, specialised per type.

``y[m, n] = sum_k x[m, k] * W[n, k]`` for a few activation rows (decode): each program takes
``BLOCK_N`` weight rows and one activation row, walks the row in tiles of ``BLOCK_K`` columns,
decodes each tile's values from the blocks in registers (the float weights are never written to
memory) and accumulates in float32. The bytes of a tile are read once; each element's fields
(its block's scales, its quant bits) are gathered by address, as the block layout says.

Every decoder reproduces the CPU kernels' float32 values (``dequant.py``: the sub-block scale
``dl = d * sc`` rounded first, then ``dl * q``); the sums run in another order than
``F.linear``'s, so results agree with decode + matmul to float32 rounding, not bit for bit.
Layouts: ggml's ``ggml-common.h`` / ``dequantize_row_*`` for the mainline types, ik_llama.cpp's
``iqk_quantize.cpp`` for ``IQ4_K``, ``IQ4_KS`` and ``IQ2_KT`` (as :mod:`._ik` decodes them).

The kernels run on the CPU under ``TRITON_INTERPRET=1`` (numpy), which is how the CPU suite
tests them. This module imports ``triton``: import it through :mod:`.gpu`, which checks that the
optional dependency is there.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ggufswap.runtime.kernels._ik_base import IQ4K
from ggufswap.runtime.kernels._ik_trellis import kt_table as _kt_table
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType, row_nbytes

__all__ = ["TYPES", "matmul"]

# Type codes the kernel is specialised for (its TYPE constexpr is the GGML type number).
_Q8_0 = tl.constexpr(int(GGMLType.Q8_0))
_Q4_K = tl.constexpr(int(GGMLType.Q4_K))
_Q5_K = tl.constexpr(int(GGMLType.Q5_K))
_Q6_K = tl.constexpr(int(GGMLType.Q6_K))
_IQ4_XS = tl.constexpr(int(GGMLType.IQ4_XS))
_MXFP4 = tl.constexpr(int(GGMLType.MXFP4))
_IQ4_K = tl.constexpr(int(GGMLType.IQ4_K))
_IQ4_KS = tl.constexpr(int(GGMLType.IQ4_KS))
_IQ2_KT = tl.constexpr(int(GGMLType.IQ2_KT))

TYPES: frozenset[GGMLType] = frozenset(
    {
        GGMLType.Q8_0,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
        GGMLType.IQ4_XS,
        GGMLType.MXFP4,
        GGMLType.IQ4_K,
        GGMLType.IQ4_KS,
        GGMLType.IQ2_KT,
    }
)

BLOCK_N = 32
# Columns per tile: whole 256-value super-blocks, or eight 32-value blocks.
BLOCK_K = 256
# A global a kernel reads must be a tl.constexpr (Triton refuses any other at compile time;
# tests/test_code_rules.py checks it on hosts without Triton).
# IQ2_KT's table: IQ4K's 32 values, then the trellis values of every index.
_KT_OFFSET = tl.constexpr(32)
# MXFP4's table: the 16 FP4 values, then the 256 E8M0 (halved) scales.
_E8M0_OFFSET = tl.constexpr(16)


# --- field readers (byte offsets into the uint8 weight buffer) --------------------------------


@triton.jit
def _u8(w, off, mask):
    return tl.load(w + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(w, off, mask):
    return tl.load(w + off, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)


@triton.jit
def _u16(w, off, mask):
    lo = tl.load(w + off, mask=mask, other=0).to(tl.int32)
    hi = tl.load(w + off + 1, mask=mask, other=0).to(tl.int32)
    return lo | (hi << 8)


@triton.jit
def _f16(w, off, mask):
    bits = _u16(w, off, mask).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32(w, off, mask):
    bits = _u16(w, off, mask) | (_u16(w, off + 2, mask) << 16)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _nibble(byte, high):
    return tl.where(high, byte >> 4, byte & 0x0F)


# --- decoders: float32 values of the elements at (block offset, index in block) ---------------


@triton.jit
def _k_scale_min(w, blk, s, mask):
    """get_scale_min_k4: sub-block ``s``'s 6-bit scale and min (Q4_K, Q5_K)."""
    a = _u8(w, blk + 4 + s, mask)
    b = _u8(w, blk + 8 + s, mask)  # scales[s + 4]
    c = _u8(w, blk + 4 + ((s + 4) & 7), mask)  # scales[s - 4] where s >= 4
    low = s < 4
    sc = tl.where(low, a & 63, (b & 0x0F) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc, mn


@triton.jit
def _decode(w, table, blk, j, row, mask, TYPE: tl.constexpr):
    if TYPE == _Q8_0:
        return _i8(w, blk + 2 + j, mask).to(tl.float32) * _f16(w, blk, mask)
    elif TYPE == _Q4_K or TYPE == _Q5_K:
        sc, mn = _k_scale_min(w, blk, j // 32, mask)
        dl = _f16(w, blk, mask) * sc.to(tl.float32)
        ml = _f16(w, blk + 2, mask) * mn.to(tl.float32)
        chunk = j // 64
        high = (j % 64) >= 32
        if TYPE == _Q4_K:  # d | dmin | scales[12] | qs[128]
            q = _nibble(_u8(w, blk + 16 + 32 * chunk + j % 32, mask), high)
        else:  # d | dmin | scales[12] | qh[32] | qs[128]
            q = _nibble(_u8(w, blk + 48 + 32 * chunk + j % 32, mask), high)
            qh = _u8(w, blk + 16 + j % 32, mask)
            q = q | (((qh >> (2 * chunk + high.to(tl.int32))) & 1) << 4)
        return dl * q.to(tl.float32) - ml
    elif TYPE == _Q6_K:
        half = j // 128
        quarter = (j % 128) // 32
        lane = j % 32
        ql = _u8(w, blk + 64 * half + lane + 32 * (quarter % 2), mask)
        qh = _u8(w, blk + 128 + 32 * half + lane, mask)
        q = (_nibble(ql, quarter >= 2) | (((qh >> (2 * quarter)) & 3) << 4)) - 32
        sc = _i8(w, blk + 192 + 8 * half + lane // 16 + 2 * quarter, mask)
        dl = _f16(w, blk + 208, mask) * sc.to(tl.float32)
        return dl * q.to(tl.float32)
    elif TYPE == _IQ4_XS:
        ib = j // 32
        low = (_u8(w, blk + 4 + ib // 2, mask) >> (4 * (ib % 2))) & 0x0F
        high = (_u16(w, blk + 2, mask) >> (2 * ib)) & 3
        dl = _f16(w, blk, mask) * ((low | (high << 4)) - 32).to(tl.float32)
        q = _nibble(_u8(w, blk + 8 + 16 * ib + j % 16, mask), (j % 32) >= 16)
        return dl * tl.load(table + q, mask=mask, other=0.0)
    elif TYPE == _MXFP4:
        d = tl.load(table + _E8M0_OFFSET + _u8(w, blk, mask), mask=mask, other=0.0)
        q = _nibble(_u8(w, blk + 1 + j % 16, mask), j >= 16)
        return tl.load(table + q, mask=mask, other=0.0) * d
    elif TYPE == _IQ4_K:
        s = j // 16
        extra = (_u16(w, blk + 2, mask) >> s) & 1
        low = (_u8(w, blk + 8 + s // 2, mask) >> (4 * (s % 2))) & 0x0F
        high = (_u8(w, blk + 4 + s // 4, mask) >> (2 * (s % 4))) & 3
        dl = _f16(w, blk, mask) * ((low | (high << 4)) - 32).to(tl.float32)
        q = _nibble(_u8(w, blk + 16 + 16 * (j // 32) + j % 16, mask), (s % 2) == 1)
        return dl * tl.load(table + q + 16 * extra, mask=mask, other=0.0)
    elif TYPE == _IQ4_KS:
        ib = j // 32
        sc = _u8(w, blk + ib, mask)
        dl = _f32(w, row, mask) * ((sc & 254) - 127).to(tl.float32)
        q = _nibble(_u8(w, blk + 8 + 16 * ib + j % 16, mask), (j % 32) >= 16)
        return dl * tl.load(table + q + 16 * (sc & 1), mask=mask, other=0.0)
    else:  # IQ2_KT
        ib = j // 32
        nib = (_u8(w, blk + ib % 4, mask) >> (4 * (ib // 4))) & 0x0F
        dl = _f32(w, row, mask) * tl.load(table + nib, mask=mask, other=0.0)
        index = _u16(w, blk + 4 + 2 * (j // 8), mask)
        value = tl.load(table + _KT_OFFSET + 8 * index + j % 8, mask=mask, other=0.0)
        return dl * value


@triton.jit
def _qmv(
    w,
    x,
    y,
    table,
    n_rows,
    n_cols,
    row_bytes,
    stride_x,
    stride_y,
    TYPE: tl.constexpr,
    QK: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    META: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m = tl.program_id(1)
    row_mask = rows < n_rows
    row = (rows.to(tl.int64) * row_bytes)[:, None]  # [BN, 1]: each row's first byte
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        col_mask = k < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        blk = row + META + ((k // QK) * BLOCK_BYTES)[None, :]  # [BN, BK]: the element's block
        j = (k % QK)[None, :]
        values = _decode(w, table, blk, j, row, mask, TYPE)
        xk = tl.load(x + m * stride_x + k, mask=col_mask, other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(mask, values, 0.0) * xk[None, :], axis=1)
    tl.store(y + m * stride_y + rows, acc, mask=row_mask)


@lru_cache(maxsize=32)
def _table(ggml_type: GGMLType, device: torch.device) -> torch.Tensor:
    """The lookup values a type's decoder reads (a dummy for types that read none)."""
    if ggml_type in (GGMLType.IQ4_XS, GGMLType.IQ4_K, GGMLType.IQ4_KS):
        return torch.tensor(IQ4K, dtype=torch.float32, device=device)
    if ggml_type is GGMLType.IQ2_KT:
        head = torch.tensor(IQ4K, dtype=torch.float32)
        return torch.cat((head, _kt_table(torch.device("cpu")).reshape(-1))).to(device)
    if ggml_type is GGMLType.MXFP4:
        fp4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]  # gguf's doubled E2M1
        bits = [(0x00200000 << e) if e < 2 else ((e - 1) << 23) for e in range(256)]
        e8m0 = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
        return torch.cat((torch.tensor(fp4, dtype=torch.float32), e8m0)).to(device)
    return torch.zeros(1, dtype=torch.float32, device=device)


def matmul(
    raw: torch.Tensor, ggml_type: GGMLType, shape: tuple[int, int], x: torch.Tensor
) -> torch.Tensor:
    """``x @ W.T`` (float32) for ``W`` of ``shape`` ``[rows, cols]`` held as ``raw`` GGUF bytes
    (1-D uint8) of a type in :data:`TYPES`; ``x`` is ``[..., cols]`` on ``raw``'s device."""
    rows, cols = shape
    layout = LAYOUTS[ggml_type]
    flat = x.reshape(-1, cols).to(dtype=torch.float32).contiguous()  # [M, K]
    out = torch.empty(flat.shape[0], rows, dtype=torch.float32, device=raw.device)
    grid = (triton.cdiv(rows, BLOCK_N), flat.shape[0])
    _qmv[grid](
        raw,
        flat,
        out,
        _table(ggml_type, raw.device),
        rows,
        cols,
        row_nbytes(ggml_type, cols),
        flat.stride(0),
        out.stride(0),
        TYPE=int(ggml_type),
        QK=layout.block_size,
        BLOCK_BYTES=layout.type_size,
        META=layout.row_meta,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out.view(*x.shape[:-1], rows)
