"""ik's repacks that move the base bits as they are (IQ2_BN, IQ2_S, IQ3_S, IQ2_XXS, IQ3_XXS,
IQ2_XS, Q8_K, IQ1_S, IQ1_M), transcribed from ``repack_*`` in ik_llama.cpp's
``ggml/src/iqk/iqk_quantize.cpp`` to run on labelled bits (``_ik_labels.py``), and the decoders of
the interleaved types that have no base file type (Q8_K_R8, IQ1_S_R4, IQ1_M_R4)."""

from __future__ import annotations

from functools import lru_cache

import torch

from ggufswap.runtime.kernels._ik_labels import (
    ZERO,
    Bits,
    Block,
    copy_d,
    or_into,
)
from ggufswap.runtime.kernels._iq import _grid_rows, gguf_quants


def rp_iq2_bn_r4(x: list[Block], y: Block) -> None:
    # block_iq2_bn: qs[16]; r4: qs[64]
    for k in range(4):
        for ll in range(4):
            for i in range(4):
                v = ZERO
                for j in range(4):
                    v = v | (((x[k][i + 4 * j] >> 2 * ll) & 3) << 2 * j)
                y[4 * k + i + 16 * ll] = v


def rp_iq2_s_r4(x: list[Block], y: Block) -> None:
    # block_iq2_s: d, qs[32], signs[32], qh[8], scales[8]
    # r4: d[4], qs[128], qh[32], signs[128], scales[32]
    copy_d(y, x, 0)
    for k in range(4):
        for ib in range(8):
            y[296 + 4 * ib + k] = x[k][74 + ib]
            for i in range(4):
                y[8 + 16 * ib + 4 * k + i] = x[k][2 + 4 * ib + i]
                y[168 + 16 * ib + 4 * k + i] = x[k][34 + 4 * ib + i]
            y[136 + 4 * ib + k] = x[k][66 + ib]


