"""Torch dequantization kernels, one per GGML block type.

Each kernel takes ``blocks`` (``[n, type_size]`` uint8, one GGUF block per row) and writes the
dequantized values into ``out`` (``[n, block_size]`` float32, contiguous). The float32 arithmetic
mirrors ``gguf.quants`` bit for bit: every scale product there is exact (an fp16 scale has 11
significant bits, the integer factors at most 13 together), so the only rounding step is the final
add or subtract of the min term, which is performed exactly once here as well. Integer work is done
on uint8/int8 views with lookup tables; the conversion to float32 and the scaling are the only
passes over the full-size output.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
from gguf import GGMLQuantizationType as T

Kernel = Callable[[torch.Tensor, torch.Tensor], None]

QK_K = 256
# IQ4_NL / IQ4_XS non-linear 4-bit grid (gguf.quants.IQ4_NL.kvalues).
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, offset : offset + 2].view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, q: torch.Tensor) -> None:
    """Split bytes ``qs [..., L]`` into low nibbles ``q[..., 0, :]`` and high ``q[..., 1, :]``."""
    torch.bitwise_and(qs, 0x0F, out=q[..., 0, :])
    torch.bitwise_right_shift(qs, 4, out=q[..., 1, :])


@lru_cache(maxsize=64)
def _bit_lut(device: torch.device, bits: int, scale: int, bias: int) -> torch.Tensor:
    """Packed table: byte ``v`` -> int8 lanes ``((v >> bits*i) & mask) * scale + bias``.

    Looking a byte up yields all the lanes it encodes in one gather, already in element order.
    """
    lanes = 8 // bits
    mask = (1 << bits) - 1
    rows = [
        [(((v >> (bits * i)) & mask) * scale + bias + 128) % 256 - 128 for i in range(lanes)]
        for v in range(256)
    ]
    table = torch.tensor(rows, dtype=torch.int8)
    packed = table.view(torch.int64) if lanes == 8 else table.view(torch.int32)
    return packed.reshape(256).to(device)


def _lookup(lut: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gather ``lut[idx]`` and view the packed lanes as int8: ``[*idx.shape, lanes]``."""
    flat = torch.index_select(lut, 0, idx.reshape(-1).to(torch.int32))
    return flat.view(torch.int8).view(*idx.shape, -1)


@lru_cache(maxsize=16)
def _pair_lut(device: torch.device, values: tuple[int, ...]) -> torch.Tensor:
    """int16 table: byte ``v`` -> int8 lanes ``(values[v & 15], values[v >> 4])``."""
    table = torch.tensor([[values[v & 0x0F], values[v >> 4]] for v in range(256)], dtype=torch.int8)
    return table.view(torch.int16).reshape(256).to(device)


# --- plain float types ------------------------------------------------------------------------


def f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.view(torch.uint8).copy_(blocks)


def f16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float16))


def bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # bf16 -> f32 is the bit shift `x << 16` (gguf: int16 -> int32 << 16), NaN payloads included.
    out.copy_(blocks.view(torch.bfloat16))


# --- legacy 32-element blocks -----------------------------------------------------------------


def q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | qs[16]; x = d * ((q & 15) - 8)
    n = blocks.shape[0]
    q = torch.empty(n, 2, 16, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 2:], q)
    q.sub_(8)  # wraps in uint8; the int8 view holds q - 8
    out.copy_(q.view(n, 32).view(torch.int8))
    out.mul_(_f16(blocks, 0))


def q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | m f16 | qs[16]; x = d * q + m
    n = blocks.shape[0]
    q = torch.empty(n, 2, 16, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 4:], q)
    out.copy_(q.view(n, 32))
    torch.addcmul(_f16(blocks, 2), out, _f16(blocks, 0), out=out)


def q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | qh u32 | qs[16]; x = d * ((q | hbit << 4) - 16)
    n = blocks.shape[0]
    q = torch.empty(n, 2, 16, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 6:], q)
    high = _lookup(_bit_lut(blocks.device, 1, 16, -16), blocks[:, 2:6])  # [n, 4, 8]
    q.view(n, 32).add_(high.view(n, 32).view(torch.uint8))
    out.copy_(q.view(n, 32).view(torch.int8))
    out.mul_(_f16(blocks, 0))


def q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | m f16 | qh u32 | qs[16]; x = d * (q | hbit << 4) + m
    n = blocks.shape[0]
    q = torch.empty(n, 2, 16, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 8:], q)
    high = _lookup(_bit_lut(blocks.device, 1, 16, 0), blocks[:, 4:8])  # [n, 4, 8]
    q.view(n, 32).bitwise_or_(high.view(n, 32).view(torch.uint8))
    out.copy_(q.view(n, 32))
    torch.addcmul(_f16(blocks, 2), out, _f16(blocks, 0), out=out)


def q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | qs int8[32]; x = q * d
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(_f16(blocks, 0))


# --- k-quants (256-element super-blocks) ------------------------------------------------------


def q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: scales[16] | qs[64] | d f16 | dmin f16; x = d*(sc&15) * q - dmin*(sc>>4)
    n = blocks.shape[0]
    scales = blocks[:, :16]
    dl = _f16(blocks, 80) * torch.bitwise_and(scales, 0x0F).to(torch.float32)
    ml = _f16(blocks, 82) * torch.bitwise_right_shift(scales, 4).to(torch.float32)
    q = _lookup(_bit_lut(blocks.device, 2, 1, 0), blocks[:, 16:80].view(n, 2, 32))  # [n,2,32,4]
    out.view(n, 2, 4, 32).copy_(q.transpose(2, 3))
    o = out.view(n, 16, 16)
    torch.addcmul(ml.neg_().unsqueeze(-1), o, dl.unsqueeze(-1), out=o)


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """Unpack Q3_K's 16 6-bit signed scales (``[n, 12]`` bytes) to float32 ``[n, 16]``."""
    n = scales.shape[0]
    low = torch.empty(n, 2, 8, dtype=torch.uint8, device=scales.device)
    _nibbles(scales[:, :8], low)
    high = torch.stack([scales[:, 8:12] >> s for s in (0, 2, 4, 6)], dim=1)  # [n, 4, 4]
    sc = low.view(n, 16) | ((high.view(n, 16) & 0x03) << 4)
    return (sc.view(torch.int8) - 32).to(torch.float32)


