"""Torch dequantization kernels, one per GGML block type.

A kernel has two halves. ``prepare(blocks)`` computes the per-block float32 scales of the whole
tensor (``blocks`` is ``[n, type_size]`` uint8, one GGUF block per row). ``body(blocks, out,
*scales)`` then dequantizes one chunk of blocks into ``out`` (``[c, block_size]`` float32,
contiguous), given the matching rows of the scales; the driver keeps chunks small enough to stay
in the last-level cache between passes.

Bit-exactness with ``gguf.quants``: every scale product there is exact in float32 (an fp16 scale
has 11 significant bits and the integer factors at most 13 together), so the only rounding step is
the final add or subtract of the min term, done exactly once here too. Products by powers of two
are exact as well, which lets the integer stage fold a bias into the sign bit (``16 * (q - 8)`` is
``(q ^ 8) << 4`` read as int8) and the scale absorb the factor (``d / 16``).

Speed: torch's elementwise loops pay a few nanoseconds per contiguous run, so bit operations run
over the whole chunk's bytes at once (header bytes included, then ignored), and only the
int8->float32 conversion and the scaling walk the block structure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
from gguf import GGMLQuantizationType as T

Prepare = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
Body = Callable[..., None]

# IQ4_NL / IQ4_XS non-linear 4-bit grid (gguf.quants.IQ4_NL.kvalues).
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True, slots=True)
class Kernel:
    """Per-tensor scale preparation plus the per-chunk dequantization body."""

    prepare: Prepare
    body: Body


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, offset : offset + 2].view(torch.float16).to(torch.float32)


def _no_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return ()


def _byte_rows(flat: torch.Tensor, type_size: int, start: int, stop: int) -> torch.Tensor:
    """Bytes ``start:stop`` of every block of the flat chunk ``flat``: ``[c, stop - start]``."""
    return flat.view(-1, type_size)[:, start:stop]


@lru_cache(maxsize=64)
def _bit_lut(device: torch.device, bits: int, scale: int, bias: int, xor: int) -> torch.Tensor:
    """Packed table: byte ``v`` -> int8 lanes ``(((v >> bits*i) & mask) * scale + bias) ^ xor``.

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


