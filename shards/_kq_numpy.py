"""ggml's reference K-quant and IQ4 quantizers in numpy, byte-identical to llama.cpp's.

These follow ggml's reference code (``ggml/src/ggml-quants.c``: ``quantize_row_q{2..6}_K_ref``,
``quantize_iq4_nl``, ``quantize_iq4_xs``). Byte identity comes from doing what the C code does in
float32, operation by operation and in its order: sums are accumulated element by element (never
numpy's pairwise sums), ``nearest_int`` is ggml's ``+ 1.5 * 2**23`` trick, and fp16 fields are
rounded to nearest even. ggml's reference code is compiled without fused multiply-adds (its
``-ffp-contract`` default does not apply: the library targets baseline x86-64 SSE), so neither
are these.

Every function is vectorized over blocks: the per-element loops of the C code become loops over
the 16 or 32 positions of a sub-block, each step one numpy operation on all sub-blocks at once.
Arrays inside are laid out ``[position, group]`` so that each step reads a contiguous row.
:func:`ggufswap.shards.kquants.quantize` is the entry point: it runs these where the compiled
quantizers were not built.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
F32 = np.float32
QK_K: Final = 256
_GROUP_MAX_EPS: Final = F32(1e-15)
_ROUND_MAGIC: Final = F32(12582912.0)  # 1.5 * 2**23: nearest_int's rounding constant
_IQ4_VALUES: Final = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=F32
)

Floats = np.ndarray  # float32
Ints = np.ndarray  # int32


def _nearest_int(v: Floats) -> Ints:
    """ggml's ``nearest_int``: round half to even through the float32 mantissa, bit for bit."""
    return (np.asarray(v + _ROUND_MAGIC, dtype=F32).view(np.int32) & 0x7FFFFF) - 0x400000


def _seq_sum(terms: Floats) -> Floats:
    """``float s = 0; for (i...) s += terms[i];`` over axis 0, in that order."""
    acc = F32(0) + terms[0]
    for i in range(1, terms.shape[0]):
        acc += terms[i]
    return acc


def _abs_max(x: Floats) -> tuple[Floats, Floats]:
    """``(amax, max)``: ``if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }`` from 0."""
    amax = np.zeros(x.shape[1:], dtype=F32)
    vmax = np.zeros(x.shape[1:], dtype=F32)
    for i in range(x.shape[0]):
        ax = np.abs(x[i])
        more = ax > amax
        amax = np.where(more, ax, amax)
        vmax = np.where(more, x[i], vmax)
    return amax, vmax


def _running_max(v: Floats) -> Floats:
    """``float m = 0; for (j...) if (v[j] > m) m = v[j];`` over the last axis."""
    m = np.zeros(v.shape[:-1], dtype=F32)
    for j in range(v.shape[-1]):
        m = np.where(v[..., j] > m, v[..., j], m)
    return m


def _fp16(v: Floats) -> np.ndarray:
    """GGML_FP32_TO_FP16 bits (round to nearest even) as uint16."""
    return np.asarray(v, dtype=F32).astype(np.float16).view(np.uint16)


def _fp32(bits: np.ndarray) -> Floats:
    return bits.view(np.float16).astype(F32)


def _u16_bytes(bits: np.ndarray) -> np.ndarray:
    """``[n]`` uint16 -> ``[n, 2]`` little-endian bytes."""
    return bits.astype("<u2").view(np.uint8).reshape(-1, 2)


def _groups(x: Floats, size: int) -> Floats:
    """``[n_blocks, 256]`` -> ``[size, n_blocks * 256 // size]``: one column per sub-block."""
    return np.ascontiguousarray(x.reshape(-1, size).T)


def _ungroup(a: np.ndarray, n_blocks: int) -> np.ndarray:
    """Inverse of ``_groups``: back to ``[n_blocks, 256]`` (or the block length)."""
    return np.ascontiguousarray(a.T).reshape(n_blocks, -1)


def _pack_2bit(codes: Ints, n_blocks: int) -> np.ndarray:
    """``qs[j/4 + l] = c[j+l] | c[j+l+32] << 2 | c[j+l+64] << 4 | c[j+l+96] << 6``, j = 0, 128."""
    r = codes.reshape(n_blocks, 2, 4, 32)
    qs = r[:, :, 0] | (r[:, :, 1] << 2) | (r[:, :, 2] << 4) | (r[:, :, 3] << 6)
    return qs.reshape(n_blocks, 64).astype(np.uint8)


# ---------------------------------------------------------------- ggml's helper functions