def rp_iq3_s_r4(x: list[Block], y: Block) -> None:
    # block_iq3_s: d, qs[64], qh[8], signs[32], scales[4]
    # r4: d[4], qs[256], qh[32], signs[128], scales[16]
    copy_d(y, x, 0)
    for k in range(4):
        for ib in range(4):
            j = 8 * ib + k
            or_into(y, 424 + j % 16, (x[k][106 + ib] & 0xF) << 4 * (j // 16))
            or_into(y, 424 + (j + 4) % 16, (x[k][106 + ib] >> 4) << 4 * ((j + 4) // 16))
        for ib in range(8):
            y[264 + 4 * ib + k] = x[k][66 + ib]
            for i in range(4):
                y[8 + 32 * ib + k + 8 * i] = x[k][2 + 8 * ib + i]
                y[8 + 32 * ib + k + 8 * i + 4] = x[k][2 + 8 * ib + i + 4]
            for i in range(4):
                v = ZERO
                for b in range(4):
                    sb = x[k][74 + 4 * ib + b]
                    v = v | (((sb >> i) & 1) << 2 * b) | (((sb >> (4 + i)) & 1) << (2 * b + 1))
                y[296 + 16 * ib + 4 * k + i] = v


def _sas(y: Block, at: int, a: Bits) -> None:
    """IQ2_XXS/IQ3_XXS: ``ysas`` at byte ``at`` from the 32-bit signs-and-scale word ``a``
    (four 7-bit sign groups, each with one bit of the 4-bit scale; scrambled_sign taken as
    identity, see ``Interleaved.scrambled``)."""
    for n in range(4):
        y[at + n] = (((a >> 7 * n) & 127) << 1) | ((a >> (28 + n)) & 1)


def _u32(x: Block, off: int) -> Bits:
    return x[off] | (x[off + 1] << 8) | (x[off + 2] << 16) | (x[off + 3] << 24)


def rp_iq2_xxs_r4(x: list[Block], y: Block) -> None:
    # block_iq2_xxs: d, qs[64] (per 32 values: 4 grid bytes, a signs/scale word)
    # r4: d[4], sas[128], qs[128]
    copy_d(y, x, 0)
    for k in range(4):
        for ib in range(8):
            for i in range(4):
                y[136 + 16 * ib + 4 * k + i] = x[k][2 + 8 * ib + i]
            _sas(y, 8 + 4 * (4 * ib + k), _u32(x[k], 2 + 8 * ib + 4))


def rp_iq3_xxs_r4(x: list[Block], y: Block) -> None:
    # block_iq3_xxs: d, qs[64] grid bytes, sas[32]; r4: d[4], sas[128], qs[256]
    copy_d(y, x, 0)
    for k in range(4):
        for ib in range(8):
            for i in range(8):
                y[136 + 32 * ib + 8 * k + i] = x[k][2 + 8 * ib + i]
            _sas(y, 8 + 4 * (4 * ib + k), _u32(x[k], 66 + 4 * ib))


def rp_iq2_xs_r4(x: list[Block], y: Block) -> None:
    # block_iq2_xs: d, qs[32] (u16: 9-bit grid index, 7 sign bits), scales[8]
    # r4: d[4], qs[128] (u16), scales[32]
    copy_d(y, x, 0)
    for k in range(4):
        for ib in range(8):
            for i in range(4):
                at = 8 + 2 * (16 * ib + 4 * k + i)
                y.copy(at, x[k], 2 + 2 * (4 * ib + i), 2)  # sign bits: see scrambled
            y[264 + 4 * ib + k] = x[k][66 + ib]


def rp_q8_k_r8(x: list[Block], y: Block) -> None:
    # de-interleaved block (this module's own, no ggml type): d (fp16), qs[256]
    # r8: d[8] (fp16), qs[2048]
    copy_d(y, x, 0)
    for k in range(8):
        for ib in range(64):
            for i in range(4):
                y[16 + 32 * ib + 4 * k + i] = x[k][2 + 4 * ib + i]


def decode_q8_k_r8(base: torch.Tensor, n_per_row: int) -> torch.Tensor:
    """Q8_K_R8's de-interleaved blocks (fp16 ``d``, 256 int8) -> float32 ``d * q``, as ik's
    dequantize_row_q8_k_r8 (one product, so exact). Q8_K_R8 is not a repack of Q8_K's bytes:
    ik rounds Q8_K's float32 ``d`` to fp16 and drops its ``bsums``, so there is no base type."""
    blocks = base.view(-1, 258)
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    return (d * blocks[:, 2:].view(torch.int8).to(torch.float32)).reshape(-1, n_per_row)


@lru_cache(maxsize=4)
def _iq1s_grid(device: torch.device) -> torch.Tensor:
    """float32 ``[2048, 8]``: ggml's iq1s_grid (values -1, 0, 1), from gguf-py's table."""
    return torch.tensor(_grid_rows(gguf_quants().IQ1_S), dtype=torch.float32, device=device)


_IQ1_DELTA = 0.125  # IQ1S_DELTA, IQ1M_DELTA


def _iq1_rows(base: torch.Tensor, n_per_row: int, bpb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``2 + blocks * bpb`` bytes -> (fp16 row scale as float32 ``[rows, 1, 1]``,
    blocks ``[rows, n_per_row / 32, bpb]`` as int32)."""
    nb = n_per_row // 32
    rows = base.view(-1, 2 + nb * bpb)
    d = rows[:, :2].contiguous().view(torch.float16).to(torch.float32).view(-1, 1, 1)
    return d, rows[:, 2:].reshape(rows.shape[0], nb, bpb).to(torch.int32)


def rp_iq1_s_r4(x: list[Block], y: Block) -> None:
    # de-interleaved block of one row (this module's own): qs[4], qh (u16)
    # r4 (after the 4 fp16 row scales): qs[16], qh[4] (u16)
    for k in range(4):
        for i in range(4):
            y[4 * i + k] = x[k][i]
        y.copy(16 + 2 * k, x[k], 4, 2)


def decode_iq1_s_r4(base: torch.Tensor, n_per_row: int) -> torch.Tensor:
    """ik's dequantize_row_iq1_s_r4: ``dl * (grid + shift)``, ``dl = d * (2 s + 1)``."""
    d, b = _iq1_rows(base, n_per_row, 6)
    qh = b[..., 4] | (b[..., 5] << 8)  # [rows, nb]
    shift = torch.where((qh & 0x8000) != 0, -_IQ1_DELTA, _IQ1_DELTA).unsqueeze(-1)
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32).unsqueeze(-1)
    idx = b[..., :4] | (((qh.unsqueeze(-1) >> (3 * torch.arange(4, device=b.device))) & 7) << 8)
    grid = _iq1s_grid(b.device)[idx]  # [rows, nb, 4, 8]
    values = dl.unsqueeze(-1) * (grid + shift.unsqueeze(-1))
    return values.reshape(-1, n_per_row)


def rp_iq1_m_r4(x: list[Block], y: Block) -> None:
    # de-interleaved block of one row (this module's own): qs[4], qh[2], scales[1]
    # r4: qs[16], qh[8], scales[4]
    for k in range(4):
        for i in range(4):
            y[4 * i + k] = x[k][i]
        y[16 + k] = x[k][4]
        y[20 + k] = x[k][5]
        y[24 + k] = x[k][6]


def decode_iq1_m_r4(base: torch.Tensor, n_per_row: int) -> torch.Tensor:
    """ik's dequantize_row_iq1_m_r4: per 16 values ``dl * (grid + delta)``, ``dl = d * s``."""
    d, b = _iq1_rows(base, n_per_row, 7)
    sc = b[..., 6:7]
    dl = d * torch.cat((sc & 0xF, sc >> 4), dim=-1).to(torch.float32)  # [rows, nb, 2]
    qh = b[..., 4:6]  # [rows, nb, 2]
    lo = torch.stack((qh & 0x07, qh & 0x70), dim=-1)  # [rows, nb, 2, 2]
    idx = b[..., :4].reshape(*qh.shape, 2) | (lo << torch.tensor((8, 4), device=b.device))
    bits = torch.stack((qh & 0x08, qh & 0x80), dim=-1)
    delta = torch.where(bits != 0, -_IQ1_DELTA, _IQ1_DELTA)
    grid = _iq1s_grid(b.device)[idx]  # [rows, nb, 2, 2, 8]
    values = dl[..., None, None] * (grid + delta.unsqueeze(-1))
    return values.reshape(-1, n_per_row)
