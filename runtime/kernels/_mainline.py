"""Torch dequantization kernels of the mainline block types: F32/F16/BF16, the legacy 32-element
blocks, the K-quants and IQ4_NL/IQ4_XS (the grid, ternary and FP4 types are in :mod:`._iq`; both
build on :mod:`._base`).

Bit-exactness with ``gguf.quants``: every scale product there is exact in float32 (an fp16 scale
has 11 significant bits and the integer factors at most 13 together), so the only rounding step is
the final add or subtract of the min term, done exactly once here too. Products by powers of two
are exact as well, which lets the integer stage fold a bias into the sign bit (``16 * (q - 8)`` is
``(q ^ 8) << 4`` read as int8) and the scale absorb the factor (``d / 16``).

Speed: torch's elementwise loops pay a few nanoseconds per contiguous run and do not vectorize
uint8 shifts, so bit operations run as SWAR on int64 words over the whole chunk's bytes (header
bytes included, then ignored); the int8->float32 conversion is one contiguous pass; only the
scaling walks the block structure, writing each output element once.

The module ends in its ``KERNELS`` table, read with every kernel it names.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ggufswap.runtime.kernels._base import (
    Arena,
    Kernel,
    _d,
    _f16,
    _no_scales,
    _rep,
    _to_float,
    _words,
)
from ggufswap.shards.ggml_types import GGMLType as T

# IQ4_NL / IQ4_XS non-linear 4-bit grid (gguf.quants.IQ4_NL.kvalues).
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _rows(f: torch.Tensor, c: int, size: int, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` of the first ``c * size`` elements of ``f`` seen as ``[c, size]``."""
    return f[: c * size].view(c, size)[:, start:stop]


@lru_cache(maxsize=64)
def _bit_lut(device: torch.device, bits: int, scale: int, bias: int, xor: int) -> torch.Tensor:
    """Packed table: byte ``v`` -> uint8 lanes ``(((v >> bits*i) & mask) * scale + bias) ^ xor``.

    Looking a byte up yields all the lanes it encodes in one gather, in element order.
    """
    lanes = 8 // bits
    mask = (1 << bits) - 1
    rows = [
        [((((v >> (bits * i)) & mask) * scale + bias) % 256) ^ xor for i in range(lanes)]
        for v in range(256)
    ]
    table = torch.tensor(rows, dtype=torch.uint8)
    packed = table.view(torch.int64) if lanes == 8 else table.view(torch.int32)
    return packed.reshape(256).to(device)


@lru_cache(maxsize=16)
def _pair_lut(device: torch.device, values: tuple[int, ...]) -> torch.Tensor:
    """int16 table: byte ``v`` -> int8 lanes ``(values[v & 15], values[v >> 4])``."""
    table = torch.tensor([[values[v & 0x0F], values[v >> 4]] for v in range(256)], dtype=torch.int8)
    return table.view(torch.int16).reshape(256).to(device)


# --- plain float types ------------------------------------------------------------------------


def _f32(blocks: torch.Tensor, out: torch.Tensor, arena: Arena) -> None:
    out.view(torch.uint8).copy_(blocks)


def _f16_body(blocks: torch.Tensor, out: torch.Tensor, arena: Arena) -> None:
    out.copy_(blocks.view(torch.float16))


def _bf16(blocks: torch.Tensor, out: torch.Tensor, arena: Arena) -> None:
    # bf16 -> f32 is the bit shift `x << 16` (gguf: int16 -> int32 << 16), NaN payloads included.
    out.copy_(blocks.view(torch.bfloat16))


# --- legacy 32-element blocks -----------------------------------------------------------------


def _d_m(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    return _f16(blocks, 0, arena), _f16(blocks, 2, arena)


def _nibbles(w: torch.Tensor, arena: Arena, *, bias8: bool = False) -> torch.Tensor:
    """``[2, 8 * len(w)]`` bytes: the low and the high nibble of every byte of the words ``w``.

    With ``bias8`` the bytes are ``(nibble ^ 8) << 4``, which read as int8 are
    ``16 * (nibble - 8)``, for the offset-8 types.
    """
    nib = arena.take("nibbles", 2 * w.numel(), torch.int64).view(2, -1)
    if bias8:
        t = torch.bitwise_xor(w, _rep(0x88), out=arena.take("t", w.numel(), torch.int64))
        torch.bitwise_left_shift(t, 4, out=nib[0])
        torch.bitwise_and(t, _rep(0xF0), out=nib[1])
        nib[0].bitwise_and_(_rep(0xF0))
    else:
        torch.bitwise_and(w, _rep(0x0F), out=nib[0])
        torch.bitwise_right_shift(w, 4, out=nib[1])
        nib[1].bitwise_and_(_rep(0x0F))
    return nib.view(torch.uint8)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d16: torch.Tensor) -> None:
    # block: d f16 | qs[16]; x = d * ((q & 15) - 8) = (d / 16) * int8((q ^ 8) << 4)
    c, size = blocks.shape
    nib = _nibbles(_words(blocks.reshape(-1), arena), arena, bias8=True)
    f = _to_float(nib.view(torch.int8), arena)
    o = out.view(c, 2, 16)
    for h in range(2):
        torch.mul(_rows(f[h], c, size, 2, size), d16, out=o[:, h])