def _make_qkx2_quants(
    x: Floats,
    w: Floats,
    *,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
) -> tuple[Ints, Floats, Floats]:
    """ggml's ``make_qkx2_quants`` on ``x: [n, G]``: returns ``(codes, scale, the_min)``."""
    mn = x[0].copy()
    mx = x[0].copy()
    sum_w = w[0].copy()
    sum_x = sum_w * x[0]
    for i in range(1, x.shape[0]):
        mn = np.where(x[i] < mn, x[i], mn)
        mx = np.where(x[i] > mx, x[i], mx)
        sum_w += w[i]
        sum_x += w[i] * x[i]
    mn = np.where(mn > 0, F32(0), mn)
    flat = mx == mn
    flat_min = -mn

    def error(scale: Floats, codes: Floats, mn: Floats) -> Floats:
        diff = scale * codes + mn - x
        return _seq_sum(w * (np.abs(diff) if use_mad else diff * diff))

    iscale = F32(nmax) / (mx - mn)
    scale = F32(1) / iscale
    codes = np.clip(_nearest_int(iscale * (x - mn)), 0, nmax)
    best_error = error(scale, codes.astype(F32), mn)
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (mx - mn)
        laux = np.clip(_nearest_int(iscale * (x - mn)), 0, nmax)
        lf = laux.astype(F32)
        wl = w * lf
        sum_l, sum_l2, sum_xl = _seq_sum(np.stack([wl, wl * lf, wl * x], axis=1))
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        cur_error = error(this_scale, lf, this_min)
        better = (det > 0) & (cur_error < best_error)
        codes = np.where(better, laux, codes)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    codes = np.where(flat, 0, codes)
    return codes, np.where(flat, F32(0), scale), np.where(flat, flat_min, -mn)


