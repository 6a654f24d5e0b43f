"""ik_llama.cpp's trellis types (``IQ1_KT`` .. ``IQ4_KT``): each expands a 13- to 16-bit index
into a group of 4 or 8 values with an integer recurrence; the values of every index are computed
once per device into a table. Reference: ``dequantize_row_iq*_kt`` in ik_llama.cpp's
``ggml/src/iqk/iqk_quantize.cpp`` (see :mod:`._ik`)."""

from __future__ import annotations

from functools import lru_cache

import torch

from ggufswap.runtime.kernels._ik_base import (
    IQ4K,
    IkKernel,
    lookup,
    scaled,
    table,
    u8,
    u16,
    u32,
)
from ggufswap.shards.ggml_types import GGMLType

# Trellis: index + offset is the seed of x <- KA*x (mod 2^32); a value is the sum of the four
# bytes of x & 0x3f3f3f3f, minus 126. Seeds of every _KT type lie in [KT_BASE, KT_BASE + 2^16).
KT_MULT = 0xCBAC1FED
KT_BASE = 4096
KT_GROUP = 8


@lru_cache(maxsize=8)
def kt_table(device: torch.device) -> torch.Tensor:
    """``[65536, 8]`` float32: the trellis values of seeds ``KT_BASE + i``."""
    x = torch.arange(KT_BASE, KT_BASE + (1 << 16), dtype=torch.int64)
    out = torch.empty(1 << 16, KT_GROUP, dtype=torch.int64)
    for k in range(KT_GROUP):
        x = (x * KT_MULT) & 0xFFFFFFFF  # int64 products of 32-bit factors wrap harmlessly
        s = x & 0x3F3F3F3F
        out[:, k] = (s & 0xFF) + ((s >> 8) & 0xFF) + ((s >> 16) & 0xFF) + (s >> 24) - 126
    return out.to(device=device, dtype=torch.float32)


def _kt_groups(seeds: torch.Tensor, group: int) -> torch.Tensor:
    """Trellis values of ``seeds`` (absolute, int) as ``[..., group]`` float32."""
    return lookup(kt_table(seeds.device), seeds - KT_BASE)[..., :group]


def _kt_nibble_scales(sc: torch.Tensor) -> torch.Tensor:
    """IQ2_KT/IQ3_KT: the 8 block nibbles of ``scales[4]``, low nibbles first."""
    return torch.cat((sc & 0x0F, sc >> 4), dim=1)


def _iq1_kt(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # sh[8] | ql[32] | qh[16]; group g = 4 * ib + ig of 8: 13-bit index ql[g], nibble ib // 4
    # of qh[4 * (ib % 4) + ig] as bits 8-11, bit 4 + ig of sh[ib] as bit 12; block scale
    # IQ4K[sh[ib] & 15]
    assert row_d is not None, "IQ1_KT needs its row scale"
    n = b.shape[0]
    sh = u8(b, 0, 8)
    dl = row_d * lookup(table(b.device, IQ4K[:16]), sh & 0x0F)
    ql = u8(b, 8, 32).view(n, 8, 4)
    qh = u8(b, 40, 16).view(n, 1, 4, 4)
    mid = torch.cat((qh & 0x0F, qh >> 4), dim=1).view(n, 8, 4)
    top = (sh.view(n, 8, 1) >> (4 + torch.arange(4, device=b.device, dtype=torch.int32))) & 1
    seeds = (ql | (mid << 8) | (top << 12)) + KT_BASE
    return scaled(dl, _kt_groups(seeds, 8))


def _iq2_kt(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # scales[4] | 32 uint16 indices, one per group of 8; block ib's scale IQ4K[nibble]
    assert row_d is not None, "IQ2_KT needs its row scale"
    nib = _kt_nibble_scales(u8(b, 0, 4))
    dl = row_d * lookup(table(b.device, IQ4K[:16]), nib)
    return scaled(dl, _kt_groups(u16(b, 4, 32) + KT_BASE, 8))


def _iq3_kt(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # scales[4] | 32 uint16 indices | qh[32] signs; values are |trellis| times the unsigned
    # nibble scale; element p of half h is negated by bit p // 32 + 4 * h of qh[p % 32]
    assert row_d is not None, "IQ3_KT needs its row scale"
    n = b.shape[0]
    dl = row_d * _kt_nibble_scales(u8(b, 0, 4)).to(torch.float32)
    y = scaled(dl, _kt_groups(u16(b, 4, 32) + KT_BASE, 8).abs()).view(n, 2, 4, 32)
    bit = torch.arange(8, dtype=torch.int32, device=b.device).view(1, 2, 4, 1)
    neg = ((u8(b, 68, 32).view(n, 1, 1, 32) >> bit) & 1).bool()
    return torch.where(neg, -y, y).view(n, 256)


def _iq4_kt(b: torch.Tensor, row_d: torch.Tensor | None) -> torch.Tensor:
    # shb u32[8] | ql[64] | qh[32]; block ib: bit 0 of shb picks seed offset 4096 or 36864,
    # bits 1-7 the scale + 64, bits 8 + 3 * ig.. the top 3 bits of group ig's 15-bit index;
    # group jj = 8 * ib + ig: ql[jj], nibble jj // 32 of qh[jj % 32] as bits 8-11
    assert row_d is not None, "IQ4_KT needs its row scale"
    n = b.shape[0]
    shb = u32(b, 0, 8)
    dl = row_d * (((shb & 0xFF) >> 1) - 64).to(torch.float32)
    ql = u8(b, 32, 64).to(torch.int64).view(n, 8, 8)
    qh = u8(b, 96, 32).to(torch.int64)
    mid = torch.cat((qh & 0x0F, qh >> 4), dim=1).view(n, 8, 8)
    ig = torch.arange(8, dtype=torch.int64, device=b.device)
    top = (shb.view(n, 8, 1) >> (8 + 3 * ig)) & 7
    offset = torch.where((shb & 1).bool(), 32768 + KT_BASE, KT_BASE).view(n, 8, 1)
    seeds = (ql | (mid << 8) | (top << 12)) + offset
    return scaled(dl, _kt_groups(seeds, 4))


T = GGMLType
TRELLIS_KERNELS: dict[GGMLType, IkKernel] = {
    T.IQ1_KT: IkKernel(_iq1_kt, "f32"),
    T.IQ2_KT: IkKernel(_iq2_kt, "f32"),
    T.IQ3_KT: IkKernel(_iq3_kt, "f32"),
    T.IQ4_KT: IkKernel(_iq4_kt, "f32"),
}
del T
