"""ik's repacks of the types it first converts to levels (Q5_0, Q6_0, IQ4_NL, IQ4_KS, the
k-quants, IQ*_K), one table entry each, and of Q4_0, Q8_0 and IQ4_XS, transcribed from
``repack_*`` in ik_llama.cpp's ``ggml/src/iqk/iqk_quantize.cpp`` to run on labelled bits
(``_ik_labels.py``)."""

from __future__ import annotations

from ggufswap.runtime.kernels._ik_labels import (
    BIT2,
    BIT4_IQ,
    BIT4_K,
    CRUMBS,
    NIBBLES,
    ZERO,
    Bits,
    Block,
    Levels,
    Plane,
    copy_d,
    levels_repack,
    or_into,
    u16,
)


def _head_d(y: Block, x: Block, k: int) -> None:
    """Row ``k``'s fp16 ``d`` (the block's first two bytes) to ``d[k]``."""
    y.copy(2 * k, x, 0, 2)


def rp_q4_0_r8(x: list[Block], y: Block) -> None:  # repack_q4_0 / repack_mxfp4 shape
    copy_d(y, x, 0)
    for k in range(8):
        for ll in range(4):
            for i in range(4):
                y[16 + 32 * ll + 4 * k + i] = x[k][2 + 4 * ll + i]


def rp_q8_0_r8(x: list[Block], y: Block) -> None:
    copy_d(y, x, 0)
    for ll in range(4):
        for k in range(8):
            for i in range(4):
                y[16 + 32 * ll + 4 * k + i] = x[k][2 + i + 4 * ll]
                y[16 + 32 * ll + 4 * k + i + 128] = x[k][2 + i + 4 * ll + 16]


def _nibbles(qs: int, n_blocks: int) -> Levels:
    """The levels of IQ4_NL-style blocks: ``n_blocks`` runs of 16 ``qs`` bytes from ``qs``, low
    nibbles the first 16 values of each 32, high nibbles the next 16."""

    def levels(x: Block) -> list[Bits]:
        lv = [ZERO] * (32 * n_blocks)
        for ib in range(n_blocks):
            for j in range(16):
                lv[32 * ib + j] = x[qs + 16 * ib + j] & 0xF
                lv[32 * ib + j + 16] = x[qs + 16 * ib + j] >> 4
        return lv

    return levels


def _head_iq4_ks(y: Block, x: Block, k: int) -> None:
    # block_iq4_ks / iq5_ks: scales[8]; r4: scales[32]
    for ib in range(8):
        y[4 * ib + k] = x[ib]


# block_iq4_nl: d, qs[16]; r4: d[4] (8), qs[64]. block_iq4_ks: scales[8], qs[128]; r4: scales[32],
# qs[512]
rp_iq4_nl_r4 = levels_repack(_head_d, _nibbles(2, 1), Plane(8, NIBBLES, 4))
rp_iq4_ks_r4 = levels_repack(_head_iq4_ks, _nibbles(8, 8), Plane(32, NIBBLES, 4))