def _make_qx_quants(x: Floats, *, nmax: int) -> tuple[Ints, Floats]:
    """ggml's ``make_qx_quants(n, nmax, x, codes, rmse_type=1, qw=NULL)`` on ``x: [n, G]``."""
    amax, vmax = _abs_max(x)
    w = x * x
    wx = w * x

    def attempt(iscale: Floats) -> tuple[Ints, Floats, Floats]:
        lv = np.clip(_nearest_int(iscale * x), -nmax, nmax - 1)
        lf = lv.astype(F32)
        sumlx, suml2 = _seq_sum(np.stack([wx * lf, w * lf * lf], axis=1))
        return lv + nmax, sumlx, suml2

    codes, sumlx, suml2 = attempt(F32(-nmax) / vmax)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        new_codes, sumlx, suml2 = attempt(-(F32(nmax) + F32(0.1) * F32(step)) / vmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        codes = np.where(better, new_codes, codes)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    zero = amax < _GROUP_MAX_EPS
    return np.where(zero, 0, codes), np.where(zero, F32(0), scale)


def _make_q3_quants(x: Floats, *, nmax: int) -> tuple[Ints, Floats]:
    """ggml's ``make_q3_quants(n, nmax, x, codes, do_rmse=true)`` on ``x: [n, G]``."""
    amax, vmax = _abs_max(x)
    codes = np.clip(_nearest_int((F32(-nmax) / vmax) * x), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    lf = codes.astype(F32)
    sumlx, suml2 = _seq_sum(np.stack([wx * lf, w * lf * lf], axis=1))
    for _ in range(5):
        # ggml stops a group after a pass without a change; such a pass changes nothing, so
        # running further passes on it is harmless, and all groups stop when none changed.
        changed = False
        for i in range(x.shape[0]):
            li = codes[i].astype(F32)
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new_l = np.clip(_nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1)
            nf = new_l.astype(F32)
            slx_new = slx + wx[i] * nf
            sl2_new = sl2 + w[i] * nf * nf
            take = (
                (slx > 0)
                & (new_l != codes[i])
                & (sl2_new > 0)
                & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            )
            if take.any():
                changed = True
                codes[i] = np.where(take, new_l, codes[i])
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
        if not changed:
            break
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    zero = amax < _GROUP_MAX_EPS
    return np.where(zero, 0, codes + nmax), np.where(zero, F32(0), scale)


def _iq4_neighbours() -> tuple[np.ndarray, Floats, Floats]:
    """Per ``floor(v) + 128`` for ``v`` in [-128, 115): best_index_int8's bracket ``mu`` (the first
    value above ``v``, clamped to 1..15) and the values ``val[mu - 1]``, ``val[mu]`` around it.

    For integer values, ``val > v`` exactly when ``val > floor(v)``, so ``floor(v)`` decides
    ``mu``; outside the values' range the clamped bracket still picks index 0 or 15.
    """
    floors = np.arange(-128, 115, dtype=F32)
    mu = np.clip(np.searchsorted(_IQ4_VALUES, floors, side="right"), 1, 15).astype(np.int32)
    return mu, _IQ4_VALUES[mu - 1], _IQ4_VALUES[mu]


_IQ4_MU, _IQ4_LOWER, _IQ4_UPPER = _iq4_neighbours()


def _best_index_iq4(v: Floats) -> tuple[Ints, Floats]:
    """ggml's ``best_index_int8(16, kvalues_iq4nl, v)`` (nearest value, ties upward, NaN to 15)
    and the value at that index."""
    k = np.floor(np.clip(v, F32(-128), F32(114)))
    k = np.where(np.isnan(k), F32(114), k).astype(np.intp) + 128
    lower, upper = _IQ4_LOWER.take(k), _IQ4_UPPER.take(k)
    take_lower = (v - lower) < (upper - v)
    return _IQ4_MU.take(k) - take_lower, np.where(take_lower, lower, upper)


def _iq4_block_scales(x: Floats, *, ntry: int) -> Floats:
    """The per-32 scale search of ggml's ``quantize_row_iq4_nl_impl`` (no weights), ``[32, G]``."""
    w = x * x
    amax, vmax = _abs_max(x)

    def sums(iscale: Floats) -> tuple[Floats, Floats]:
        _index, q = _best_index_iq4(iscale * x)
        wq = w * q
        sumqx, sumq2 = _seq_sum(np.stack([wq * x, wq * q], axis=1))
        return sumqx, sumq2

    d = -vmax / _IQ4_VALUES[0] if ntry > 0 else vmax / _IQ4_VALUES[0]
    sumqx, sumq2 = sums(F32(1) / d)
    d = np.where(sumq2 > 0, sumqx / sumq2, F32(0))
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        sumqx, sumq2 = sums(F32(itry + int(_IQ4_VALUES[0])) / vmax)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / sumq2, d)
        best = np.where(better, d * sumqx, best)
    return np.where(amax < _GROUP_MAX_EPS, F32(0), d)


def _pack_iq4(codes: Ints, n_blocks: int) -> np.ndarray:
    """``q4[16*i + j] = codes[32*i + j] | codes[32*i + 16 + j] << 4`` for each 32 values."""
    r = codes.reshape(n_blocks, -1, 2, 16)
    return (r[:, :, 0] | (r[:, :, 1] << 4)).reshape(n_blocks, -1).astype(np.uint8)


# ---------------------------------------------------------------- one function per type


def quantize_q2_k(x: Floats) -> np.ndarray:
    """``quantize_row_q2_K_ref``: ``[nb, 256]`` -> ``[nb, 84]`` blocks."""
    nb = x.shape[0]
    xg = _groups(x, 16)
    codes, scales, mins = _make_qkx2_quants(
        xg, np.abs(xg), nmax=3, rmin=-0.5, rdelta=0.1, nstep=15, use_mad=True
    )
    codes = _ungroup(codes, nb).reshape(nb, 16, 16)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale, max_min = _running_max(scales), _running_max(mins)
    q4scale = F32(15)
    has_scale, has_min = max_scale > 0, max_min > 0
    sc = np.where(has_scale[:, None], _nearest_int((q4scale / max_scale)[:, None] * scales), 0)
    lm = _nearest_int((q4scale / max_min)[:, None] * mins)
    sc = np.where(has_min[:, None], sc | (lm << 4), sc) & 0xFF
    d = np.where(has_scale, _fp16(max_scale / q4scale), 0).astype(np.uint16)
    dmin = np.where(has_min, _fp16(max_min / q4scale), 0).astype(np.uint16)
    dq = _fp32(d)[:, None] * (sc & 0xF).astype(F32)
    dm = _fp32(dmin)[:, None] * (sc >> 4).astype(F32)
    x3 = x.reshape(nb, 16, 16)
    redo = np.clip(_nearest_int((x3 + dm[:, :, None]) / dq[:, :, None]), 0, 3)
    codes = np.where((dq != 0)[:, :, None], redo, codes).reshape(nb, QK_K)
    return np.concatenate(
        [sc.astype(np.uint8), _pack_2bit(codes, nb), _u16_bytes(d), _u16_bytes(dmin)], axis=1
    )


def quantize_q3_k(x: Floats) -> np.ndarray:
    """``quantize_row_q3_K_ref``: ``[nb, 256]`` -> ``[nb, 110]`` blocks."""
    nb = x.shape[0]
    codes, scales = _make_q3_quants(_groups(x, 16), nmax=4)
    codes = _ungroup(codes, nb).reshape(nb, 16, 16)
    scales = scales.reshape(nb, 16)
    _amax, max_scale = _abs_max(scales.T)
    has = max_scale != 0
    iscale = F32(-32) / max_scale
    lq = _nearest_int(iscale[:, None] * scales)
    lq = ((lq + 128) & 0xFF) - 128  # stored into an int8_t first
    lq = np.where(has[:, None], np.clip(lq, -32, 31) + 32, 0)
    low = lq & 0xF
    high = lq >> 4
    packed = np.zeros((nb, 12), dtype=np.int32)
    packed[:, :8] = low[:, :8] | (low[:, 8:] << 4)
    for j in range(16):
        packed[:, 8 + j % 4] |= high[:, j] << (2 * (j // 4))
    d = np.where(has, _fp16(F32(1) / iscale), 0).astype(np.uint16)
    dq = _fp32(d)[:, None] * (lq - 32).astype(F32)
    redo = np.clip(_nearest_int(x.reshape(nb, 16, 16) / dq[:, :, None]), -4, 3) + 4
    codes = np.where((dq != 0)[:, :, None], redo, codes).reshape(nb, 8, 32)
    high_bit = codes > 3
    hmask = np.zeros((nb, 32), dtype=np.int32)
    for b in range(8):
        hmask |= high_bit[:, b].astype(np.int32) << b
    codes = np.where(high_bit, codes - 4, codes).reshape(nb, QK_K)
    return np.concatenate(
        [hmask.astype(np.uint8), _pack_2bit(codes, nb), packed.astype(np.uint8), _u16_bytes(d)],
        axis=1,
    )


def _k4_weights(xg: Floats) -> Floats:
    """Q4_K/Q5_K weights: ``sqrtf(sum(x*x)/32) + fabsf(x)`` per 32 values, ``xg: [32, G]``."""
    av_x = np.sqrt(_seq_sum(xg * xg) / F32(32))
    return av_x + np.abs(xg)


def _quantize_q45_k(x: Floats, *, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """The part Q4_K and Q5_K share: ``(d, dmin, scales[12], codes)`` of ``[nb, 256]`` values."""
    nb = x.shape[0]
    xg = _groups(x, 32)
    codes, scales, mins = _make_qkx2_quants(
        xg, _k4_weights(xg), nmax=nmax, rmin=rmin, rdelta=0.1, nstep=nstep, use_mad=False
    )
    codes = _ungroup(codes, nb).reshape(nb, 8, 32)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = _running_max(scales), _running_max(mins)
    inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
    inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(63, _nearest_int(inv_scale[:, None] * scales) & 0xFF)
    lm = np.minimum(63, _nearest_int(inv_min[:, None] * mins) & 0xFF)
    packed = np.concatenate(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    ).astype(np.uint8)
    d = _fp16(max_scale / F32(63))
    dmin = _fp16(max_min / F32(63))
    dq = _fp32(d)[:, None] * ls.astype(F32)
    dm = _fp32(dmin)[:, None] * lm.astype(F32)
    redo = np.clip(_nearest_int((x.reshape(nb, 8, 32) + dm[:, :, None]) / dq[:, :, None]), 0, nmax)
    codes = np.where((dq != 0)[:, :, None], redo, codes)
    return d, dmin, packed, codes


def quantize_q4_k(x: Floats) -> np.ndarray:
    """``quantize_row_q4_K_ref``: ``[nb, 256]`` -> ``[nb, 144]`` blocks."""
    nb = x.shape[0]
    d, dmin, packed, codes = _quantize_q45_k(x, nmax=15, rmin=-1.0, nstep=20)
    r = codes.reshape(nb, 4, 2, 32)
    qs = (r[:, :, 0] | (r[:, :, 1] << 4)).reshape(nb, 128).astype(np.uint8)
    return np.concatenate([_u16_bytes(d), _u16_bytes(dmin), packed, qs], axis=1)


def quantize_q5_k(x: Floats) -> np.ndarray:
    """``quantize_row_q5_K_ref``: ``[nb, 256]`` -> ``[nb, 176]`` blocks."""
    nb = x.shape[0]
    d, dmin, packed, codes = _quantize_q45_k(x, nmax=31, rmin=-0.5, nstep=15)
    r = codes.reshape(nb, 4, 2, 32)  # pairs (n + j, n + j + 32) for n = 0, 64, 128, 192
    qh = np.zeros((nb, 32), dtype=np.int32)
    for k in range(4):
        qh |= (r[:, k, 0] >> 4) << (2 * k)
        qh |= (r[:, k, 1] >> 4) << (2 * k + 1)
    qs = ((r[:, :, 0] & 0xF) | ((r[:, :, 1] & 0xF) << 4)).reshape(nb, 128).astype(np.uint8)
    return np.concatenate(
        [_u16_bytes(d), _u16_bytes(dmin), packed, qh.astype(np.uint8), qs], axis=1
    )


def quantize_q6_k(x: Floats) -> np.ndarray:
    """``quantize_row_q6_K_ref``: ``[nb, 256]`` -> ``[nb, 210]`` blocks."""
    nb = x.shape[0]
    codes, scales = _make_qx_quants(_groups(x, 16), nmax=32)
    codes = _ungroup(codes, nb).reshape(nb, 16, 16)
    scales = scales.reshape(nb, 16)
    max_abs, max_scale = _abs_max(scales.T)
    zero = max_abs < _GROUP_MAX_EPS
    iscale = F32(-128) / max_scale
    d = _fp16(F32(1) / iscale)
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales))
    sc = ((sc + 128) & 0xFF) - 128  # int8_t
    dq = _fp32(d)[:, None] * sc.astype(F32)
    redo = np.clip(_nearest_int(x.reshape(nb, 16, 16) / dq[:, :, None]), -32, 31) + 32
    codes = np.where((dq != 0)[:, :, None], redo, codes).reshape(nb, 2, 4, 32)
    ql = np.concatenate(
        [
            (codes[:, :, 0] & 0xF) | ((codes[:, :, 2] & 0xF) << 4),
            (codes[:, :, 1] & 0xF) | ((codes[:, :, 3] & 0xF) << 4),
        ],
        axis=2,
    ).reshape(nb, 128)
    qh = (
        (codes[:, :, 0] >> 4)
        | ((codes[:, :, 1] >> 4) << 2)
        | ((codes[:, :, 2] >> 4) << 4)
        | ((codes[:, :, 3] >> 4) << 6)
    )
    blocks = np.concatenate(
        [
            ql.astype(np.uint8),
            qh.reshape(nb, 64).astype(np.uint8),
            sc.astype(np.uint8),
            _u16_bytes(d),
        ],
        axis=1,
    )
    blocks[zero] = 0
    return blocks


def quantize_iq4_nl(x: Floats) -> np.ndarray:
    """``quantize_iq4_nl`` (ntry 7, no weights): ``[nb, 32]`` -> ``[nb, 18]`` blocks."""
    nb = x.shape[0]
    xg = _groups(x, 32)
    scale = _iq4_block_scales(xg, ntry=7)
    inv = np.where(scale != 0, F32(1) / scale, F32(0))
    codes = _ungroup(_best_index_iq4(inv * xg)[0], nb)
    return np.concatenate([_u16_bytes(_fp16(scale)), _pack_iq4(codes, nb)], axis=1)


def quantize_iq4_xs(x: Floats) -> np.ndarray:
    """``quantize_iq4_xs`` (ntry 7, no weights): ``[nb, 256]`` -> ``[nb, 136]`` blocks."""
    nb = x.shape[0]
    scales = _iq4_block_scales(_groups(x, 32), ntry=7).reshape(nb, 8)
    _amax, max_scale = _abs_max(scales.T)
    d = -max_scale / F32(32)
    inv = np.where(d != 0, F32(1) / d, F32(0))
    ls = np.clip(_nearest_int(inv[:, None] * scales), -32, 31)
    dl = d[:, None] * ls.astype(F32)
    idl = np.where(dl != 0, F32(1) / dl, F32(0))
    codes = _best_index_iq4(idl[:, :, None] * x.reshape(nb, 8, 32))[0]
    ls += 32
    scales_l = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    scales_h = np.zeros(nb, dtype=np.int32)
    for ib in range(8):
        scales_h |= (ls[:, ib] >> 4) << (2 * ib)
    return np.concatenate(
        [
            _u16_bytes(_fp16(d)),
            _u16_bytes(scales_h.astype(np.uint16)),
            scales_l,
            _pack_iq4(codes, nb),
        ],
        axis=1,
    )
