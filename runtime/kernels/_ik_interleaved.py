"""ik_llama.cpp's row-interleaved types (``_R4``/``_R8``): undo the interleave, then decode.

ik stores each group of ``interleave`` consecutive rows of such a type together (its
``repack_*`` functions in ``ggml/src/iqk/iqk_quantize.cpp`` at commit 8337e4cd3): the group's
per-row headers first (the row scales of the rows, one after the other), then one *big block* per
block column, holding block ``ib`` of every row of the group with their fields interleaved (the
``d`` of the rows side by side, then the quants of the rows 4 bytes at a time, nibbles and high
bits regrouped). Every repack here is a pure permutation of the base type's bits: nothing is
rounded or recomputed, the group holds exactly the bits of its rows in the base type.

So the decoder inverts the permutation and hands the base type's rows to the base type's own
kernel; ik's ``dequantize_row_*_r4``/``_r8`` compute the same floats as its base type's
``dequantize_row_*`` (the golden files in ``tests/fixtures/ik_golden`` check every type here bit
for bit). The permutation of one big block is found once per type by running a transcription of
ik's repack loop on *labelled bits* (each base bit carries its own index; shifts, masks and ORs
move labels), so the inverse is exact by construction. The types whose repack first converts a
block to its levels (Q5_0, Q6_0, IQ4_NL, the k-quants, IQ*_K) are one table entry each: their row
headers, their levels, and the planes ik packs the levels into (``_levels_repack``); the others
read like ik's C.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import gguf.quants as gq
import numpy as np
import torch

from ggufswap.runtime.kernels._iq import _grid_rows
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType

__all__ = ["INTERLEAVED", "Interleaved", "deinterleave"]

_WIDTH = 32  # bits of an intermediate value (C's int arithmetic), truncated to 8 on a byte store


class _Bits:
    """A value whose bits are labels: ``lab[i]`` is the base bit now at bit ``i`` (-1: zero)."""

    __slots__ = ("lab",)

    def __init__(self, lab: np.ndarray) -> None:
        self.lab = lab

    def __and__(self, mask: int) -> _Bits:
        keep = np.array([(mask >> i) & 1 for i in range(_WIDTH)], dtype=bool)
        return _Bits(np.where(keep, self.lab, -1))

    def __rshift__(self, n: int) -> _Bits:
        lab = np.full(_WIDTH, -1)
        lab[: _WIDTH - n] = self.lab[n:]
        return _Bits(lab)

    def __lshift__(self, n: int) -> _Bits:
        lab = np.full(_WIDTH, -1)
        lab[n:] = self.lab[: _WIDTH - n]
        return _Bits(lab)

    def __or__(self, other: _Bits) -> _Bits:
        both = (self.lab >= 0) & (other.lab >= 0)
        assert not both.any(), "overlapping bits"
        return _Bits(np.maximum(self.lab, other.lab))


_ZERO = _Bits(np.full(_WIDTH, -1))


class _Block:
    """A block's bytes as labelled values; ``b[off]`` reads a byte, ``b[off] = v`` stores the
    low 8 bits of ``v`` (``|=`` works as in C)."""

    def __init__(self, nbytes: int, first_label: int | None = None) -> None:
        self.bytes: list[_Bits] = []
        for j in range(nbytes):
            lab = np.full(_WIDTH, -1)
            if first_label is not None:
                lab[:8] = np.arange(8) + first_label + 8 * j
            self.bytes.append(_Bits(lab))

    def __getitem__(self, off: int) -> _Bits:
        return self.bytes[off]

    def __setitem__(self, off: int, v: _Bits) -> None:
        lab = v.lab.copy()
        lab[8:] = -1
        self.bytes[off] = _Bits(lab)

    def copy(self, dst_off: int, src: _Block, src_off: int, count: int) -> None:
        for j in range(count):
            self[dst_off + j] = src[src_off + j]


Repack = Callable[[list[_Block], _Block], None]


@dataclass(frozen=True, slots=True)
class Interleaved:
    """A row-interleaved type: its base type, how many rows a group holds, and ik's repack of
    one big block (``ilv`` base blocks in, one big block out) transcribed to Python."""

    base: GGMLType | None  # None: no such file type; ``decode`` reads the de-interleaved bytes
    ilv: int
    repack: Repack
    # ik's decoder computes d * q + (-16 d) (-32 d for Q6_0) where the base computes
    # d * (q - 16): one rounding of the same exact value either way (fused), except that an
    # exact zero is +0.0 in ik's form and -0.0 in the base's for a negative d.
    positive_zero: bool = False
    # Byte offsets in the big block whose bits 1..7 hold ik's scrambled_sign of 7 sign bits
    # (the prefix XOR r_i = s_0 ^ ... ^ s_i; the repacks below treat it as identity, and the
    # decoder undoes it, s_i = r_i ^ r_(i-1), before the permutation).
    scrambled: tuple[int, ...] = ()
    decode: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # (bytes, n_per_row)


# --- ik's repack_* loops, one big block (ggml/src/iqk/iqk_quantize.cpp) ------------------------


def _d(y: _Block, x: list[_Block], src_off: int, dst_off: int = 0) -> None:
    """``y.d[k] = x[k].d`` (fp16) for every row ``k``."""
    for k, xk in enumerate(x):
        y.copy(dst_off + 2 * k, xk, src_off, 2)


def _or(y: _Block, at: int, v: _Bits) -> None:
    """``y[at] |= v``."""
    y[at] = y[at] | v


def _u16(x: _Block, off: int) -> _Bits:
    return x[off] | (x[off + 1] << 8)


# Q5_0, Q6_0, the k-quants and IQ*_K: ik converts each row's block to its levels (one small int per
# value; 32 a block, or 256 in 8 sub-blocks of 32), then writes them in planes of ``width``-bit
# fields, four rows interleaved 4 bytes at a time; the row headers (d, dmin, extra, scales) apart.

Levels = Callable[[_Block], list[_Bits]]  # a base block -> its levels
Head = Callable[[_Block, _Block, int], None]  # (big block, row k's block, k): headers and scales


@dataclass(frozen=True, slots=True)
class _Plane:
    """Bits ``shift .. shift + width`` of the levels, packed at ``at``: per sub-block ``ib``, row
    ``k`` and ``i`` in 0..3, one byte per entry of ``fields`` (16 bytes apart) holding the levels
    ``32 ib + i + o`` for ``o`` in the entry, lowest field first."""

    at: int
    fields: tuple[tuple[int, ...], ...]
    width: int
    shift: int = 0

    def write(self, y: _Block, lv: list[_Bits], k: int) -> None:
        mask, stride = (1 << self.width) - 1, 16 * len(self.fields)
        for ib in range(len(lv) // 32):
            for i in range(4):
                q = 32 * ib + i
                for n, offsets in enumerate(self.fields):
                    v = _ZERO
                    for j, o in enumerate(offsets):
                        v = v | (((lv[q + o] >> self.shift) & mask) << self.width * j)
                    y[self.at + stride * ib + 4 * k + i + 16 * n] = v


_NIBBLES = ((0, 8), (16, 24), (4, 12), (20, 28))  # the low 4 bits, 4 bytes per 32 values
_CRUMBS = ((0, 4, 8, 12), (16, 20, 24, 28))  # 2-bit fields, 2 bytes per 32 values
_BIT2 = ((0, 4, 8, 12, 16, 20, 24, 28),)  # one high bit (bit 2) per value, q3_k / iq3_k
_BIT4_K = ((0, 8, 4, 12, 16, 24, 20, 28),)  # one high bit (bit 4), q5_k
_BIT4_IQ = ((0, 8, 16, 24, 4, 12, 20, 28),)  # one high bit (bit 4), iq5_k / iq5_ks


def _levels_repack(head: Head, levels: Levels, *planes: _Plane) -> Repack:
    """ik's repack of an r4 type given its row headers, its levels and their planes."""

    def repack(x: list[_Block], y: _Block) -> None:
        for k, xk in enumerate(x):
            head(y, xk, k)
            lv = levels(xk)
            for plane in planes:
                plane.write(y, lv, k)

    return repack


