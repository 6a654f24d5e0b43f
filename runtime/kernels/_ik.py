"""Torch dequantization kernels for ik_llama.cpp's quant types (and mainline's ``Q1_0``).

Each kernel decodes ``[n, type_size]`` uint8 blocks into ``[n, block_size]`` float32 values with
torch ops only, so the same code runs on the CPU and on accelerators. The source of truth is
ik_llama.cpp's CPU ``dequantize_row_*`` (``ggml/src/iqk/iqk_quantize.cpp``, ``ggml-quants.c`` for
``Q6_0``) at commit 8337e4cd3; ``tests/fixtures/ik_golden`` holds its output for every type here,
and the tests compare bit for bit. Every product is taken in the reference's order (the sub-block
scale ``dl = d * int`` rounded to float32 first, then ``dl * value``), which is what makes the
results exact rather than merely close.

Several types carry a per-row header (``row_meta`` bytes before the row's blocks, see
:mod:`ggufswap.shards.ggml_types`): the row scale ``d`` (fp16 or float32). :func:`dequantize_ik`
reads it, repeats it per block and hands it to the kernel. ``IQ1_BN``/``IQ2_BN`` apply it as ik's
CUDA decoder does (its CPU ``to_float`` leaves it to the caller).

The ``_KT`` (trellis) types are in :mod:`._ik_trellis`; what the kernels share (the field
readers, the kernel record, IQ4_K's grid) in :mod:`._ik_base`.

Speed: plain torch ops on int32 fields, one pass per field; fast enough to load a model, with no
attempt at the SWAR tricks of :mod:`._mainline` (``bench/dequant.py`` reports GB/s).
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from functools import lru_cache

import torch

from ggufswap.runtime.kernels._ik_base import (
    IQ4K,
    IkKernel,
    bits,
    f16,
    lookup,
    nibbles,
    scaled,
    table,
    u8,
    u16,
)
from ggufswap.runtime.kernels._ik_trellis import TRELLIS_KERNELS
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType

__all__ = ["IK_KERNELS", "dequantize_ik"]

# ik's non-linear grids (ggml-common.h); each type's second half is the grid shifted by ``extra``.
IQ2NL = (-31, -13, 1, 17, -26, -8, 6, 22)
IQ3NL = (-63, -40, -23, -10, 1, 13, 28, 47, -59, -36, -19, -6, 5, 17, 32, 51)
IQ5NL = (
    *(-126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6),
    *(-1, 5, 11, 17, 23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121),
    *(-124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4),
    *(1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99, 111, 123),
)
# IQ2_KL: 32 pairs of values, each uint16 holding two int8 (low byte first).
IQ2KL = (
    *(0xE9C1, 0x0DC1, 0xC1D8, 0xF6D8, 0x0DD8, 0x2FD8, 0xD8E9, 0xE9E9),
    *(0x01E9, 0x0DE9, 0x1CE9, 0xC1F6, 0x01F6, 0x0DF6, 0x2FF6, 0xE901),
    *(0xF601, 0x0101, 0x0D01, 0x1C01, 0xD80D, 0xE90D, 0xF60D, 0x010D),
    *(0x0D0D, 0xC11C, 0xE91C, 0x011C, 0x1C1C, 0x2F1C, 0xE92F, 0x0D2F),
)
# IQ1_BN: a byte holds 5 ternary digits, read by multiplying with these (mod 256).
IQ1BN_MULT = (81, 27, 9, 3, 1)
# IQ6_K's value curve: A + q*(B + q*(-C + q*D)) (+1 for the shifted grid).
IQ6K_ABCD = (-127.0, 6.2568, 0.11218, 0.0011972)
_CPU_CHUNK_ELEMENTS = 1 << 20
_DEVICE_CHUNK_ELEMENTS = 1 << 23


# --- tables (per device, built once) -----------------------------------------------------------


@lru_cache(maxsize=8)
def _iq2kl_table(device: torch.device) -> torch.Tensor:
    """``[32, 2]`` float32: the two values of each IQ2_KL pair."""
    pairs = torch.tensor(IQ2KL, dtype=torch.int32)
    lo = ((pairs & 0xFF) ^ 0x80) - 0x80
    hi = (((pairs >> 8) & 0xFF) ^ 0x80) - 0x80
    return torch.stack((lo, hi), dim=1).to(device=device, dtype=torch.float32)


@lru_cache(maxsize=8)
def _iq1bn_table(device: torch.device) -> torch.Tensor:
    """``[256, 5]`` float32: the five ternary digits (-1, 0, 1) a byte encodes."""
    q = torch.arange(256, dtype=torch.int32).view(256, 1)
    v = (q * torch.tensor(IQ1BN_MULT, dtype=torch.int32)) & 0xFF
    return (((v + (v >> 1)) >> 7) - 1).to(device=device, dtype=torch.float32)


def _f32(x: Fraction) -> Fraction:
    """``x`` rounded to the nearest float32 (ties to even), exactly."""
    if x == 0:
        return x
    scale = Fraction(2) ** (24 - math.frexp(float(x))[1])
    return Fraction(round(x * scale)) / scale


def _as_f32(value: float) -> Fraction:
    return Fraction(struct.unpack("<f", struct.pack("<f", value))[0])


@lru_cache(maxsize=8)
def _iq6k_table(device: torch.device) -> torch.Tensor:
    """``[2, 64]`` float32: IQ6_K's curve at q = 0..63 (plus 1 for the shifted grid).

    ik's compiled reference contracts the curve into three fused multiply-adds (one rounding
    each: ``fma(q, fma(q, fma(q, D, -C), B), A)``), which float32 torch ops cannot reproduce;
    the table is evaluated exactly in rationals and rounded as each fma rounds.
    """
    a, b, c, d = (_as_f32(x) for x in IQ6K_ABCD)
    curve = []
    for q in map(Fraction, range(64)):
        curve.append(float(_f32(q * _f32(q * _f32(q * d - c) + b) + a)))
    values = torch.tensor(curve, dtype=torch.float32)
    return torch.stack((values + 0.0, values + 1.0)).to(device)


# --- kernels -----------------------------------------------------------------------------------


def _q6_0(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # d fp16 | qh[8] | qs[16]; element j (<16): low nibble of qs[j], bits 4-5 from qh[j % 8]
    # shifted by 4 * (j // 8); element j + 16: high nibble, the next two bits.
    n = b.shape[0]
    d = f16(b, 0)
    qh = u8(b, 2, 8)
    qs = u8(b, 10, 16)
    h = torch.cat((qh, qh >> 4), dim=1)  # [n, 16]: the byte for element j
    lo = (qs & 0x0F) | ((h << 4) & 0x30)
    hi = (qs >> 4) | ((h << 2) & 0x30)
    q = torch.cat((lo, hi), dim=1) - 32
    return (q.to(torch.float32) * d).view(n, 32)


def _q1_0(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # d fp16 | 16 bytes of sign bits, least significant first: +d for 1, -d for 0
    n = b.shape[0]
    d = f16(b, 0)
    signs = (u8(b, 2, 16).view(n, 16, 1) >> torch.arange(8, device=b.device, dtype=torch.int32)) & 1
    return torch.where(signs.view(n, 128).bool(), d, -d)


def _iq1_bn(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # ql[12] | extra: per 16 values, 3 bytes of 5 digits, then one digit of ``extra``
    assert row_d is not None, "IQ1_BN needs its row scale"
    n = b.shape[0]
    digits = _iq1bn_table(b.device)
    ql = lookup(digits, u8(b, 0, 12)).view(n, 4, 15)
    extra = lookup(digits, u8(b, 12, 1)).view(n, 5)[:, :4].reshape(n, 4, 1)
    return (row_d.view(n, 1, 1) * torch.cat((ql, extra), dim=2)).view(n, 64)


def _iq2_bn(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # qs[16]: element 16 * s + j is bits 2s..2s+1 of qs[j], minus one
    assert row_d is not None, "IQ2_BN needs its row scale"
    n = b.shape[0]
    qs = u8(b, 0, 16).view(n, 1, 16)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=b.device).view(1, 4, 1)
    q = (((qs >> shifts) & 3) - 1).to(torch.float32).view(n, 64)
    return row_d * q


def _crumb_quarters(qs: torch.Tensor) -> torch.Tensor:
    """IQ2_K/IQ3_K low bits: ``qs [n, 64]`` -> ``[n, 256]``: for each 32-byte half, its 2-bit
    fields 0..3 in turn (element order of the 16-value sub-blocks)."""
    n = qs.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=qs.device).view(1, 1, 4, 1)
    return ((qs.view(n, 2, 1, 32) >> shifts) & 3).view(n, 256)


def _iq2_k(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # d fp16 | extra u16 | scales[8] (4-bit, minus 8) | qs[64]; 16 sub-blocks of 16
    n = b.shape[0]
    d = f16(b, 0)
    extra = bits(u16(b, 2), 16)  # [n, 16]: shifted grid per sub-block
    sc = nibbles(u8(b, 4, 8)).transpose(1, 2).reshape(n, 16)
    dl = d * (sc - 8).to(torch.float32)
    q = _crumb_quarters(u8(b, 12, 64)).view(n, 16, 16) + 4 * extra.view(n, 16, 1)
    return scaled(dl, lookup(table(b.device, IQ2NL), q))


def _iq2_ks(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # extra u16 | scales[4] | qs[64]; 8 sub-blocks of 32; scale s: nibble s of scales plus bit
    # 8 + s of extra as its 5th bit, minus 16; bit s of extra picks the shifted grid
    assert row_d is not None, "IQ2_KS needs its row scale"
    n = b.shape[0]
    extra = bits(u16(b, 0), 16)
    sc = nibbles(u8(b, 2, 4)).transpose(1, 2).reshape(n, 8) | (extra[:, 8:] << 4)
    dl = row_d * (sc - 16).to(torch.float32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=b.device).view(1, 1, 4, 1)
    q = ((u8(b, 6, 64).view(n, 2, 1, 32) >> shifts) & 3).view(n, 8, 32)
    q = q + 4 * extra[:, :8].reshape(n, 8, 1)
    return scaled(dl, lookup(table(b.device, IQ2NL), q))


def _iq2_kl(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # scales_h u16 | scales_l[4] | qs[64] | qh[16]; 8 sub-blocks of 32 = 16 pairs; pair j of
    # sub-block s: nibble s % 2 of qs[16 * (s // 2) + j], 5th bit: bit s of qh[j]
    assert row_d is not None, "IQ2_KL needs its row scale"
    n = b.shape[0]
    sh = u16(b, 0)
    sl = u8(b, 2, 4)
    s = torch.arange(8, dtype=torch.int32, device=b.device)
    low = (sl[:, s % 4] >> (4 * (s // 4))) & 0x0F
    dl = row_d * ((low | (((sh >> (2 * s)) & 3) << 4)) - 32).to(torch.float32)
    qs = nibbles(u8(b, 6, 64).view(n, 4, 16)).view(n, 8, 16)
    qh = (u8(b, 70, 16).view(n, 1, 16) >> s.view(1, 8, 1)) & 1
    pairs = lookup(_iq2kl_table(b.device), qs | (qh << 4))  # [n, 8, 16, 2]
    return scaled(dl, pairs.view(n, 256))


def _iq3_k(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # d fp16 | extra u16 | scales_h u16 (signs) | scales_l[8] | qs[64] | qh[32]; 16 sub-blocks
    # of 16; scale (2 * nibble + 1) * sign; 3rd bit of sub-block s = 2 * ib + h: bit ib of
    # qh[16 * h + j]
    n = b.shape[0]
    d = f16(b, 0)
    extra = bits(u16(b, 2), 16)
    sign = 1 - 2 * bits(u16(b, 4), 16)
    sc = nibbles(u8(b, 6, 8)).transpose(1, 2).reshape(n, 16)
    dl = d * ((2 * sc + 1) * sign).to(torch.float32)
    low = _crumb_quarters(u8(b, 14, 64)).view(n, 8, 32)
    ib = torch.arange(8, dtype=torch.int32, device=b.device).view(1, 8, 1)
    high = (u8(b, 78, 32).view(n, 1, 32) >> ib) & 1
    q = (low | (high << 2)).view(n, 16, 16) + 8 * extra.view(n, 16, 1)
    return scaled(dl, lookup(table(b.device, IQ3NL), q))


def _iq3_ks(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # extra u16 | scales[4] | qs[64] | qh[32]; 8 sub-blocks of 32; scale s: nibble s // 4 of
    # scales[s % 4], 5th bit: bit s of extra, minus 16; grid: bit 8 + s; low bits: field s % 4
    # of qs[32 * (s // 4) + j], 3rd bit: bit s of qh[j]
    assert row_d is not None, "IQ3_KS needs its row scale"
    n = b.shape[0]
    extra = bits(u16(b, 0), 16)
    sc = nibbles(u8(b, 2, 4)).view(n, 8) | (extra[:, :8] << 4)
    dl = row_d * (sc - 16).to(torch.float32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=b.device).view(1, 1, 4, 1)
    low = ((u8(b, 6, 64).view(n, 2, 1, 32) >> shifts) & 3).view(n, 8, 32)
    s = torch.arange(8, dtype=torch.int32, device=b.device).view(1, 8, 1)
    high = (u8(b, 70, 32).view(n, 1, 32) >> s) & 1
    q = (low | (high << 2)) + 8 * extra[:, 8:].reshape(n, 8, 1)
    return scaled(dl, lookup(table(b.device, IQ3NL), q))


def _k_scales6(sl: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    """IQ4_K/IQ5_K 6-bit scales of 16 sub-blocks: nibble s % 2 of ``sl[s // 2]`` and bits
    2 * (s % 4).. of ``sh[s // 4]`` above it, minus 32."""
    n = sl.shape[0]
    low = nibbles(sl).transpose(1, 2).reshape(n, 16)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=sl.device)
    high = ((sh.view(n, 4, 1) >> shifts) & 3).view(n, 16)
    return (low | (high << 4)) - 32


def _iq4_k(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # d fp16 | extra u16 | scales_h[4] | scales_l[8] | qs[128]; sub-block s = 2 * ib + h:
    # nibble h of qs[16 * ib + j]
    n = b.shape[0]
    d = f16(b, 0)
    extra = bits(u16(b, 2), 16)
    dl = d * _k_scales6(u8(b, 8, 8), u8(b, 4, 4)).to(torch.float32)
    q = nibbles(u8(b, 16, 128).view(n, 8, 16)).view(n, 16, 16) + 16 * extra.view(n, 16, 1)
    return scaled(dl, lookup(table(b.device, IQ4K), q))


def _iq5_k(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # d fp16 | extra u16 | scales_h[4] | scales_l[8] | qs[128] | qh[32]; sub-block
    # t = 4 * ib64 + 2 * nib + half: nibble nib of qs[32 * ib64 + 16 * half + j], 5th bit:
    # bit 2 * ib64 + nib of qh[16 * half + j]
    n = b.shape[0]
    d = f16(b, 0)
    extra = bits(u16(b, 2), 16)
    dl = d * _k_scales6(u8(b, 8, 8), u8(b, 4, 4)).to(torch.float32)
    low = nibbles(u8(b, 16, 128).view(n, 4, 32))  # [n, ib64, nib, 32]
    bit = torch.arange(8, dtype=torch.int32, device=b.device).view(1, 4, 2, 1)
    high = (u8(b, 144, 32).view(n, 1, 1, 32) >> bit) & 1
    q = (low | (high << 4)).view(n, 16, 16) + 32 * extra.view(n, 16, 1)
    return scaled(dl, lookup(table(b.device, IQ5NL), q))


def _iq6_k(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # d fp16 | extra u16 | scales int8[16] | qs[128] | qh[64]; sub-block t = 4 * ib64 + 2 * nib
    # + half: nibble nib of qs[32 * ib64 + 16 * half + j], bits 4-5: field
    # 2 * (2 * (ib64 % 2) + nib) of qh[32 * (ib64 // 2) + 16 * half + j]
    n = b.shape[0]
    d = f16(b, 0)
    extra = bits(u16(b, 2), 16)
    scales = ((u8(b, 4, 16) ^ 0x80) - 0x80).to(torch.float32)
    dl = d * scales
    low = nibbles(u8(b, 20, 128).view(n, 4, 32))  # [n, ib64, nib, 32]
    qh = u8(b, 148, 64).view(n, 2, 1, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=b.device).view(1, 1, 2, 2, 1)
    high = ((qh >> shifts) & 3).view(n, 4, 2, 32)
    q = (low | (high << 4)).view(n, 16, 16) + 64 * extra.view(n, 16, 1)
    return scaled(dl, lookup(_iq6k_table(b.device).view(128), q))


def _iq4_ks(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # scales[8] (bit 0: grid, bits 1-7: scale + 127) | qs[128]; sub-block ib of 32: nibble
    # h of qs[16 * ib + j] for element 16 * h + j
    assert row_d is not None, "IQ4_KS needs its row scale"
    n = b.shape[0]
    sc = u8(b, 0, 8)
    dl = row_d * ((sc & 254) - 127).to(torch.float32)
    q = nibbles(u8(b, 8, 128).view(n, 8, 16)).view(n, 8, 32) + 16 * (sc & 1).view(n, 8, 1)
    return scaled(dl, lookup(table(b.device, IQ4K), q))


def _iq4_kss(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # 8 uint16 per sub-block of 32: bit 0 of each is one bit of the sub-block's scale byte;
    # the rest, x ^ (x >> 1) with bit 0 cleared, are four nibbles (as IQ4_KS's qs)
    assert row_d is not None, "IQ4_KSS needs its row scale"
    n = b.shape[0]
    words = u16(b, 0, 64).view(n, 8, 8)
    ls = ((words & 1) << torch.arange(8, dtype=torch.int32, device=b.device)).sum(dim=2)
    dl = row_d * ((ls & 254) - 127).to(torch.float32)
    aux = words & 0xFFFE
    aux = aux ^ (aux >> 1)
    qbytes = torch.stack((aux & 0xFF, aux >> 8), dim=3).view(n, 8, 16)
    q = nibbles(qbytes).view(n, 8, 32) + 16 * (ls & 1).view(n, 8, 1)
    return scaled(dl, lookup(table(b.device, IQ4K), q))


def _iq5_ks(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # scales[8] (as IQ4_KS) | qs[128] | qh[32]; sub-block s: nibble s % 2 of
    # qs[32 * (s // 2) + j], 5th bit: bit s of qh[j]
    assert row_d is not None, "IQ5_KS needs its row scale"
    n = b.shape[0]
    sc = u8(b, 0, 8)
    dl = row_d * ((sc & 254) - 127).to(torch.float32)
    low = nibbles(u8(b, 8, 128).view(n, 4, 32)).view(n, 8, 32)
    s = torch.arange(8, dtype=torch.int32, device=b.device).view(1, 8, 1)
    high = (u8(b, 136, 32).view(n, 1, 32) >> s) & 1
    q = (low | (high << 4)) + 32 * (sc & 1).view(n, 8, 1)
    return scaled(dl, lookup(table(b.device, IQ5NL), q))


T = GGMLType
IK_KERNELS: dict[GGMLType, IkKernel] = {
    T.Q1_0: IkKernel(_q1_0),
    T.Q6_0: IkKernel(_q6_0),
    T.IQ1_BN: IkKernel(_iq1_bn, "f16"),
    T.IQ2_BN: IkKernel(_iq2_bn, "f32"),
    T.IQ2_K: IkKernel(_iq2_k),
    T.IQ3_K: IkKernel(_iq3_k),
    T.IQ4_K: IkKernel(_iq4_k),
    T.IQ5_K: IkKernel(_iq5_k),
    T.IQ6_K: IkKernel(_iq6_k),
    T.IQ2_KS: IkKernel(_iq2_ks, "f16"),
    T.IQ2_KL: IkKernel(_iq2_kl, "f16"),
    T.IQ3_KS: IkKernel(_iq3_ks, "f16"),
    T.IQ4_KS: IkKernel(_iq4_ks, "f32"),
    T.IQ4_KSS: IkKernel(_iq4_kss, "f32"),
    T.IQ5_KS: IkKernel(_iq5_ks, "f32"),
    **TRELLIS_KERNELS,
}
del T


def dequantize_ik(
    raw: torch.Tensor, ggml_type: GGMLType, ne: tuple[int, ...], out: torch.Tensor
) -> None:
    """Decode ``raw`` (1-D uint8, exactly the tensor's bytes, already checked) into ``out``
    (contiguous, ``prod(ne)`` elements, any float dtype), a chunk of rows at a time."""
    kernel = IK_KERNELS[ggml_type]
    layout = LAYOUTS[ggml_type]
    n_per_row = ne[0]
    rows = math.prod(ne[1:])
    blocks_per_row = n_per_row // layout.block_size
    row_bytes = layout.row_meta + blocks_per_row * layout.type_size
    by_row = raw.view(rows, row_bytes)
    flat = out.view(rows, n_per_row)
    chunk_elems = _CPU_CHUNK_ELEMENTS if raw.device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS
    chunk = max(1, chunk_elems // n_per_row)
    for start in range(0, rows, chunk):
        part = by_row[start : start + chunk]
        count = part.shape[0]
        blocks = part[:, layout.row_meta :].reshape(count * blocks_per_row, layout.type_size)
        row_d = None
        if kernel.row_scale is not None:
            head = part[:, : layout.row_meta].contiguous()
            scale_dtype = torch.float16 if kernel.row_scale == "f16" else torch.float32
            d = head[:, : scale_dtype.itemsize].contiguous().view(scale_dtype).to(torch.float32)
            row_d = d.repeat_interleave(blocks_per_row, dim=0)  # [count * blocks_per_row, 1]
        values = kernel.decode(blocks, row_d)
        flat[start : start + count].copy_(values.view(count, n_per_row))