def _lookup(lut: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gather ``lut[idx]`` and view the packed lanes as uint8: ``[*idx.shape, lanes]``."""
    flat = torch.index_select(lut, 0, idx.to(torch.int32).reshape(-1))
    return flat.view(torch.uint8).view(*idx.shape, -1)


@lru_cache(maxsize=16)
def _pair_lut(device: torch.device, values: tuple[int, ...]) -> torch.Tensor:
    """int16 table: byte ``v`` -> int8 lanes ``(values[v & 15], values[v >> 4])``."""
    table = torch.tensor([[values[v & 0x0F], values[v >> 4]] for v in range(256)], dtype=torch.int8)
    return table.view(torch.int16).reshape(256).to(device)


# --- plain float types ------------------------------------------------------------------------


def _f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.view(torch.uint8).copy_(blocks)


def _f16_body(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float16))


def _bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # bf16 -> f32 is the bit shift `x << 16` (gguf: int16 -> int32 << 16), NaN payloads included.
    out.copy_(blocks.view(torch.bfloat16))


# --- legacy 32-element blocks -----------------------------------------------------------------


def _d(offset: int, divisor: float = 1.0) -> Prepare:
    """Prepare the single fp16 scale at ``offset``, divided by a power of two (exact)."""

    def prepare(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = _f16(blocks, offset)
        return (d if divisor == 1.0 else d.mul_(1.0 / divisor),)

    return prepare


def _d_m(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _f16(blocks, 0), _f16(blocks, 2)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor, d16: torch.Tensor) -> None:
    # block: d f16 | qs[16]; x = d * ((q & 15) - 8) = (d / 16) * int8((q ^ 8) << 4)
    c = blocks.shape[0]
    t = torch.bitwise_xor(blocks.reshape(-1), 0x88)
    high = torch.bitwise_and(t, 0xF0).view(torch.int8)
    low = t.bitwise_left_shift_(4).view(torch.int8)
    o = out.view(c, 2, 16)
    o[:, 0].copy_(_byte_rows(low, 18, 2, 18))
    o[:, 1].copy_(_byte_rows(high, 18, 2, 18))
    out.mul_(d16)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    # block: d f16 | m f16 | qs[16]; x = d * q + m
    c = blocks.shape[0]
    flat = blocks.reshape(-1)
    o = out.view(c, 2, 16)
    o[:, 0].copy_(_byte_rows(torch.bitwise_and(flat, 0x0F), 20, 4, 20))
    o[:, 1].copy_(_byte_rows(torch.bitwise_right_shift(flat, 4), 20, 4, 20))
    out.mul_(d).add_(m)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor, d8: torch.Tensor) -> None:
    # block: d f16 | qh u32 | qs[16]; x = d * ((q | hbit << 4) - 16)
    #      = (d / 8) * int8((q << 3) | (1 - hbit) << 7)
    c = blocks.shape[0]
    flat = blocks.reshape(-1)
    low = torch.bitwise_and(flat, 0x0F).bitwise_left_shift_(3)
    high = torch.bitwise_right_shift(flat, 1).bitwise_and_(0x78)
    sign = _lookup(_bit_lut(blocks.device, 1, 0x80, 0, 0x80), blocks[:, 2:6]).view(c, 2, 16)
    q = torch.empty(c, 2, 16, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_or(_byte_rows(low, 22, 6, 22), sign[:, 0], out=q[:, 0])
    torch.bitwise_or(_byte_rows(high, 22, 6, 22), sign[:, 1], out=q[:, 1])
    out.view(-1).copy_(q.view(-1).view(torch.int8))
    out.mul_(d8)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    # block: d f16 | m f16 | qh u32 | qs[16]; x = d * (q | hbit << 4) + m
    c = blocks.shape[0]
    flat = blocks.reshape(-1)
    low = torch.bitwise_and(flat, 0x0F)
    high = torch.bitwise_right_shift(flat, 4)
    hbit = _lookup(_bit_lut(blocks.device, 1, 16, 0, 0), blocks[:, 4:8]).view(c, 2, 16)
    q = torch.empty(c, 2, 16, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_or(_byte_rows(low, 24, 8, 24), hbit[:, 0], out=q[:, 0])
    torch.bitwise_or(_byte_rows(high, 24, 8, 24), hbit[:, 1], out=q[:, 1])
    out.view(-1).copy_(q.view(-1))
    out.mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor, d: torch.Tensor) -> None:
    # block: d f16 | qs int8[32]; x = q * d
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(d)


# --- k-quants (256-element super-blocks) ------------------------------------------------------


def _q2_k_prepare(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scales = blocks[:, :16]
    dl = _f16(blocks, 80) * torch.bitwise_and(scales, 0x0F).to(torch.float32)
    ml = _f16(blocks, 82) * torch.bitwise_right_shift(scales, 4).to(torch.float32)
    return dl.unsqueeze(-1), ml.unsqueeze(-1)


def _q2_k(blocks: torch.Tensor, out: torch.Tensor, dl: torch.Tensor, ml: torch.Tensor) -> None:
    # block: scales[16] | qs[64] | d f16 | dmin f16; x = d*(sc & 15) * q - dmin*(sc >> 4)
    c = blocks.shape[0]
    flat = blocks.reshape(-1)
    o = out.view(c, 2, 4, 32)
    for k in range(4):
        part = torch.bitwise_right_shift(flat, 2 * k) if k else flat
        part = torch.bitwise_and(part, 0x03)
        o[:, :, k].copy_(_byte_rows(part, 84, 16, 80).view(c, 2, 32))
    o16 = out.view(c, 16, 16)
    o16.mul_(dl).sub_(ml)


def _q3_k_prepare(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n = blocks.shape[0]
    scales = blocks[:, 96:108]
    low = torch.empty(n, 2, 8, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(scales[:, :8], 0x0F, out=low[:, 0])
    torch.bitwise_right_shift(scales[:, :8], 4, out=low[:, 1])
    high = torch.stack([scales[:, 8:12] >> s for s in (0, 2, 4, 6)], dim=1)  # [n, 4, 4]
    sc = low.view(n, 16) | ((high.view(n, 16) & 0x03) << 4)
    dl = _f16(blocks, 108) * (sc.view(torch.int8) - 32).to(torch.float32)
    return (dl.unsqueeze(-1),)


def _q3_k(blocks: torch.Tensor, out: torch.Tensor, dl: torch.Tensor) -> None:
    # block: hmask[32] | qs[64] | scales[12] | d f16; x = d*sc * ((q & 3) - 4 * (1 - hbit))
    c = blocks.shape[0]
    flat = blocks.reshape(-1)
    q = torch.empty(c, 8, 32, dtype=torch.uint8, device=blocks.device)
    qv = q.view(c, 2, 4, 32)
    for k in range(4):
        part = torch.bitwise_right_shift(flat, 2 * k) if k else flat
        part = torch.bitwise_and(part, 0x03)
        qv[:, :, k].copy_(_byte_rows(part, 110, 32, 96).view(c, 2, 32))
    for s in range(8):
        # -4 where the mask bit is clear, 0 where set (uint8 wrap-around, read back as int8)
        bit = torch.bitwise_right_shift(flat, s) if s else flat
        bit = torch.bitwise_and(bit, 0x01).sub_(1).bitwise_and_(0xFC)
        q[:, s].add_(_byte_rows(bit, 110, 0, 32))
    out.view(-1).copy_(q.view(-1).view(torch.int8))
    out.view(c, 16, 16).mul_(dl)


def _k_scale_min(blocks: torch.Tensor, d_off: int, dmin_off: int) -> tuple[torch.Tensor, ...]:
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
    sc_min = packed.view(torch.uint8).view(n, 2, 8).to(torch.float32)
    dl = sc_min[:, 0].mul_(_f16(blocks, d_off))
    ml = sc_min[:, 1].mul_(_f16(blocks, dmin_off))
    return dl.unsqueeze(-1), ml.unsqueeze(-1)


def _q4_k_prepare(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _k_scale_min(blocks, 0, 2)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor, dl: torch.Tensor, ml: torch.Tensor) -> None:
    # block: d f16 | dmin f16 | scales[12] | qs[128]; x = d*sc * q - dmin*m
    c = blocks.shape[0]
    flat = blocks.reshape(-1)
    o = out.view(c, 4, 2, 32)
    o[:, :, 0].copy_(_byte_rows(torch.bitwise_and(flat, 0x0F), 144, 16, 144).view(c, 4, 32))
    o[:, :, 1].copy_(_byte_rows(torch.bitwise_right_shift(flat, 4), 144, 16, 144).view(c, 4, 32))
    o8 = out.view(c, 8, 32)
    o8.mul_(dl).sub_(ml)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor, dl: torch.Tensor, ml: torch.Tensor) -> None:
    # block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; x = d*sc * (q | hbit << 4) - dmin*m
    c = blocks.shape[0]
    flat = blocks.reshape(-1)
    q = torch.empty(c, 8, 32, dtype=torch.uint8, device=blocks.device)
    qv = q.view(c, 4, 2, 32)
    flat_tmp = torch.bitwise_and(flat, 0x0F)
    qv[:, :, 0].copy_(_byte_rows(flat_tmp, 176, 48, 176).view(c, 4, 32))
    torch.bitwise_right_shift(flat, 4, out=flat_tmp)
    qv[:, :, 1].copy_(_byte_rows(flat_tmp, 176, 48, 176).view(c, 4, 32))
    for g in range(8):
        # bit g of qh[l] is bit 4 of element 32*g + l
        if g <= 4:
            torch.bitwise_left_shift(flat, 4 - g, out=flat_tmp)
        else:
            torch.bitwise_right_shift(flat, g - 4, out=flat_tmp)
        flat_tmp.bitwise_and_(0x10)
        q[:, g].bitwise_or_(_byte_rows(flat_tmp, 176, 16, 48))
    out.view(-1).copy_(q.view(-1))
    o8 = out.view(c, 8, 32)
    o8.mul_(dl).sub_(ml)


def _q6_k_prepare(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales are exact small integers; d * sc is exact, and so is the /4 for the int8 encoding
    sc = blocks[:, 192:208].view(torch.int8).to(torch.float32)
    dl = sc.mul_(_f16(blocks, 208).mul_(0.25))
    return (dl.unsqueeze(-1),)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor, dl4: torch.Tensor) -> None:
    # block: ql[128] | qh[64] | scales int8[16] | d f16; x = d*sc * ((ql | qh2 << 4) - 32)
    #      = (d*sc / 4) * int8((ql << 2) | ((qh2 ^ 2) << 6))
    c = blocks.shape[0]
    flat = blocks.reshape(-1)
    low = torch.bitwise_left_shift(flat, 2).bitwise_and_(0x3C)
    high = torch.bitwise_right_shift(flat, 2).bitwise_and_(0x3C)
    t = torch.bitwise_xor(flat, 0xAA)
    planes = torch.empty(4, flat.numel(), dtype=torch.uint8, device=flat.device)
    torch.bitwise_left_shift(t, 6, out=planes[0])
    torch.bitwise_left_shift(t, 4, out=planes[1])
    torch.bitwise_left_shift(t, 2, out=planes[2])
    planes[3].copy_(t)
    planes[1:].bitwise_and_(0xC0)
    # planes[p] byte (h*32 + l) of the qh field -> [c, h, p, l]
    hi2 = planes.view(4, c, 210)[:, :, 128:192].view(4, c, 2, 32).permute(1, 2, 0, 3)
    q = torch.empty(c, 2, 4, 32, dtype=torch.uint8, device=blocks.device)
    low_rows = _byte_rows(low, 210, 0, 128).view(c, 2, 2, 32)
    high_rows = _byte_rows(high, 210, 0, 128).view(c, 2, 2, 32)
    torch.bitwise_or(low_rows, hi2[:, :, :2], out=q[:, :, :2])
    torch.bitwise_or(high_rows, hi2[:, :, 2:], out=q[:, :, 2:])
    out.view(-1).copy_(q.view(-1).view(torch.int8))
    out.view(c, 16, 16).mul_(dl4)


# --- non-linear 4-bit -------------------------------------------------------------------------


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor, d: torch.Tensor) -> None:
    # block: d f16 | qs[16]; x = d * kvalues[nibble]
    c = blocks.shape[0]
    pairs = _lookup(_pair_lut(blocks.device, IQ4_KVALUES), blocks[:, 2:]).view(torch.int8)
    out.view(c, 2, 16).copy_(pairs.transpose(1, 2))
    out.mul_(d)


def _iq4_xs_prepare(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n = blocks.shape[0]
    low = torch.empty(n, 4, 2, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(blocks[:, 4:8], 0x0F, out=low[:, :, 0])
    torch.bitwise_right_shift(blocks[:, 4:8], 4, out=low[:, :, 1])
    scales_h = blocks[:, 2:4].view(torch.int16).to(torch.int32)  # [n, 1]; only 16 bits used
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=blocks.device)
    high = ((scales_h >> shifts) & 0x03).to(torch.uint8)  # [n, 8]
    sc = (low.view(n, 8) | (high << 4)).view(torch.int8) - 32
    dl = _f16(blocks, 0) * sc.to(torch.float32)  # [n, 8]
    return (dl.unsqueeze(-1),)


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor, dl: torch.Tensor) -> None:
    # block: d f16 | scales_h u16 | scales_l[4] | qs[128]; x = d*(sc - 32) * kvalues[nibble]
    c = blocks.shape[0]
    pairs = _lookup(_pair_lut(blocks.device, IQ4_KVALUES), blocks[:, 8:]).view(torch.int8)
    o = out.view(c, 8, 32)
    o.view(c, 8, 2, 16).copy_(pairs.view(c, 8, 16, 2).transpose(2, 3))
    o.mul_(dl)


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