def _head_d(y: _Block, x: _Block, k: int) -> None:
    """Row ``k``'s fp16 ``d`` (the block's first two bytes) to ``d[k]``."""
    y.copy(2 * k, x, 0, 2)


def _rp_q4_0_r8(x: list[_Block], y: _Block) -> None:  # repack_q4_0 / repack_mxfp4 shape
    _d(y, x, 0)
    for k in range(8):
        for ll in range(4):
            for i in range(4):
                y[16 + 32 * ll + 4 * k + i] = x[k][2 + 4 * ll + i]


def _rp_q8_0_r8(x: list[_Block], y: _Block) -> None:
    _d(y, x, 0)
    for ll in range(4):
        for k in range(8):
            for i in range(4):
                y[16 + 32 * ll + 4 * k + i] = x[k][2 + i + 4 * ll]
                y[16 + 32 * ll + 4 * k + i + 128] = x[k][2 + i + 4 * ll + 16]


def _nibbles(qs: int, n_blocks: int) -> Levels:
    """The levels of IQ4_NL-style blocks: ``n_blocks`` runs of 16 ``qs`` bytes from ``qs``, low
    nibbles the first 16 values of each 32, high nibbles the next 16."""

    def levels(x: _Block) -> list[_Bits]:
        lv = [_ZERO] * (32 * n_blocks)
        for ib in range(n_blocks):
            for j in range(16):
                lv[32 * ib + j] = x[qs + 16 * ib + j] & 0xF
                lv[32 * ib + j + 16] = x[qs + 16 * ib + j] >> 4
        return lv

    return levels


def _head_iq4_ks(y: _Block, x: _Block, k: int) -> None:
    # block_iq4_ks / iq5_ks: scales[8]; r4: scales[32]
    for ib in range(8):
        y[4 * ib + k] = x[ib]


# block_iq4_nl: d, qs[16]; r4: d[4] (8), qs[64]. block_iq4_ks: scales[8], qs[128]; r4: scales[32],
# qs[512]
_rp_iq4_nl_r4 = _levels_repack(_head_d, _nibbles(2, 1), _Plane(8, _NIBBLES, 4))
_rp_iq4_ks_r4 = _levels_repack(_head_iq4_ks, _nibbles(8, 8), _Plane(32, _NIBBLES, 4))