def _q4_1(
    blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d: torch.Tensor, m: torch.Tensor
) -> None:
    # block: d f16 | m f16 | qs[16]; x = d * q + m
    c, size = blocks.shape
    f = _to_float(_nibbles(_words(blocks.reshape(-1), arena), arena), arena)
    o = out.view(c, 2, 16)
    for h in range(2):
        torch.mul(_rows(f[h], c, size, 4, size), d, out=o[:, h])
    out.add_(m)


def _spread_bits(
    blocks: torch.Tensor, offset: int, lut: torch.Tensor, arena: Arena
) -> torch.Tensor:
    """The 32-bit mask at byte ``offset`` of each block -> ``[c, 32]`` uint8 from ``lut``.

    Element ``j`` comes from bit ``j`` of the little-endian mask. The masks are gathered as 1-D
    strided columns of the widest lanes their offset allows (a 2-D copy of 4-byte rows pays
    torch's per-row cost once per block), then looked up a byte at a time.
    """
    c, size = blocks.shape
    compact = arena.take("qh", 4 * c, torch.uint8).view(c, 4)
    width = 4 if offset % 4 == 0 and size % 4 == 0 else 2
    dtype = torch.int32 if width == 4 else torch.int16
    lanes, columns = blocks.view(dtype), compact.view(dtype)
    for i in range(4 // width):
        columns[:, i].copy_(lanes[:, offset // width + i])
    idx = arena.take("idx", 4 * c, torch.int32)
    idx.copy_(compact.view(-1))
    bits = arena.take("bits", 4 * c, torch.int64)
    torch.index_select(lut, 0, idx, out=bits)
    return bits.view(torch.uint8).view(c, 32)


def _q5_combine(
    blocks: torch.Tensor, nib: torch.Tensor, qh_offset: int, lut: torch.Tensor, arena: Arena
) -> torch.Tensor:
    """``[c, 32]`` uint8 elements: the nibbles of the qs field (last 16 bytes) OR the hbits."""
    c, size = blocks.shape
    q = _spread_bits(blocks, qh_offset, lut, arena).view(c, 2, 16)
    for h in range(2):
        q[:, h].bitwise_or_(_rows(nib[h], c, size, size - 16, size))
    return q.view(c, 32)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d8: torch.Tensor) -> None:
    # block: d f16 | qh u32 | qs[16]; x = d * ((q | hbit << 4) - 16)
    #      = (d / 8) * int8((q << 3) | (1 - hbit) << 7)
    w = _words(blocks.reshape(-1), arena)
    nib = arena.take("nibbles", 2 * w.numel(), torch.int64).view(2, -1)
    torch.bitwise_left_shift(w, 3, out=nib[0]).bitwise_and_(_rep(0x78))
    torch.bitwise_right_shift(w, 1, out=nib[1]).bitwise_and_(_rep(0x78))
    lut = _bit_lut(blocks.device, 1, 0x80, 0, 0x80)
    q = _q5_combine(blocks, nib.view(torch.uint8), 2, lut, arena)
    out.copy_(q.view(torch.int8))
    out.mul_(d8)


def _q5_1(
    blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d: torch.Tensor, m: torch.Tensor
) -> None:
    # block: d f16 | m f16 | qh u32 | qs[16]; x = d * (q | hbit << 4) + m
    nib = _nibbles(_words(blocks.reshape(-1), arena), arena)
    lut = _bit_lut(blocks.device, 1, 16, 0, 0)
    q = _q5_combine(blocks, nib, 4, lut, arena)
    out.copy_(q)
    out.mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d: torch.Tensor) -> None:
    # block: d f16 | qs int8[32]; x = q * d, converted straight into out, scaled where it lies
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(d)


# --- k-quants (256-element super-blocks) ------------------------------------------------------


def _q2_k_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    scales = blocks[:, :16]
    dl = _f16(blocks, 80, arena) * torch.bitwise_and(scales, 0x0F).to(torch.float32)
    ml = _f16(blocks, 82, arena) * torch.bitwise_right_shift(scales, 4).to(torch.float32)
    return dl.unsqueeze(-1), ml.unsqueeze(-1)


def _crumbs(w: torch.Tensor, arena: Arena) -> torch.Tensor:
    """``[4, 8 * len(w)]`` bytes: bit pairs ``(byte >> 2k) & 3`` of every byte, for k = 0..3."""
    planes = arena.take("crumbs", 4 * w.numel(), torch.int64).view(4, -1)
    planes[0].copy_(w)
    for k in range(1, 4):
        torch.bitwise_right_shift(w, 2 * k, out=planes[k])
    planes.bitwise_and_(_rep(0x03))
    return planes.view(torch.uint8)


def _q2_k(
    blocks: torch.Tensor, out: torch.Tensor, arena: Arena, dl: torch.Tensor, ml: torch.Tensor
) -> None:
    # block: scales[16] | qs[64] | d f16 | dmin f16; x = d*(sc & 15) * q - dmin*(sc >> 4)
    c, size = blocks.shape
    f = _to_float(_crumbs(_words(blocks.reshape(-1), arena), arena), arena)
    o = out.view(c, 2, 4, 2, 16)  # [c, half, k, group-in-k, 16]
    scale = dl.view(c, 2, 4, 2, 1)
    for k in range(4):
        src = _rows(f[k], c, size, 16, 80).view(c, 2, 2, 16)
        torch.mul(src, scale[:, :, k], out=o[:, :, k])
    out.view(c, 16, 16).sub_(ml)


def _q3_k_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    n = blocks.shape[0]
    scales = blocks[:, 96:108]
    low = torch.empty(n, 2, 8, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(scales[:, :8], 0x0F, out=low[:, 0])
    torch.bitwise_right_shift(scales[:, :8], 4, out=low[:, 1])
    high = torch.stack([scales[:, 8:12] >> s for s in (0, 2, 4, 6)], dim=1)  # [n, 4, 4]
    sc = low.view(n, 16) | ((high.view(n, 16) & 0x03) << 4)
    dl = _f16(blocks, 108, arena) * (sc.view(torch.int8) - 32).to(torch.float32)
    return (dl.unsqueeze(-1),)


def _q3_k(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, dl: torch.Tensor) -> None:
    # block: hmask[32] | qs[64] | scales[12] | d f16; x = d*sc * ((q & 3) - 4 * (1 - hbit))
    c, size = blocks.shape
    w = _words(blocks.reshape(-1), arena)
    low = _crumbs(w, arena)
    # bit s of hmask[l], as -4 (clear) or 0 (set): ((~byte >> s) & 1) * 0xFC in each byte
    high = arena.take("hbits", 8 * w.numel(), torch.int64).view(8, -1)
    inv = torch.bitwise_not(w, out=arena.take("t", w.numel(), torch.int64))
    for s in range(8):
        torch.bitwise_right_shift(inv, s, out=high[s])
    high.bitwise_and_(_rep(0x01)).mul_(0xFC)
    hb = high.view(torch.uint8)
    q = arena.take("q", 256 * c, torch.uint8).view(c, 2, 4, 32)
    for k in range(4):
        q[:, :, k].copy_(_rows(low[k], c, size, 32, 96).view(c, 2, 32))
    qs = q.view(c, 8, 32)
    for s in range(8):
        qs[:, s].add_(_rows(hb[s], c, size, 0, 32))
    out.copy_(q.view(c, 256).view(torch.int8))
    out.view(c, 16, 16).mul_(dl)


def _k_scale_min(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    """Q4_K/Q5_K: ``d * sc`` and ``dmin * m`` per 32-element group, as ``[n, 8, 1]``.

    The 12 scale bytes at offset 4 are three little-endian words ``d``, ``m``, ``md`` holding,
    byte-wise, ``sc = d & 63 | (md & 15) | (d >> 2) & 48`` and likewise for the mins.
    """
    n = blocks.shape[0]
    words = blocks.view(torch.int32)  # type_size is a multiple of 4, scales at byte 4
    d, m, md = words[:, 1], words[:, 2], words[:, 3]
    packed = torch.empty(n, 4, dtype=torch.int32, device=blocks.device)
    torch.bitwise_and(d, 0x3F3F3F3F, out=packed[:, 0])
    torch.bitwise_or(md & 0x0F0F0F0F, (d >> 2) & 0x30303030, out=packed[:, 1])
    torch.bitwise_and(m, 0x3F3F3F3F, out=packed[:, 2])
    torch.bitwise_or((md >> 4) & 0x0F0F0F0F, (m >> 2) & 0x30303030, out=packed[:, 3])
    sc_min = arena.take("sc_min", n * 16, torch.float32).view(n, 2, 8)
    sc_min.copy_(packed.view(torch.uint8).view(n, 2, 8))
    dl = arena.take("dl", n * 8, torch.float32).view(n, 8)
    ml = arena.take("ml", n * 8, torch.float32).view(n, 8)
    torch.mul(sc_min[:, 0], _f16(blocks, 0, arena), out=dl)
    torch.mul(sc_min[:, 1], _f16(blocks, 2, arena), out=ml)
    return dl.unsqueeze(-1), ml.unsqueeze(-1)


def _q4_k_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    return _k_scale_min(blocks, arena)


def _q4_k(
    blocks: torch.Tensor, out: torch.Tensor, arena: Arena, dl: torch.Tensor, ml: torch.Tensor
) -> None:
    # block: d f16 | dmin f16 | scales[12] | qs[128]; x = d*sc * q - dmin*m
    c, size = blocks.shape
    nib = _nibbles(_words(blocks.reshape(-1), arena), arena)
    f = arena.take("f", 2 * c * 128, torch.float32).view(2, c, 128)
    for h in range(2):
        f[h].copy_(_rows(nib[h], c, size, 16, size))
    # every op below is 2-D ([rows, 32]), which torch's loops handle far faster than 3-D views
    o = out.view(c * 4, 2, 32)
    scale = dl.view(c * 4, 2)
    for h in range(2):
        torch.mul(f[h].view(c * 4, 32), scale[:, h : h + 1], out=o[:, h])
    out.view(c * 8, 32).sub_(ml.view(c * 8, 1))


def _q5_k(
    blocks: torch.Tensor, out: torch.Tensor, arena: Arena, dl: torch.Tensor, ml: torch.Tensor
) -> None:
    # block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; x = d*sc * (q | hbit << 4) - dmin*m
    c, size = blocks.shape
    w = _words(blocks.reshape(-1), arena)
    nib = _nibbles(w, arena)
    # bit g of qh[l] is bit 4 of element 32*g + l
    hbits = arena.take("hbits", 8 * w.numel(), torch.int64).view(8, -1)
    for g in range(8):
        if g <= 4:
            torch.bitwise_left_shift(w, 4 - g, out=hbits[g])
        else:
            torch.bitwise_right_shift(w, g - 4, out=hbits[g])
    hbits.bitwise_and_(_rep(0x10))
    hb = hbits.view(torch.uint8)
    q = arena.take("q", 256 * c, torch.uint8).view(c, 4, 2, 32)
    for h in range(2):
        q[:, :, h].copy_(_rows(nib[h], c, size, 48, size).view(c, 4, 32))
    q8 = q.view(c, 8, 32)
    for g in range(8):
        q8[:, g].bitwise_or_(_rows(hb[g], c, size, 16, 48))
    out.copy_(q.view(c, 256))
    out.view(c, 8, 32).mul_(dl).sub_(ml)


def _q6_k_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    # scales are exact small integers; d * sc is exact, and so is the /4 for the int8 encoding
    n = blocks.shape[0]
    dl = arena.take("dl", n * 16, torch.float32).view(n, 16)
    dl.copy_(blocks[:, 192:208].view(torch.int8))
    dl.mul_(_f16(blocks, 208, arena).mul_(0.25))
    return (dl.unsqueeze(-1),)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, dl4: torch.Tensor) -> None:
    # block: ql[128] | qh[64] | scales int8[16] | d f16; x = d*sc * ((ql | qh2 << 4) - 32)
    #      = (d*sc / 4) * int8((ql << 2) | ((qh2 ^ 2) << 6))
    c = blocks.shape[0]
    # compact copies of the two fields, so that every later op is a 2-D, word-aligned one
    ql = arena.take("ql", c * 128, torch.uint8).view(c, 128)
    ql.copy_(blocks[:, :128])
    qh = arena.take("qh", c * 64, torch.uint8).view(c, 64)
    qh.copy_(blocks[:, 128:192])
    wl = ql.view(-1).view(torch.int64)  # [c * 16]
    nib = arena.take("nibbles", 2 * wl.numel(), torch.int64).view(2, -1)
    torch.bitwise_left_shift(wl, 2, out=nib[0])
    torch.bitwise_right_shift(wl, 2, out=nib[1])
    nib.bitwise_and_(_rep(0x3C))
    # high bit pairs: planes[p] holds pair p of every qh byte at bits 6-7 (flat 1-D ops)
    t = torch.bitwise_xor(qh.view(-1).view(torch.int64), _rep(0xAA))
    planes = arena.take("planes", 4 * t.numel(), torch.int64).view(4, -1)
    for p in range(3):
        torch.bitwise_left_shift(t, 6 - 2 * p, out=planes[p])
    planes[3].copy_(t)
    planes.bitwise_and_(_rep(0xC0))
    pb = planes.view(torch.uint8).view(4, c * 2, 32)  # [p, block-half, l]
    q = arena.take("q", 256 * c, torch.uint8).view(c * 2, 128)  # [block-half, p*32 + l]
    nb = nib.view(torch.uint8).view(2, c * 2, 64)  # [low/high nibble, block-half, 64]
    for p in range(4):
        low = nb[p // 2][:, 32 * (p % 2) : 32 * (p % 2) + 32]
        torch.bitwise_or(low, pb[p], out=q[:, 32 * p : 32 * p + 32])
    out.copy_(q.view(c, 256).view(torch.int8))
    out.view(c * 16, 16).mul_(dl4.view(c * 16, 1))


# --- non-linear 4-bit -------------------------------------------------------------------------


def _iq4_values(flat: torch.Tensor, arena: Arena) -> torch.Tensor:
    """``[F, 2]`` float32: the grid values of the low and the high nibble of every byte."""
    idx = arena.take("idx", flat.numel(), torch.int32)
    idx.copy_(flat)
    pairs = arena.take("pairs", flat.numel(), torch.int16)
    torch.index_select(_pair_lut(flat.device, IQ4_KVALUES), 0, idx, out=pairs)
    return _to_float(pairs.view(torch.int8).view(-1, 2), arena)


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d: torch.Tensor) -> None:
    # block: d f16 | qs[16]; x = d * kvalues[nibble]
    c, size = blocks.shape
    f = _iq4_values(blocks.reshape(-1), arena).view(c, size, 2)[:, 2:]
    torch.mul(f.transpose(1, 2), d.unsqueeze(-1), out=out.view(c, 2, 16))


def _iq4_xs_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    n = blocks.shape[0]
    low = torch.empty(n, 4, 2, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(blocks[:, 4:8], 0x0F, out=low[:, :, 0])
    torch.bitwise_right_shift(blocks[:, 4:8], 4, out=low[:, :, 1])
    scales_h = blocks[:, 2:4].view(torch.int16).to(torch.int32)  # [n, 1]; only 16 bits used
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=blocks.device)
    high = ((scales_h >> shifts) & 0x03).to(torch.uint8)  # [n, 8]
    sc = (low.view(n, 8) | (high << 4)).view(torch.int8) - 32
    dl = _f16(blocks, 0, arena) * sc.to(torch.float32)  # [n, 8]
    return (dl.unsqueeze(-1),)


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, dl: torch.Tensor) -> None:
    # block: d f16 | scales_h u16 | scales_l[4] | qs[128]; x = d*(sc - 32) * kvalues[nibble]
    c, size = blocks.shape
    f = _iq4_values(blocks.reshape(-1), arena).view(c, size, 2)[:, 8:].reshape(c, 8, 16, 2)
    torch.mul(f.transpose(2, 3), dl.unsqueeze(-1), out=out.view(c, 8, 2, 16))


KERNELS: dict[T, Kernel] = {
    T.F32: Kernel(_no_scales, _f32),
    T.F16: Kernel(_no_scales, _f16_body),
    T.BF16: Kernel(_no_scales, _bf16),
    T.Q4_0: Kernel(_d(0, 16.0), _q4_0),
    T.Q4_1: Kernel(_d_m, _q4_1),
    T.Q5_0: Kernel(_d(0, 8.0), _q5_0),
    T.Q5_1: Kernel(_d_m, _q5_1),
    T.Q8_0: Kernel(_d(0), _q8_0),
    T.Q2_K: Kernel(_q2_k_prepare, _q2_k),
    T.Q3_K: Kernel(_q3_k_prepare, _q3_k),
    T.Q4_K: Kernel(_q4_k_prepare, _q4_k),
    T.Q5_K: Kernel(_q4_k_prepare, _q5_k),
    T.Q6_K: Kernel(_q6_k_prepare, _q6_k),
    T.IQ4_NL: Kernel(_d(0), _iq4_nl),
    T.IQ4_XS: Kernel(_iq4_xs_prepare, _iq4_xs),
}