def q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: hmask[32] | qs[64] | scales[12] | d f16; x = d*sc * ((q & 3) - 4*(1 - hbit))
    n = blocks.shape[0]
    dl = _f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])  # [n, 16]
    low = _lookup(_bit_lut(blocks.device, 2, 1, 0), blocks[:, 32:96].view(n, 2, 32))
    high = _lookup(_bit_lut(blocks.device, 1, 4, -4), blocks[:, :32])  # [n, 32, 8]
    q = torch.empty(n, 8, 32, dtype=torch.int8, device=blocks.device)
    q.view(n, 2, 4, 32).copy_(low.transpose(2, 3))
    q.add_(high.transpose(1, 2))
    o = out.view(n, 16, 16)
    o.copy_(q.view(n, 16, 16))
    o.mul_(dl.unsqueeze(-1))


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 8 6-bit scales and mins of Q4_K/Q5_K (``[n, 12]`` bytes), as float32."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _k_scale_apply(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """``out[n, 8, 32] = d*sc * q - dmin*m`` for Q4_K/Q5_K, ``out`` holding q on entry."""
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = _f16(blocks, 0) * sc
    neg_ml = (_f16(blocks, 2) * mn).neg_()
    o = out.view(n, 8, 32)
    torch.addcmul(neg_ml.unsqueeze(-1), o, dl.unsqueeze(-1), out=o)


def q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | dmin f16 | scales[12] | qs[128]
    n = blocks.shape[0]
    q = torch.empty(n, 4, 2, 32, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 16:].view(n, 4, 32), q)
    out.copy_(q.view(n, 256))
    _k_scale_apply(blocks, out)


def q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    n = blocks.shape[0]
    q = torch.empty(n, 4, 2, 32, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 48:].view(n, 4, 32), q)
    high = _lookup(_bit_lut(blocks.device, 1, 16, 0), blocks[:, 16:48])  # [n, 32, 8]
    q.view(n, 8, 32).bitwise_or_(high.view(torch.uint8).transpose(1, 2))
    out.copy_(q.view(n, 256))
    _k_scale_apply(blocks, out)


def q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: ql[128] | qh[64] | scales int8[16] | d f16; x = d*sc * ((ql | qh << 4) - 32)
    n = blocks.shape[0]
    q = torch.empty(n, 2, 2, 64, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, :128].view(n, 2, 64), q)
    high = _lookup(_bit_lut(blocks.device, 2, 16, -32), blocks[:, 128:192].view(n, 2, 32))
    q.view(n, 2, 4, 32).add_(high.view(torch.uint8).transpose(2, 3))
    o = out.view(n, 16, 16)
    o.copy_(q.view(n, 16, 16).view(torch.int8))
    dl = _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).to(torch.float32)
    o.mul_(dl.unsqueeze(-1))


# --- non-linear 4-bit -------------------------------------------------------------------------


def iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | qs[16]; x = d * kvalues[nibble]
    n = blocks.shape[0]
    pairs = _lookup(_pair_lut(blocks.device, IQ4_KVALUES), blocks[:, 2:])  # [n, 16, 2]
    out.view(n, 2, 16).copy_(pairs.transpose(1, 2))
    out.mul_(_f16(blocks, 0))


def iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block: d f16 | scales_h u16 | scales_l[4] | qs[128]; x = d*(sc - 32) * kvalues[nibble]
    n = blocks.shape[0]
    low = torch.empty(n, 4, 2, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(blocks[:, 4:8], 0x0F, out=low[:, :, 0])
    torch.bitwise_right_shift(blocks[:, 4:8], 4, out=low[:, :, 1])
    sh = blocks[:, 2:4].to(torch.int32)
    scales_h = sh[:, 0] | (sh[:, 1] << 8)  # [n]
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=blocks.device)
    high = ((scales_h.unsqueeze(1) >> shifts) & 0x03).to(torch.uint8)  # [n, 8]
    sc = (low.view(n, 8) | (high << 4)).view(torch.int8) - 32
    dl = _f16(blocks, 0) * sc.to(torch.float32)  # [n, 8]
    pairs = _lookup(_pair_lut(blocks.device, IQ4_KVALUES), blocks[:, 8:].view(n, 8, 16))
    o = out.view(n, 8, 32)
    o.view(n, 8, 2, 16).copy_(pairs.transpose(2, 3))
    o.mul_(dl.unsqueeze(-1))


KERNELS: dict[T, Kernel] = {
    T.F32: f32,
    T.F16: f16,
    T.BF16: bf16,
    T.Q4_0: q4_0,
    T.Q4_1: q4_1,
    T.Q5_0: q5_0,
    T.Q5_1: q5_1,
    T.Q8_0: q8_0,
    T.Q2_K: q2_k,
    T.Q3_K: q3_k,
    T.Q4_K: q4_k,
    T.Q5_K: q5_k,
    T.Q6_K: q6_k,
    T.IQ4_NL: iq4_nl,
    T.IQ4_XS: iq4_xs,
}