def _q5_0_levels(x: Block) -> list[Bits]:
    """convert_q5_0: the 5-bit quants of a block_q5_0 (d, qh[4], qs[16])."""
    qh = [x[2 + j] for j in range(4)]

    def hbit(n: int) -> Bits:  # bit n of the 32-bit qh
        return qh[n // 8] >> (n % 8) & 1

    levels = [ZERO] * 32
    for j in range(16):
        levels[j] = (x[6 + j] & 0x0F) | (hbit(j) << 4)
        levels[j + 16] = (x[6 + j] >> 4) | (hbit(j + 16) << 4)
    return levels


def _q6_0_levels(x: Block) -> list[Bits]:
    """convert_q6_0: the 6-bit quants of a block_q6_0 (d, qh[8], qs[16])."""
    levels = [ZERO] * 32
    for j in range(16):
        h = x[2 + j % 8] >> 4 * (j // 8)
        levels[j] = (x[10 + j] & 0x0F) | ((h << 4) & 0x30)
        levels[j + 16] = (x[10 + j] >> 4) | ((h << 2) & 0x30)
    return levels


# r4: d[4] (8), qh[16] (Q6_0: [32]), qs[64]
rp_q5_0_r4 = levels_repack(
    _head_d,
    _q5_0_levels,
    Plane(24, NIBBLES, 4),
    Plane(8, ((0, 16, 4, 20, 8, 24, 12, 28),), 1, shift=4),
)
rp_q6_0_r4 = levels_repack(
    _head_d, _q6_0_levels, Plane(40, NIBBLES, 4), Plane(8, CRUMBS, 2, shift=4)
)


def rp_iq4_xs_r8(x: list[Block], y: Block) -> None:
    # block_iq4_xs: d, scales_h (u16), scales_l[4], qs[128]
    # r8: d[8] (16), scales_h[16], scales_l[32], qs[1024]
    copy_d(y, x, 0)
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


def _scale_min_k4(j: int, q: list[Bits]) -> tuple[Bits, Bits]:
    """get_scale_min_k4 on a block_q4_K's 12 scale bytes."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _head_q4_k(y: Block, x: Block, k: int) -> None:
    # block_q4_K / q5_K: d, dmin, scales[12]; r4: d[8] (16), scales_h[16], scales_l[32]
    y.copy(2 * k, x, 0, 2)
    y.copy(2 * (k + 4), x, 2, 2)
    sc = [x[4 + j] for j in range(12)]
    for ib in range(8):
        ld, lm = _scale_min_k4(ib, sc)
        y[32 + 4 * ib + k] = (ld & 0xF) | ((lm & 0xF) << 4)
        h = (ld >> 4) | ((lm >> 4) << 2)
        or_into(y, 16 + (4 * ib + k) % 16, h << 4 * ((4 * ib + k) // 16))


def _levels_q4_k(x: Block) -> list[Bits]:
    # block_q4_K: qs[128] at 16
    lv = [ZERO] * 256
    for ib64 in range(4):
        for j in range(32):
            lv[64 * ib64 + j] = x[16 + 32 * ib64 + j] & 0xF
            lv[64 * ib64 + j + 32] = x[16 + 32 * ib64 + j] >> 4
    return lv


def _levels_q5_k(x: Block) -> list[Bits]:
    # block_q5_K: qh[32] at 16, qs[128] at 48
    lv = [ZERO] * 256
    for ib64 in range(4):
        for j in range(32):
            qs, qh = x[48 + 32 * ib64 + j], x[16 + j]
            lv[64 * ib64 + j] = (qs & 0xF) | (((qh >> 2 * ib64) & 1) << 4)
            lv[64 * ib64 + j + 32] = (qs >> 4) | (((qh >> (2 * ib64 + 1)) & 1) << 4)
    return lv


def _head_q6_k(y: Block, x: Block, k: int) -> None:
    # block_q6_K: scales[16] at 192, d at 208; r4: d[4] (8), scales[64]
    y.copy(2 * k, x, 208, 2)
    for ib in range(8):
        y[8 + 8 * ib + k] = x[192 + 2 * ib]
        y[8 + 8 * ib + k + 4] = x[192 + 2 * ib + 1]


def _levels_q6_k(x: Block) -> list[Bits]:
    # block_q6_K: ql[128], qh[64]
    lv = [ZERO] * 256
    for n in range(2):
        ql, qh = 64 * n, 128 + 32 * n
        for ll in range(32):
            b = 128 * n + ll
            lv[b] = (x[ql + ll] & 0xF) | (((x[qh + ll] >> 0) & 3) << 4)
            lv[b + 32] = (x[ql + ll + 32] & 0xF) | (((x[qh + ll] >> 2) & 3) << 4)
            lv[b + 64] = (x[ql + ll] >> 4) | (((x[qh + ll] >> 4) & 3) << 4)
            lv[b + 96] = (x[ql + ll + 32] >> 4) | (((x[qh + ll] >> 6) & 3) << 4)
    return lv


def _head_q2_k(y: Block, x: Block, k: int) -> None:
    # block_q2_K: scales[16], qs[64], d, dmin; r4: d[8] (16), scales[64]
    y.copy(2 * k, x, 80, 2)
    y.copy(2 * (k + 4), x, 82, 2)
    for ib in range(16):
        y[16 + 4 * ib + k] = x[ib]


def _levels_q2_k(x: Block) -> list[Bits]:
    lv = [ZERO] * 256
    for n in range(2):
        for j in range(32):
            for s in range(4):
                lv[128 * n + j + 32 * s] = (x[16 + 32 * n + j] >> 2 * s) & 3
    return lv


def _head_q3_k(y: Block, x: Block, k: int) -> None:
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
            or_into(y, 24 + at % 32, (ld[2 * ib + half] & 0xF) << 4 * (at // 32))
            or_into(y, 8 + at % 16, (ld[2 * ib + half] >> 4) << 2 * (at // 16))


def _levels_q3_k(x: Block) -> list[Bits]:
    lv = [ZERO] * 256
    for n in range(2):
        for j in range(4):
            for ll in range(32):
                low = (x[32 + 32 * n + ll] >> 2 * j) & 3
                lv[128 * n + 32 * j + ll] = low | (((x[ll] >> (4 * n + j)) & 1) << 2)
    return lv


def _extra_r4(y: Block, k: int, extra: Bits, ib: int) -> None:
    """IQ*_K: the two ``extra`` bits of sub-block ``ib`` of row ``k`` (r4 ``extra`` at 8)."""
    or_into(y, 8 + k, ((extra >> 2 * ib) & 1) << ib)
    or_into(y, 12 + k, ((extra >> (2 * ib + 1)) & 1) << ib)


def _iq_k_scales(y: Block, k: int, ib: int, sl: Bits, sh: tuple[Bits, Bits] | None) -> None:
    """IQ2_K..IQ5_K: the two 4-bit low scales (and 2-bit high scales) of sub-block ``ib``;
    r4 ``scales_l`` at 32 (IQ2_K: ``scales`` at 16), ``scales_h`` at 16."""
    lo = 32 if sh is not None else 16
    for half in range(2):
        i = 8 * ib + k + 4 * half
        or_into(y, lo + i % 32, ((sl >> 4 * half) & 0xF) << 4 * (i // 32))
        if sh is not None:
            or_into(y, 16 + i % 16, sh[half] << 2 * (i // 16))


def _head_iq2_k(y: Block, x: Block, k: int) -> None:
    # block_iq2_k: d, extra, scales[8]; r4: d[4], extra[8], scales[32]
    _head_d(y, x, k)
    extra = u16(x, 2)
    for ib in range(8):
        _extra_r4(y, k, extra, ib)
        _iq_k_scales(y, k, ib, x[4 + ib], None)


def _levels_iq2_k(x: Block) -> list[Bits]:
    # block_iq2_k: qs[64] at 12
    lv = [ZERO] * 256
    for ib32 in range(8):
        for j in range(32):
            lv[32 * ib32 + j] = (x[12 + 32 * (ib32 // 4) + j] >> 2 * (ib32 % 4)) & 3
    return lv


def _head_iq3_k(y: Block, x: Block, k: int) -> None:
    # block_iq3_k: d, extra, scales_h (u16), scales_l[8]
    # r4: d[4], extra[8], scales_h[8], scales_l[32]
    _head_d(y, x, k)
    extra, sh = u16(x, 2), u16(x, 4)
    for ib in range(8):
        _extra_r4(y, k, extra, ib)
        for half in range(2):
            i = 8 * ib + k + 4 * half
            or_into(y, 24 + i % 32, ((x[6 + ib] >> 4 * half) & 0xF) << 4 * (i // 32))
            or_into(y, 16 + i % 8, ((sh >> (2 * ib + half)) & 1) << (i // 8))


def _levels_iq3_k(x: Block) -> list[Bits]:
    # block_iq3_k: qs[64] at 14, qh[32] at 78
    lv = [ZERO] * 256
    for ib32 in range(8):
        for j in range(32):
            low = (x[14 + 32 * (ib32 // 4) + j] >> 2 * (ib32 % 4)) & 3
            lv[32 * ib32 + j] = low | (((x[78 + j] >> ib32) & 1) << 2)
    return lv


def _iq45_k_scales(y: Block, x: Block, k: int, ib: int) -> None:
    sh = x[4 + ib // 2] >> 4 * (ib % 2)
    _iq_k_scales(y, k, ib, x[8 + ib], (sh & 3, (sh >> 2) & 3))


def _head_iq45_k(y: Block, x: Block, k: int) -> None:
    # block_iq4_k / iq5_k: d, extra, scales_h[4], scales_l[8]
    # r4: d[4], extra[8], scales_h[16], scales_l[32]
    _head_d(y, x, k)
    extra = u16(x, 2)
    for ib in range(8):
        _extra_r4(y, k, extra, ib)
        _iq45_k_scales(y, x, k, ib)


def _iq5_levels(x: Block, qs: int, qh: int) -> list[Bits]:
    """convert_iq5_k: the 5-bit levels of an IQ5_K/IQ5_KS block (``qs``/``qh`` offsets)."""
    lv = [ZERO] * 256
    for ib64 in range(4):
        shift = 2 * ib64
        for j in range(16):
            for h in range(2):
                qs_b, qh_b = x[qs + 32 * ib64 + j + 16 * h], x[qh + j + 16 * h]
                lv[64 * ib64 + j + 16 * h] = (qs_b & 0xF) | (((qh_b >> shift) & 1) << 4)
                lv[64 * ib64 + j + 16 * h + 32] = (qs_b >> 4) | (((qh_b >> shift) & 2) << 3)
    return lv


# r4 big blocks: headers, then the planes at the offsets below.
rp_q2_k_r4 = levels_repack(_head_q2_k, _levels_q2_k, Plane(80, CRUMBS, 2))
rp_q3_k_r4 = levels_repack(
    _head_q3_k, _levels_q3_k, Plane(184, CRUMBS, 2), Plane(56, BIT2, 1, shift=2)
)
rp_q4_k_r4 = levels_repack(_head_q4_k, _levels_q4_k, Plane(64, NIBBLES, 4))
rp_q5_k_r4 = levels_repack(
    _head_q4_k, _levels_q5_k, Plane(192, NIBBLES, 4), Plane(64, BIT4_K, 1, shift=4)
)
rp_q6_k_r4 = levels_repack(
    _head_q6_k,
    _levels_q6_k,
    Plane(328, NIBBLES, 4),
    Plane(72, ((0, 8, 4, 12), (16, 24, 20, 28)), 2, shift=4),
)
rp_iq2_k_r4 = levels_repack(_head_iq2_k, _levels_iq2_k, Plane(48, CRUMBS, 2))
rp_iq3_k_r4 = levels_repack(
    _head_iq3_k, _levels_iq3_k, Plane(56, CRUMBS, 2), Plane(312, BIT2, 1, shift=2)
)
rp_iq4_k_r4 = levels_repack(_head_iq45_k, _nibbles(16, 8), Plane(64, NIBBLES, 4))
rp_iq5_k_r4 = levels_repack(
    _head_iq45_k,
    lambda x: _iq5_levels(x, 16, 144),
    Plane(64, NIBBLES, 4),
    Plane(576, BIT4_IQ, 1, shift=4),
)
rp_iq5_ks_r4 = levels_repack(
    _head_iq4_ks,
    lambda x: _iq5_levels(x, 8, 136),
    Plane(32, NIBBLES, 4),
    Plane(544, BIT4_IQ, 1, shift=4),
)