def _q5_0_levels(x: _Block) -> list[_Bits]:
    """convert_q5_0: the 5-bit quants of a block_q5_0 (d, qh[4], qs[16])."""
    qh = [x[2 + j] for j in range(4)]

    def hbit(n: int) -> _Bits:  # bit n of the 32-bit qh
        return qh[n // 8] >> (n % 8) & 1

    levels = [_ZERO] * 32
    for j in range(16):
        levels[j] = (x[6 + j] & 0x0F) | (hbit(j) << 4)
        levels[j + 16] = (x[6 + j] >> 4) | (hbit(j + 16) << 4)
    return levels


def _q6_0_levels(x: _Block) -> list[_Bits]:
    """convert_q6_0: the 6-bit quants of a block_q6_0 (d, qh[8], qs[16])."""
    levels = [_ZERO] * 32
    for j in range(16):
        h = x[2 + j % 8] >> 4 * (j // 8)
        levels[j] = (x[10 + j] & 0x0F) | ((h << 4) & 0x30)
        levels[j + 16] = (x[10 + j] >> 4) | ((h << 2) & 0x30)
    return levels


# r4: d[4] (8), qh[16] (Q6_0: [32]), qs[64]
_rp_q5_0_r4 = _levels_repack(
    _head_d,
    _q5_0_levels,
    _Plane(24, _NIBBLES, 4),
    _Plane(8, ((0, 16, 4, 20, 8, 24, 12, 28),), 1, shift=4),
)
_rp_q6_0_r4 = _levels_repack(
    _head_d, _q6_0_levels, _Plane(40, _NIBBLES, 4), _Plane(8, _CRUMBS, 2, shift=4)
)


def _rp_iq4_xs_r8(x: list[_Block], y: _Block) -> None:
    # block_iq4_xs: d, scales_h (u16), scales_l[4], qs[128]
    # r8: d[8] (16), scales_h[16], scales_l[32], qs[1024]
    _d(y, x, 0)
    sh16 = [x[k][2] | (x[k][3] << 8) for k in range(8)]
    for k in range(8):
        for ib in range(8):
            sl = (x[k][4 + ib // 2] >> 4 * (ib % 2)) & 0xF
            sh = (sh16[k] >> 2 * ib) & 3
            i = 8 * ib + k
            y[32 + i % 32] = y[32 + i % 32] | (sl << 4 * (i // 32))
            y[16 + i % 16] = y[16 + i % 16] | (sh << 2 * (i // 16))
            q = 8 + 16 * ib
            for j in range(4):
                yq = 64 + 128 * ib + 4 * k + j
                y[yq] = (x[k][q + j] & 0xF) | ((x[k][q + j + 4] & 0xF) << 4)
                y[yq + 32] = (x[k][q + j + 8] & 0xF) | ((x[k][q + j + 12] & 0xF) << 4)
                y[yq + 64] = (x[k][q + j] >> 4) | ((x[k][q + j + 4] >> 4) << 4)
                y[yq + 96] = (x[k][q + j + 8] >> 4) | ((x[k][q + j + 12] >> 4) << 4)


def _scale_min_k4(j: int, q: list[_Bits]) -> tuple[_Bits, _Bits]:
    """get_scale_min_k4 on a block_q4_K's 12 scale bytes."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _head_q4_k(y: _Block, x: _Block, k: int) -> None:
    # block_q4_K / q5_K: d, dmin, scales[12]; r4: d[8] (16), scales_h[16], scales_l[32]
    y.copy(2 * k, x, 0, 2)
    y.copy(2 * (k + 4), x, 2, 2)
    sc = [x[4 + j] for j in range(12)]
    for ib in range(8):
        ld, lm = _scale_min_k4(ib, sc)
        y[32 + 4 * ib + k] = (ld & 0xF) | ((lm & 0xF) << 4)
        h = (ld >> 4) | ((lm >> 4) << 2)
        _or(y, 16 + (4 * ib + k) % 16, h << 4 * ((4 * ib + k) // 16))


def _levels_q4_k(x: _Block) -> list[_Bits]:
    # block_q4_K: qs[128] at 16
    lv = [_ZERO] * 256
    for ib64 in range(4):
        for j in range(32):
            lv[64 * ib64 + j] = x[16 + 32 * ib64 + j] & 0xF
            lv[64 * ib64 + j + 32] = x[16 + 32 * ib64 + j] >> 4
    return lv


def _levels_q5_k(x: _Block) -> list[_Bits]:
    # block_q5_K: qh[32] at 16, qs[128] at 48
    lv = [_ZERO] * 256
    for ib64 in range(4):
        for j in range(32):
            qs, qh = x[48 + 32 * ib64 + j], x[16 + j]
            lv[64 * ib64 + j] = (qs & 0xF) | (((qh >> 2 * ib64) & 1) << 4)
            lv[64 * ib64 + j + 32] = (qs >> 4) | (((qh >> (2 * ib64 + 1)) & 1) << 4)
    return lv


def _head_q6_k(y: _Block, x: _Block, k: int) -> None:
    # block_q6_K: scales[16] at 192, d at 208; r4: d[4] (8), scales[64]
    y.copy(2 * k, x, 208, 2)
    for ib in range(8):
        y[8 + 8 * ib + k] = x[192 + 2 * ib]
        y[8 + 8 * ib + k + 4] = x[192 + 2 * ib + 1]


def _levels_q6_k(x: _Block) -> list[_Bits]:
    # block_q6_K: ql[128], qh[64]
    lv = [_ZERO] * 256
    for n in range(2):
        ql, qh = 64 * n, 128 + 32 * n
        for ll in range(32):
            b = 128 * n + ll
            lv[b] = (x[ql + ll] & 0xF) | (((x[qh + ll] >> 0) & 3) << 4)
            lv[b + 32] = (x[ql + ll + 32] & 0xF) | (((x[qh + ll] >> 2) & 3) << 4)
            lv[b + 64] = (x[ql + ll] >> 4) | (((x[qh + ll] >> 4) & 3) << 4)
            lv[b + 96] = (x[ql + ll + 32] >> 4) | (((x[qh + ll] >> 6) & 3) << 4)
    return lv


def _head_q2_k(y: _Block, x: _Block, k: int) -> None:
    # block_q2_K: scales[16], qs[64], d, dmin; r4: d[8] (16), scales[64]
    y.copy(2 * k, x, 80, 2)
    y.copy(2 * (k + 4), x, 82, 2)
    for ib in range(16):
        y[16 + 4 * ib + k] = x[ib]


def _levels_q2_k(x: _Block) -> list[_Bits]:
    lv = [_ZERO] * 256
    for n in range(2):
        for j in range(32):
            for s in range(4):
                lv[128 * n + j + 32 * s] = (x[16 + 32 * n + j] >> 2 * s) & 3
    return lv


def _head_q3_k(y: _Block, x: _Block, k: int) -> None:
    # block_q3_K: hmask[32], qs[64], scales[12], d; r4: d[4] (8), scales_h[16], scales_l[32]
    y.copy(2 * k, x, 108, 2)
    aux = [x[96 + 4 * a] | (x[97 + 4 * a] << 8) | (x[98 + 4 * a] << 16) for a in range(3)]
    aux = [a | (x[99 + 4 * n] << 24) for n, a in enumerate(aux)]
    m1, m2 = 0x03030303, 0x0F0F0F0F
    tmp = aux[2]
    aux = [
        (aux[0] & m2) | (((tmp >> 0) & m1) << 4),
        (aux[1] & m2) | (((tmp >> 2) & m1) << 4),
        ((aux[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4),
        ((aux[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4),
    ]
    ld = [(aux[j // 4] >> 8 * (j % 4)) & 0xFF for j in range(16)]
    for ib in range(8):
        for half in range(2):
            at = 8 * ib + k + 4 * half
            _or(y, 24 + at % 32, (ld[2 * ib + half] & 0xF) << 4 * (at // 32))
            _or(y, 8 + at % 16, (ld[2 * ib + half] >> 4) << 2 * (at // 16))


def _levels_q3_k(x: _Block) -> list[_Bits]:
    lv = [_ZERO] * 256
    for n in range(2):
        for j in range(4):
            for ll in range(32):
                low = (x[32 + 32 * n + ll] >> 2 * j) & 3
                lv[128 * n + 32 * j + ll] = low | (((x[ll] >> (4 * n + j)) & 1) << 2)
    return lv


def _extra_r4(y: _Block, k: int, extra: _Bits, ib: int) -> None:
    """IQ*_K: the two ``extra`` bits of sub-block ``ib`` of row ``k`` (r4 ``extra`` at 8)."""
    _or(y, 8 + k, ((extra >> 2 * ib) & 1) << ib)
    _or(y, 12 + k, ((extra >> (2 * ib + 1)) & 1) << ib)


def _iq_k_scales(y: _Block, k: int, ib: int, sl: _Bits, sh: tuple[_Bits, _Bits] | None) -> None:
    """IQ2_K..IQ5_K: the two 4-bit low scales (and 2-bit high scales) of sub-block ``ib``;
    r4 ``scales_l`` at 32 (IQ2_K: ``scales`` at 16), ``scales_h`` at 16."""
    lo = 32 if sh is not None else 16
    for half in range(2):
        i = 8 * ib + k + 4 * half
        _or(y, lo + i % 32, ((sl >> 4 * half) & 0xF) << 4 * (i // 32))
        if sh is not None:
            _or(y, 16 + i % 16, sh[half] << 2 * (i // 16))


def _head_iq2_k(y: _Block, x: _Block, k: int) -> None:
    # block_iq2_k: d, extra, scales[8]; r4: d[4], extra[8], scales[32]
    _head_d(y, x, k)
    extra = _u16(x, 2)
    for ib in range(8):
        _extra_r4(y, k, extra, ib)
        _iq_k_scales(y, k, ib, x[4 + ib], None)


def _levels_iq2_k(x: _Block) -> list[_Bits]:
    # block_iq2_k: qs[64] at 12
    lv = [_ZERO] * 256
    for ib32 in range(8):
        for j in range(32):
            lv[32 * ib32 + j] = (x[12 + 32 * (ib32 // 4) + j] >> 2 * (ib32 % 4)) & 3
    return lv


def _head_iq3_k(y: _Block, x: _Block, k: int) -> None:
    # block_iq3_k: d, extra, scales_h (u16), scales_l[8]
    # r4: d[4], extra[8], scales_h[8], scales_l[32]
    _head_d(y, x, k)
    extra, sh = _u16(x, 2), _u16(x, 4)
    for ib in range(8):
        _extra_r4(y, k, extra, ib)
        for half in range(2):
            i = 8 * ib + k + 4 * half
            _or(y, 24 + i % 32, ((x[6 + ib] >> 4 * half) & 0xF) << 4 * (i // 32))
            _or(y, 16 + i % 8, ((sh >> (2 * ib + half)) & 1) << (i // 8))


def _levels_iq3_k(x: _Block) -> list[_Bits]:
    # block_iq3_k: qs[64] at 14, qh[32] at 78
    lv = [_ZERO] * 256
    for ib32 in range(8):
        for j in range(32):
            low = (x[14 + 32 * (ib32 // 4) + j] >> 2 * (ib32 % 4)) & 3
            lv[32 * ib32 + j] = low | (((x[78 + j] >> ib32) & 1) << 2)
    return lv


def _iq45_k_scales(y: _Block, x: _Block, k: int, ib: int) -> None:
    sh = x[4 + ib // 2] >> 4 * (ib % 2)
    _iq_k_scales(y, k, ib, x[8 + ib], (sh & 3, (sh >> 2) & 3))


def _head_iq45_k(y: _Block, x: _Block, k: int) -> None:
    # block_iq4_k / iq5_k: d, extra, scales_h[4], scales_l[8]
    # r4: d[4], extra[8], scales_h[16], scales_l[32]
    _head_d(y, x, k)
    extra = _u16(x, 2)
    for ib in range(8):
        _extra_r4(y, k, extra, ib)
        _iq45_k_scales(y, x, k, ib)


def _iq5_levels(x: _Block, qs: int, qh: int) -> list[_Bits]:
    """convert_iq5_k: the 5-bit levels of an IQ5_K/IQ5_KS block (``qs``/``qh`` offsets)."""
    lv = [_ZERO] * 256
    for ib64 in range(4):
        shift = 2 * ib64
        for j in range(16):
            for h in range(2):
                qs_b, qh_b = x[qs + 32 * ib64 + j + 16 * h], x[qh + j + 16 * h]
                lv[64 * ib64 + j + 16 * h] = (qs_b & 0xF) | (((qh_b >> shift) & 1) << 4)
                lv[64 * ib64 + j + 16 * h + 32] = (qs_b >> 4) | (((qh_b >> shift) & 2) << 3)
    return lv


# r4 big blocks: headers, then the planes at the offsets below.
_rp_q2_k_r4 = _levels_repack(_head_q2_k, _levels_q2_k, _Plane(80, _CRUMBS, 2))
_rp_q3_k_r4 = _levels_repack(
    _head_q3_k, _levels_q3_k, _Plane(184, _CRUMBS, 2), _Plane(56, _BIT2, 1, shift=2)
)
_rp_q4_k_r4 = _levels_repack(_head_q4_k, _levels_q4_k, _Plane(64, _NIBBLES, 4))
_rp_q5_k_r4 = _levels_repack(
    _head_q4_k, _levels_q5_k, _Plane(192, _NIBBLES, 4), _Plane(64, _BIT4_K, 1, shift=4)
)
_rp_q6_k_r4 = _levels_repack(
    _head_q6_k,
    _levels_q6_k,
    _Plane(328, _NIBBLES, 4),
    _Plane(72, ((0, 8, 4, 12), (16, 24, 20, 28)), 2, shift=4),
)
_rp_iq2_k_r4 = _levels_repack(_head_iq2_k, _levels_iq2_k, _Plane(48, _CRUMBS, 2))
_rp_iq3_k_r4 = _levels_repack(
    _head_iq3_k, _levels_iq3_k, _Plane(56, _CRUMBS, 2), _Plane(312, _BIT2, 1, shift=2)
)
_rp_iq4_k_r4 = _levels_repack(_head_iq45_k, _nibbles(16, 8), _Plane(64, _NIBBLES, 4))
_rp_iq5_k_r4 = _levels_repack(
    _head_iq45_k,
    lambda x: _iq5_levels(x, 16, 144),
    _Plane(64, _NIBBLES, 4),
    _Plane(576, _BIT4_IQ, 1, shift=4),
)
_rp_iq5_ks_r4 = _levels_repack(
    _head_iq4_ks,
    lambda x: _iq5_levels(x, 8, 136),
    _Plane(32, _NIBBLES, 4),
    _Plane(544, _BIT4_IQ, 1, shift=4),
)


def _rp_iq2_bn_r4(x: list[_Block], y: _Block) -> None:
    # block_iq2_bn: qs[16]; r4: qs[64]
    for k in range(4):
        for ll in range(4):
            for i in range(4):
                v = _ZERO
                for j in range(4):
                    v = v | (((x[k][i + 4 * j] >> 2 * ll) & 3) << 2 * j)
                y[4 * k + i + 16 * ll] = v


def _rp_iq2_s_r4(x: list[_Block], y: _Block) -> None:
    # block_iq2_s: d, qs[32], signs[32], qh[8], scales[8]
    # r4: d[4], qs[128], qh[32], signs[128], scales[32]
    _d(y, x, 0)
    for k in range(4):
        for ib in range(8):
            y[296 + 4 * ib + k] = x[k][74 + ib]
            for i in range(4):
                y[8 + 16 * ib + 4 * k + i] = x[k][2 + 4 * ib + i]
                y[168 + 16 * ib + 4 * k + i] = x[k][34 + 4 * ib + i]
            y[136 + 4 * ib + k] = x[k][66 + ib]


def _rp_iq3_s_r4(x: list[_Block], y: _Block) -> None:
    # block_iq3_s: d, qs[64], qh[8], signs[32], scales[4]
    # r4: d[4], qs[256], qh[32], signs[128], scales[16]
    _d(y, x, 0)
    for k in range(4):
        for ib in range(4):
            j = 8 * ib + k
            _or(y, 424 + j % 16, (x[k][106 + ib] & 0xF) << 4 * (j // 16))
            _or(y, 424 + (j + 4) % 16, (x[k][106 + ib] >> 4) << 4 * ((j + 4) // 16))
        for ib in range(8):
            y[264 + 4 * ib + k] = x[k][66 + ib]
            for i in range(4):
                y[8 + 32 * ib + k + 8 * i] = x[k][2 + 8 * ib + i]
                y[8 + 32 * ib + k + 8 * i + 4] = x[k][2 + 8 * ib + i + 4]
            for i in range(4):
                v = _ZERO
                for b in range(4):
                    sb = x[k][74 + 4 * ib + b]
                    v = v | (((sb >> i) & 1) << 2 * b) | (((sb >> (4 + i)) & 1) << (2 * b + 1))
                y[296 + 16 * ib + 4 * k + i] = v


def _sas(y: _Block, at: int, a: _Bits) -> None:
    """IQ2_XXS/IQ3_XXS: ``ysas`` at byte ``at`` from the 32-bit signs-and-scale word ``a``
    (four 7-bit sign groups, each with one bit of the 4-bit scale; scrambled_sign taken as
    identity, see ``Interleaved.scrambled``)."""
    for n in range(4):
        y[at + n] = (((a >> 7 * n) & 127) << 1) | ((a >> (28 + n)) & 1)


def _u32(x: _Block, off: int) -> _Bits:
    return x[off] | (x[off + 1] << 8) | (x[off + 2] << 16) | (x[off + 3] << 24)


def _rp_iq2_xxs_r4(x: list[_Block], y: _Block) -> None:
    # block_iq2_xxs: d, qs[64] (per 32 values: 4 grid bytes, a signs/scale word)
    # r4: d[4], sas[128], qs[128]
    _d(y, x, 0)
    for k in range(4):
        for ib in range(8):
            for i in range(4):
                y[136 + 16 * ib + 4 * k + i] = x[k][2 + 8 * ib + i]
            _sas(y, 8 + 4 * (4 * ib + k), _u32(x[k], 2 + 8 * ib + 4))


def _rp_iq3_xxs_r4(x: list[_Block], y: _Block) -> None:
    # block_iq3_xxs: d, qs[64] grid bytes, sas[32]; r4: d[4], sas[128], qs[256]
    _d(y, x, 0)
    for k in range(4):
        for ib in range(8):
            for i in range(8):
                y[136 + 32 * ib + 8 * k + i] = x[k][2 + 8 * ib + i]
            _sas(y, 8 + 4 * (4 * ib + k), _u32(x[k], 66 + 4 * ib))


def _rp_iq2_xs_r4(x: list[_Block], y: _Block) -> None:
    # block_iq2_xs: d, qs[32] (u16: 9-bit grid index, 7 sign bits), scales[8]
    # r4: d[4], qs[128] (u16), scales[32]
    _d(y, x, 0)
    for k in range(4):
        for ib in range(8):
            for i in range(4):
                at = 8 + 2 * (16 * ib + 4 * k + i)
                y.copy(at, x[k], 2 + 2 * (4 * ib + i), 2)  # sign bits: see scrambled
            y[264 + 4 * ib + k] = x[k][66 + ib]


def _rp_q8_k_r8(x: list[_Block], y: _Block) -> None:
    # de-interleaved block (this module's own, no ggml type): d (fp16), qs[256]
    # r8: d[8] (fp16), qs[2048]
    _d(y, x, 0)
    for k in range(8):
        for ib in range(64):
            for i in range(4):
                y[16 + 32 * ib + 4 * k + i] = x[k][2 + 4 * ib + i]


def _decode_q8_k_r8(base: torch.Tensor, n_per_row: int) -> torch.Tensor:
    """Q8_K_R8's de-interleaved blocks (fp16 ``d``, 256 int8) -> float32 ``d * q``, as ik's
    dequantize_row_q8_k_r8 (one product, so exact). Q8_K_R8 is not a repack of Q8_K's bytes:
    ik rounds Q8_K's float32 ``d`` to fp16 and drops its ``bsums``, so there is no base type."""
    blocks = base.view(-1, 258)
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    return (d * blocks[:, 2:].view(torch.int8).to(torch.float32)).reshape(-1, n_per_row)


@lru_cache(maxsize=4)
def _iq1s_grid(device: torch.device) -> torch.Tensor:
    """float32 ``[2048, 8]``: ggml's iq1s_grid (values -1, 0, 1), from gguf-py's table."""
    return torch.tensor(_grid_rows(gq.IQ1_S), dtype=torch.float32, device=device)


_IQ1_DELTA = 0.125  # IQ1S_DELTA, IQ1M_DELTA


def _iq1_rows(base: torch.Tensor, n_per_row: int, bpb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``2 + blocks * bpb`` bytes -> (fp16 row scale as float32 ``[rows, 1, 1]``,
    blocks ``[rows, n_per_row / 32, bpb]`` as int32)."""
    nb = n_per_row // 32
    rows = base.view(-1, 2 + nb * bpb)
    d = rows[:, :2].contiguous().view(torch.float16).to(torch.float32).view(-1, 1, 1)
    return d, rows[:, 2:].reshape(rows.shape[0], nb, bpb).to(torch.int32)


def _rp_iq1_s_r4(x: list[_Block], y: _Block) -> None:
    # de-interleaved block of one row (this module's own): qs[4], qh (u16)
    # r4 (after the 4 fp16 row scales): qs[16], qh[4] (u16)
    for k in range(4):
        for i in range(4):
            y[4 * i + k] = x[k][i]
        y.copy(16 + 2 * k, x[k], 4, 2)


def _decode_iq1_s_r4(base: torch.Tensor, n_per_row: int) -> torch.Tensor:
    """ik's dequantize_row_iq1_s_r4: ``dl * (grid + shift)``, ``dl = d * (2 s + 1)``."""
    d, b = _iq1_rows(base, n_per_row, 6)
    qh = b[..., 4] | (b[..., 5] << 8)  # [rows, nb]
    shift = torch.where((qh & 0x8000) != 0, -_IQ1_DELTA, _IQ1_DELTA).unsqueeze(-1)
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32).unsqueeze(-1)
    idx = b[..., :4] | (((qh.unsqueeze(-1) >> (3 * torch.arange(4, device=b.device))) & 7) << 8)
    grid = _iq1s_grid(b.device)[idx]  # [rows, nb, 4, 8]
    values = dl.unsqueeze(-1) * (grid + shift.unsqueeze(-1))
    return values.reshape(-1, n_per_row)


def _rp_iq1_m_r4(x: list[_Block], y: _Block) -> None:
    # de-interleaved block of one row (this module's own): qs[4], qh[2], scales[1]
    # r4: qs[16], qh[8], scales[4]
    for k in range(4):
        for i in range(4):
            y[4 * i + k] = x[k][i]
        y[16 + k] = x[k][4]
        y[20 + k] = x[k][5]
        y[24 + k] = x[k][6]


def _decode_iq1_m_r4(base: torch.Tensor, n_per_row: int) -> torch.Tensor:
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


T = GGMLType
INTERLEAVED: dict[GGMLType, Interleaved] = {
    T.Q4_0_R8: Interleaved(T.Q4_0, 8, _rp_q4_0_r8),
    T.Q8_0_R8: Interleaved(T.Q8_0, 8, _rp_q8_0_r8),
    T.Q5_0_R4: Interleaved(T.Q5_0, 4, _rp_q5_0_r4, positive_zero=True),
    T.Q6_0_R4: Interleaved(T.Q6_0, 4, _rp_q6_0_r4, positive_zero=True),
    T.IQ4_NL_R4: Interleaved(T.IQ4_NL, 4, _rp_iq4_nl_r4),
    T.IQ4_XS_R8: Interleaved(T.IQ4_XS, 8, _rp_iq4_xs_r8),
    T.IQ4_KS_R4: Interleaved(T.IQ4_KS, 4, _rp_iq4_ks_r4),
    T.Q4_K_R4: Interleaved(T.Q4_K, 4, _rp_q4_k_r4),
    T.Q6_K_R4: Interleaved(T.Q6_K, 4, _rp_q6_k_r4),
    T.Q2_K_R4: Interleaved(T.Q2_K, 4, _rp_q2_k_r4),
    T.Q3_K_R4: Interleaved(T.Q3_K, 4, _rp_q3_k_r4),
    T.Q5_K_R4: Interleaved(T.Q5_K, 4, _rp_q5_k_r4),
    T.IQ2_K_R4: Interleaved(T.IQ2_K, 4, _rp_iq2_k_r4),
    T.IQ3_K_R4: Interleaved(T.IQ3_K, 4, _rp_iq3_k_r4),
    T.IQ4_K_R4: Interleaved(T.IQ4_K, 4, _rp_iq4_k_r4),
    T.IQ5_K_R4: Interleaved(T.IQ5_K, 4, _rp_iq5_k_r4),
    T.IQ5_KS_R4: Interleaved(T.IQ5_KS, 4, _rp_iq5_ks_r4),
    T.IQ2_BN_R4: Interleaved(T.IQ2_BN, 4, _rp_iq2_bn_r4),
    T.IQ2_S_R4: Interleaved(T.IQ2_S, 4, _rp_iq2_s_r4),
    T.IQ3_S_R4: Interleaved(T.IQ3_S, 4, _rp_iq3_s_r4),
    T.IQ2_XXS_R4: Interleaved(T.IQ2_XXS, 4, _rp_iq2_xxs_r4, scrambled=tuple(range(8, 136))),
    T.IQ3_XXS_R4: Interleaved(T.IQ3_XXS, 4, _rp_iq3_xxs_r4, scrambled=tuple(range(8, 136))),
    T.IQ2_XS_R4: Interleaved(T.IQ2_XS, 4, _rp_iq2_xs_r4, scrambled=tuple(range(9, 264, 2))),
    T.Q8_K_R8: Interleaved(None, 8, _rp_q8_k_r8, decode=_decode_q8_k_r8),
    T.IQ1_S_R4: Interleaved(None, 4, _rp_iq1_s_r4, decode=_decode_iq1_s_r4),
    T.IQ1_M_R4: Interleaved(None, 4, _rp_iq1_m_r4, decode=_decode_iq1_m_r4),
}
del T


# --- the inverse permutation, and applying it with torch ----------------------------------------


@lru_cache(maxsize=64)
def _inverse(ggml_type: GGMLType) -> tuple[int, np.ndarray]:
    """``(unit, src)``: the big block undone in units of ``unit`` bits (8, 4, 2 or 1): base unit
    ``u`` (row-major over the group's ``ilv`` blocks) is the big block's unit ``src[u]``."""
    spec = INTERLEAVED[ggml_type]
    ts = LAYOUTS[ggml_type].type_size
    x = [_Block(ts, first_label=8 * ts * k) for k in range(spec.ilv)]
    y = _Block(spec.ilv * ts)
    spec.repack(x, y)
    labels = np.stack([b.lab[:8] for b in y.bytes]).reshape(-1)  # big block bit -> base bit
    nbits = 8 * spec.ilv * ts
    if sorted(labels.tolist()) != list(range(nbits)):
        msg = f"{ggml_type.name}: the repack is not a permutation of the base bits"
        raise AssertionError(msg)
    for unit in (8, 4, 2, 1):
        chunks = labels.reshape(-1, unit)
        aligned = (chunks[:, 0] % unit == 0) & (np.diff(chunks, axis=1) == 1).all(axis=1)
        if aligned.all():
            break
    src = np.empty(nbits // unit, dtype=np.int64)
    src[labels.reshape(-1, unit)[:, 0] // unit] = np.arange(nbits // unit)
    return unit, src


@lru_cache(maxsize=64)
def _index(ggml_type: GGMLType, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_inverse(ggml_type)[1]).to(device)


def _unscramble_table() -> np.ndarray:
    """uint8 ``[256]``: a byte with scrambled_sign's 7 bits in bits 1..7 -> the sign bits."""
    b = np.arange(256, dtype=np.int64)
    r = b >> 1
    signs = (r ^ (r << 1)) & 0x7F
    return ((signs << 1) | (b & 1)).astype(np.uint8)


@lru_cache(maxsize=8)
def _unscramble(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_unscramble_table()).to(device=device, dtype=torch.int64)


@lru_cache(maxsize=64)
def _scrambled(ggml_type: GGMLType, device: torch.device) -> torch.Tensor:
    return torch.tensor(INTERLEAVED[ggml_type].scrambled, dtype=torch.int64, device=device)


def _units(b: torch.Tensor, unit: int) -> torch.Tensor:
    """uint8 ``[..., n]`` -> ``[..., n * 8 / unit]`` fields of ``unit`` bits, low bits first."""
    if unit == 8:
        return b
    shifts = torch.arange(0, 8, unit, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & ((1 << unit) - 1)).flatten(-2)


def _pack(u: torch.Tensor, unit: int) -> torch.Tensor:
    if unit == 8:
        return u
    per = 8 // unit
    shifts = torch.arange(0, 8, unit, dtype=torch.uint8, device=u.device)
    parts = u.unflatten(-1, (-1, per)) << shifts
    out = parts[..., 0]
    for j in range(1, per):
        out = out | parts[..., j]
    return out


def deinterleave(raw: torch.Tensor, ggml_type: GGMLType, ne: tuple[int, ...]) -> torch.Tensor:
    """The base type's bytes of the tensor ``raw`` (1-D uint8, exactly its bytes, rows a
    multiple of the interleave, already checked), on ``raw``'s device."""
    spec = INTERLEAVED[ggml_type]
    layout = LAYOUTS[ggml_type]
    ilv, ts, meta = spec.ilv, layout.type_size, layout.row_meta
    nb = ne[0] // layout.block_size
    groups = math.prod(ne[1:]) // ilv
    g = raw.view(groups, ilv * (meta + nb * ts))
    unit, _ = _inverse(ggml_type)
    big = g[:, ilv * meta :].reshape(groups, nb, ilv * ts)
    if spec.scrambled:
        at = _scrambled(ggml_type, raw.device)
        big = big.clone()
        big[..., at] = _unscramble(raw.device)[big[..., at].long()].to(torch.uint8)
    blocks = _pack(_units(big, unit)[..., _index(ggml_type, raw.device)], unit)
    blocks = blocks.view(groups, nb, ilv, ts).transpose(1, 2).reshape(groups, ilv, nb * ts)
    if meta:
        blocks = torch.cat((g[:, : ilv * meta].reshape(groups, ilv, meta), blocks), dim=2)
    return blocks.reshape(-1)
