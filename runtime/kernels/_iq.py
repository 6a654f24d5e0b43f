"""Torch dequantization kernels for the grid, ternary and FP4 GGML types (issue 13).

IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0, MXFP4 and NVFP4, in the
``Kernel`` scheme of :mod:`._base` (``prepare`` computes per-group float32 scales, ``body``
dequantizes a chunk); :mod:`.dequant` reads this module's ``IQ_KERNELS`` beside the mainline
``KERNELS``.

Tables: the grids, sign patterns and value maps are gguf-py's own (``gguf.quants``' ``grid_hex``,
``grid_map``, ``ksigns``, ``kvalues``, ``delta``), unpacked in Python into torch lookup tables
built once per device. A grid row is 8 (or 4) int8 values read as one int64 (int32), so one
gather yields a whole group of elements; where a grid index and its sign index fit in 16 bits
together (IQ2_XXS, IQ2_XS) the table holds the signed rows directly, and IQ1's delta sign is the
table's top index bit. Elsewhere signs are a second gather of 0x00/0xFF byte masks, applied as
``(g ^ m) + (m & 1)`` per byte on int64 words (the grid values are positive, so no byte carries).
TQ2_0's crumbs and the FP4 nibble codes are split out of int64 words straight into element
order (SWAR), then converted (TQ2_0) or looked up in a float32 table (FP4) into the result and
scaled in place; TQ1_0's base-3 digits come from one float32 table per digit, each a contiguous
gather, whose rows are scaled into place.

Bit-exactness with ``gguf.quants``: every value there is a product of exact float32 factors (an
fp16 scale of 11 significant bits, a sub-scale of at most 5, a grid value of at most 6, a power of
two, a sign) whose exact result fits float32, so the product is the same in any order; each
kernel forms the per-group scale exactly as well and multiplies it into small integers or
table floats once. IQ1's ``dl * (grid + delta)`` is ``(dl / 8) * (8 * grid +- 1)``. TQ1_0/TQ2_0
and the FP4 types multiply the scale by the decoded value as gguf does (``d * 0.0`` keeps ``d``'s
sign, ``inf * 0`` is NaN in both); MXFP4's E8M0 byte 0xFF decodes to 2**127 as in gguf (not NaN),
so its largest codes overflow to inf in both.
"""

from __future__ import annotations

from functools import lru_cache
from math import ceil, log2
from typing import Any

import torch

from ggufswap.runtime.kernels._base import (
    Arena,
    Kernel,
    _d,
    _f16,
    _rep,
)
from ggufswap.shards.ggml_types import GGMLType as T

# --- tables -------------------------------------------------------------------------------------


def gguf_quants() -> Any:
    """gguf-py's ``quants`` module, which holds ggml's IQ grids and FP4 values: imported when a
    kernel of this module first builds its tables, so that serving a model without these types
    never imports gguf-py (its package import pulls in its writer and vocabulary tools)."""
    import gguf.quants

    return gguf.quants


def _grid_rows(cls: Any) -> list[list[int]]:
    """gguf's packed grid of ``cls`` (hex text of 2- or 3-bit codes into ``grid_map``) as rows."""
    raw = bytes.fromhex(bytes(cls.grid_hex).decode("ascii"))
    values = [int(v) for v in cls.grid_map]
    bits = ceil(log2(len(values)))
    step = 8 // (8 // bits)
    mask = (1 << bits) - 1
    flat = [values[(b >> s) & mask] for b in raw for s in range(0, 8, step)]
    n, width = cls.grid_shape
    assert len(flat) == n * width, cls.__name__
    return [flat[i * width : (i + 1) * width] for i in range(n)]


def _sign_rows(pattern_bytes: bytes | list[int]) -> torch.Tensor:
    """``[len, 8]`` int8: -1 where bit ``k`` of the pattern byte is set, else 1."""
    return torch.tensor(
        [[-1 if (p >> k) & 1 else 1 for k in range(8)] for p in pattern_bytes], dtype=torch.int8
    )


def _packed(rows: torch.Tensor) -> torch.Tensor:
    """``[N, 8]`` (``[N, 4]``) int8 rows as ``[N]`` int64 (int32) words, element 0 lowest."""
    wide = torch.int64 if rows.shape[1] == 8 else torch.int32
    return rows.contiguous().view(wide).reshape(-1)


@lru_cache(maxsize=16)
def _signed_grid(device: torch.device, name: str) -> torch.Tensor:
    """int64 table: ``grid | sign_index << log2(len(grid))`` -> the 8 signed grid values."""
    gq = gguf_quants()
    cls = getattr(gq, name)
    grid = torch.tensor(_grid_rows(cls), dtype=torch.int8)  # [G, 8]
    signs = _sign_rows(gq.IQ2_XXS.ksigns)  # [128, 8]
    return _packed((signs[:, None, :] * grid[None, :, :]).reshape(-1, 8)).to(device)


@lru_cache(maxsize=16)
def _grid(device: torch.device, name: str) -> torch.Tensor:
    """The grid of ``gguf.quants.<name>`` as packed int8 rows (int64 or int32 per row)."""
    gq = gguf_quants()
    rows = torch.tensor(_grid_rows(getattr(gq, name)), dtype=torch.int8)
    return _packed(rows).to(device)


@lru_cache(maxsize=16)
def _sign_masks(device: torch.device, ksigns: bool) -> torch.Tensor:
    """int64 table: sign byte (or IQ2_XXS's 7-bit ksigns index) -> 0xFF where negative."""
    gq = gguf_quants()
    patterns = list(gq.IQ2_XXS.ksigns) if ksigns else list(range(256))
    masks = torch.where(_sign_rows(patterns) < 0, -1, 0).to(torch.int8)
    return _packed(masks).to(device)


@lru_cache(maxsize=4)
def _iq1_grid(device: torch.device) -> torch.Tensor:
    """int64 table: ``grid | delta_bit << 11`` -> ``8 * grid + 1`` (bit clear) or ``- 1``."""
    gq = gguf_quants()
    grid = torch.tensor(_grid_rows(gq.IQ1_S), dtype=torch.int8)  # [2048, 8] of -1, 0, 1
    delta = int(float(gq.IQ1_S.delta) * 8)
    assert delta == 1, gq.IQ1_S.delta
    return _packed(torch.cat([grid * 8 + delta, grid * 8 - delta])).to(device)


@lru_cache(maxsize=32)
def _shifts(
    device: torch.device, values: tuple[int, ...], dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@lru_cache(maxsize=8)
def _fp4_values(device: torch.device) -> torch.Tensor:
    """``[16]`` float32: gguf's doubled E2M1 values (``MXFP4.kvalues``, shared by NVFP4)."""
    gq = gguf_quants()
    kv = [int(v) for v in gq.MXFP4.kvalues]
    assert kv == [int(v) for v in gq.NVFP4.kvalues]
    return torch.tensor(kv, dtype=torch.float32, device=device)


@lru_cache(maxsize=8)
def _trit_planes(device: torch.device) -> torch.Tensor:
    """``[5, 256]`` float32: base-3 digit ``k`` of a TQ1_0 byte minus one, as gguf extracts it,
    ``((b * 3**k % 256) * 3 >> 8) - 1``, one table per digit."""
    rows = [[((b * 3**k % 256) * 3 >> 8) - 1 for b in range(256)] for k in range(5)]
    return torch.tensor(rows, dtype=torch.float32, device=device)


@lru_cache(maxsize=8)
def _byte_scales(device: torch.device, kind: str) -> torch.Tensor:
    """``[256]`` float32: an FP4 block's scale byte decoded as gguf does (halved, for kvalues)."""
    if kind == "e8m0":  # ggml_e8m0_to_fp32_half: bit patterns
        bits = [(0x00200000 << x) if x < 2 else ((x - 1) << 23) for x in range(256)]
        return torch.tensor(bits, dtype=torch.int32).view(torch.float32).to(device)
    values = []  # ue4m3, bias 7, 0x00 and 0x7F (and only those) read as zero
    for x in range(256):
        exp, man = (x >> 3) & 0xF, x & 7
        raw = man * 2.0**-9 if exp == 0 else (1.0 + man / 8.0) * 2.0 ** (exp - 7)
        values.append(0.0 if x in (0, 0x7F) else raw * 0.5)
    return torch.tensor(values, dtype=torch.float32, device=device)


# --- shared steps -------------------------------------------------------------------------------


def _field(blocks: torch.Tensor, start: int, stop: int, arena: Arena, name: str) -> torch.Tensor:
    """Bytes ``start:stop`` of every block as a compact ``[c, stop - start]`` uint8 copy (aligned,
    so that it can be read through wider dtypes)."""
    c = blocks.shape[0]
    buf = arena.take(name, c * (stop - start), torch.uint8).view(c, stop - start)
    return buf.copy_(blocks[:, start:stop])


def _u16(blocks: torch.Tensor, start: int, stop: int, arena: Arena, name: str) -> torch.Tensor:
    """The little-endian uint16 fields in bytes ``start:stop``, as int32 ``[c, (stop-start)/2]``."""
    c = blocks.shape[0]
    raw = _field(blocks, start, stop, arena, name + ".b").view(torch.int16)
    wide = arena.take(name, raw.numel(), torch.int32).view(c, -1)
    return wide.copy_(raw).bitwise_and_(0xFFFF)


def _gather(table: torch.Tensor, idx: torch.Tensor, arena: Arena, name: str) -> torch.Tensor:
    out = arena.take(name, idx.numel(), table.dtype)
    return torch.index_select(table, 0, idx.reshape(-1), out=out)


def _apply_signs(values: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Negate the int8 lanes of int64 ``values`` where ``masks`` has 0xFF (in place, both)."""
    values.bitwise_xor_(masks)
    return values.add_(masks.bitwise_and_(_rep(0x01)))


def _scaled(out: torch.Tensor, lanes: torch.Tensor, scales: torch.Tensor) -> None:
    """``out [c, 256] = int8 lanes * scales``, the scales ``[c, groups, 1]`` over equal groups."""
    c, groups = out.shape[0], scales.shape[1]
    out.copy_(lanes.view(torch.int8).view(c, -1))
    # 2-D ([c * groups, group]): torch's loops run these far faster than the 3-D view
    out.view(c * groups, -1).mul_(scales.reshape(c * groups, 1))


def _half_sub(scales: torch.Tensor, d: torch.Tensor, factor: float) -> torch.Tensor:
    """``d * (0.5 + scales) * factor`` as ``[n, groups, 1]`` float32 (every step exact)."""
    return (scales.to(torch.float32).add_(0.5).mul_(d).mul_(factor)).unsqueeze(-1)


def _nibbles_of(raw: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` uint8 bytes -> ``[n, 2k]``: low nibble then high nibble of each byte."""
    n = raw.shape[0]
    return torch.stack([raw & 0x0F, raw >> 4], dim=-1).view(n, -1)


# --- IQ2 ----------------------------------------------------------------------------------------


def _iq2_xxs_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    # the top 4 bits of each group's aux word (byte 7 of the 8-byte group at 2 + 8g)
    return (_half_sub(blocks[:, 9::8] >> 4, _f16(blocks, 0, arena), 0.25),)


def _iq2_xxs(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, db: torch.Tensor) -> None:
    # block: d f16 | 8 x (grid u8[4] | aux u32); aux = sign7[4] (bits 0..27) | scale (28..31)
    # x = d * (0.5 + scale) / 4 * grid[g] * sign
    c = blocks.shape[0]
    q = _field(blocks, 2, 66, arena, "qs").view(c, 8, 8)
    aux = q.view(torch.int32)[:, :, 1:]  # [c, 8, 1]
    idx = arena.take("idx", c * 32, torch.int32).view(c, 8, 4)
    torch.bitwise_right_shift(aux, _shifts(blocks.device, (0, 7, 14, 21)), out=idx)
    idx.bitwise_and_(0x7F).bitwise_left_shift_(8).bitwise_or_(q[:, :, :4])
    _scaled(out, _gather(_signed_grid(blocks.device, "IQ2_XXS"), idx, arena, "vals"), db)


def _iq2_sub16(blocks: torch.Tensor, arena: Arena, offset: int) -> torch.Tensor:
    """IQ2_XS/IQ2_S: 16 4-bit sub-scales at ``offset`` (low nibble first), ``d*(0.5+s)/4``."""
    return _half_sub(_nibbles_of(blocks[:, offset : offset + 8]), _f16(blocks, 0, arena), 0.25)


def _iq2_xs_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    return (_iq2_sub16(blocks, arena, 66),)


def _iq2_xs(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, db: torch.Tensor) -> None:
    # block: d f16 | qs u16[32] (grid 9 bits | sign7 << 9) | scales[8]
    idx = _u16(blocks, 2, 66, arena, "idx")
    _scaled(out, _gather(_signed_grid(blocks.device, "IQ2_XS"), idx, arena, "vals"), db)


def _iq2_s_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    return (_iq2_sub16(blocks, arena, 74),)


def _iq2_s(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, db: torch.Tensor) -> None:
    # block: d f16 | qs[32] | signs[32] | qh[8] | scales[8]; grid index qs | 2 bits of qh << 8
    c, device = blocks.shape[0], blocks.device
    qh = arena.take("qh", c * 8, torch.int32).view(c, 8, 1).copy_(blocks[:, 66:74].unsqueeze(-1))
    idx = arena.take("idx", c * 32, torch.int32).view(c, 8, 4)
    torch.bitwise_right_shift(qh, _shifts(device, (0, 2, 4, 6)), out=idx)
    idx.bitwise_and_(0x03).bitwise_left_shift_(8).bitwise_or_(blocks[:, 2:34].view(c, 8, 4))
    vals = _gather(_grid(device, "IQ2_S"), idx, arena, "vals")
    sidx = arena.take("sidx", c * 32, torch.int32).view(c, 32).copy_(blocks[:, 34:66])
    _scaled(out, _apply_signs(vals, _gather(_sign_masks(device, False), sidx, arena, "m")), db)


# --- IQ3 ----------------------------------------------------------------------------------------


def _iq3_xxs_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    # the top 4 bits of each aux word at 66 + 4g
    return (_half_sub(blocks[:, 69::4] >> 4, _f16(blocks, 0, arena), 0.5),)


def _iq3_xxs(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, db: torch.Tensor) -> None:
    # block: d f16 | qs[64] (grid of 4) | aux u32[8] (sign7[4] | scale << 28)
    c, device = blocks.shape[0], blocks.device
    gidx = arena.take("gidx", c * 64, torch.int32).view(c, 64).copy_(blocks[:, 2:66])
    vals = _gather(_grid(device, "IQ3_XXS"), gidx, arena, "vals").view(torch.int64)
    aux = _field(blocks, 66, 98, arena, "aux").view(torch.int32).view(c, 8, 1)
    sidx = arena.take("sidx", c * 32, torch.int32).view(c, 8, 4)
    torch.bitwise_right_shift(aux, _shifts(device, (0, 7, 14, 21)), out=sidx)
    sidx.bitwise_and_(0x7F)
    _scaled(out, _apply_signs(vals, _gather(_sign_masks(device, True), sidx, arena, "m")), db)


def _iq3_s_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    sc = _nibbles_of(blocks[:, 106:110]).to(torch.float32)  # d * (1 + 2 * scale)
    return (sc.mul_(2.0).add_(1.0).mul_(_f16(blocks, 0, arena)).unsqueeze(-1),)


def _iq3_s(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, db: torch.Tensor) -> None:
    # block: d f16 | qs[64] | qh[8] | signs[32] | scales[4]; grid index qs | bit of qh << 8
    c, device = blocks.shape[0], blocks.device
    qh = arena.take("qh", c * 8, torch.int32).view(c, 8, 1).copy_(blocks[:, 66:74].unsqueeze(-1))
    idx = arena.take("idx", c * 64, torch.int32).view(c, 8, 8)
    torch.bitwise_right_shift(qh, _shifts(device, tuple(range(8))), out=idx)
    idx.bitwise_and_(0x01).bitwise_left_shift_(8).bitwise_or_(blocks[:, 2:66].view(c, 8, 8))
    vals = _gather(_grid(device, "IQ3_S"), idx, arena, "vals").view(torch.int64)
    sidx = arena.take("sidx", c * 32, torch.int32).view(c, 32).copy_(blocks[:, 74:106])
    _scaled(out, _apply_signs(vals, _gather(_sign_masks(device, False), sidx, arena, "m")), db)


# --- IQ1 ----------------------------------------------------------------------------------------


def _iq1_s_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    # bits 12..14 of each qh u16 at 34 + 2j: d * (2s + 1) / 8 (the 8 is folded into the table)
    s = ((blocks[:, 35::2] >> 4) & 0x07).to(torch.float32)
    return (s.mul_(2.0).add_(1.0).mul_(_f16(blocks, 0, arena)).mul_(0.125).unsqueeze(-1),)


def _iq1_s(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, dl: torch.Tensor) -> None:
    # block: d f16 | qs[32] | qh u16[8] (3 index bits per grid x4 | scale << 12 | delta << 15)
    c, device = blocks.shape[0], blocks.device
    qh = _u16(blocks, 34, 50, arena, "qh").view(c, 8, 1)
    idx = arena.take("idx", c * 32, torch.int32).view(c, 8, 4)
    torch.bitwise_right_shift(qh, _shifts(device, (0, 3, 6, 9)), out=idx)
    idx.bitwise_and_(0x07).bitwise_left_shift_(8).bitwise_or_(blocks[:, 2:34].view(c, 8, 4))
    idx.bitwise_or_(qh.bitwise_right_shift(15).bitwise_left_shift_(11))
    _scaled(out, _gather(_iq1_grid(device), idx, arena, "vals"), dl)


def _iq1_m_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    # scales u16[4] at 48: 3-bit sub-scales at bits 0, 3, 6, 9; the fp16 d in the top nibbles
    n, device = blocks.shape[0], blocks.device
    sc = blocks[:, 48:56]
    d16 = torch.empty(n, 2, dtype=torch.uint8, device=device)
    torch.bitwise_or(sc[:, 1] >> 4, sc[:, 3] & 0xF0, out=d16[:, 0])
    torch.bitwise_or(sc[:, 5] >> 4, sc[:, 7] & 0xF0, out=d16[:, 1])
    d = d16.view(torch.float16).to(torch.float32)  # [n, 1]
    words = sc.contiguous().view(torch.int16).to(torch.int32).unsqueeze(-1)  # [n, 4, 1]
    s = ((words >> _shifts(device, (0, 3, 6, 9))) & 0x07).view(n, 16).to(torch.float32)
    return (s.mul_(2.0).add_(1.0).mul_(d).mul_(0.125).unsqueeze(-1),)


def _iq1_m(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, dl: torch.Tensor) -> None:
    # block: qs[32] | qh[16] (per nibble: 3 index bits | delta << 3) | scales u16[4]
    c, device = blocks.shape[0], blocks.device
    qh = arena.take("qh", c * 16, torch.int32).view(c, 16, 1).copy_(blocks[:, 32:48].unsqueeze(-1))
    nib = arena.take("nib", c * 32, torch.int32).view(c, 16, 2)
    torch.bitwise_right_shift(qh, _shifts(device, (0, 4)), out=nib)
    idx = arena.take("idx", c * 32, torch.int32).view(c, 16, 2)
    torch.bitwise_and(nib, 0x07, out=idx).bitwise_left_shift_(8)
    idx.bitwise_or_(blocks[:, :32].view(c, 16, 2))
    idx.bitwise_or_(nib.bitwise_and_(0x08).bitwise_left_shift_(8))
    _scaled(out, _gather(_iq1_grid(device), idx, arena, "vals"), dl)


# --- ternary and FP4 ----------------------------------------------------------------------------


def _planes(blocks: torch.Tensor, arena: Arena) -> torch.Tensor:
    """``[lanes, c, type_size]`` float32: every byte of every block looked up in each lane's
    table (one contiguous gather per lane, so that the scaling reads whole rows)."""
    c, size = blocks.shape
    flat = blocks.reshape(-1)
    idx = arena.take("idx", flat.numel(), torch.int32).copy_(flat)
    tables = _trit_planes(blocks.device)
    f = arena.take("f", tables.shape[0] * flat.numel(), torch.float32).view(tables.shape[0], -1)
    for k in range(tables.shape[0]):
        torch.index_select(tables[k], 0, idx, out=f[k])
    return f.view(-1, c, size)


def _tq1_0(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d: torch.Tensor) -> None:
    # block: qs[48] | qh[4] | d f16; trit k of byte j is element 32k + j (qs[:32]),
    # 160 + 16k + j (qs[32:]), 240 + 4k + j (qh); x = d * (trit - 1)
    f = _planes(blocks, arena)
    for k in range(5):
        torch.mul(f[k][:, 0:32], d, out=out[:, 32 * k : 32 * k + 32])
        torch.mul(f[k][:, 32:48], d, out=out[:, 160 + 16 * k : 176 + 16 * k])
        if k < 4:
            torch.mul(f[k][:, 48:52], d, out=out[:, 240 + 4 * k : 244 + 4 * k])


def _field_words(blocks: torch.Tensor, start: int, arena: Arena) -> torch.Tensor:
    """Bytes ``start:`` of every block as int64 words ``[c, (size - start) / 8]`` (a compact
    copy), for per-byte SWAR ops."""
    c, size = blocks.shape
    return _field(blocks, start, size, arena, "qs").view(torch.int64).view(c, -1)


def _tq2_0(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d: torch.Tensor) -> None:
    # block: qs[64] | d f16; crumb k of byte 32h + j is element 128h + 32k + j; x = d * (q - 1)
    # crumbs in element order as int8 q - 1: ((w >> 2k) & 0x03 + 0x7F) ^ 0x80 per byte (no carry)
    c = blocks.shape[0]
    w = _field_words(blocks[:, :64], 0, arena).view(c, 2, 1, 4)
    q = arena.take("q", c * 32, torch.int64).view(c, 2, 4, 4)
    torch.bitwise_right_shift(
        w, _shifts(blocks.device, (0, 2, 4, 6), torch.int64).view(4, 1), out=q
    )
    q.bitwise_and_(_rep(0x03)).add_(_rep(0x7F)).bitwise_xor_(_rep(0x80))
    out.copy_(q.view(torch.int8).view(c, 256))
    out.mul_(d)


def _fp4_codes(blocks: torch.Tensor, start: int, arena: Arena, *, by_nibble: bool) -> torch.Tensor:
    """``[c * block_size]`` int32 indices into the doubled-E2M1 table, from the qs bytes at
    ``start`` as 8-byte words: all low nibbles then all high ones (``by_nibble``), or for each
    word its 8 low nibbles then its 8 high ones."""
    w = _field_words(blocks, start, arena)  # [c, words]
    c, words = w.shape
    shifts = _shifts(blocks.device, (0, 4), torch.int64)
    codes = arena.take("codes", 2 * w.numel(), torch.int64)
    if by_nibble:
        torch.bitwise_right_shift(w.unsqueeze(1), shifts.view(2, 1), out=codes.view(c, 2, words))
    else:
        torch.bitwise_right_shift(w.unsqueeze(-1), shifts, out=codes.view(c, words, 2))
    codes.bitwise_and_(_rep(0x0F))
    idx = arena.take("idx", 8 * codes.numel(), torch.int32)
    return idx.copy_(codes.view(torch.uint8))


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d: torch.Tensor) -> None:
    # block: e8m0 | qs[16]; element 16h + j is nibble h of qs[j]; x = e8m0_half(e) * kvalue
    idx = _fp4_codes(blocks, 1, arena, by_nibble=True)
    torch.index_select(_fp4_values(blocks.device), 0, idx, out=out.view(-1))
    out.mul_(d)


def _nvfp4(blocks: torch.Tensor, out: torch.Tensor, arena: Arena, d: torch.Tensor) -> None:
    # block: ue4m3 scale[4] | qs[32]; sub-block s (16 elements): nibble h of qs[8s + j] is
    # element 16s + 8h + j, which is word s's low nibbles then its high ones
    c = blocks.shape[0]
    idx = _fp4_codes(blocks, 4, arena, by_nibble=False)
    torch.index_select(_fp4_values(blocks.device), 0, idx, out=out.view(-1))
    out.view(c * 4, 16).mul_(d.reshape(c * 4, 1))


def _mxfp4_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    idx = blocks[:, 0].to(torch.int64)
    return (_byte_scales(blocks.device, "e8m0")[idx].view(-1, 1),)


def _nvfp4_prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    idx = blocks[:, :4].to(torch.int64)
    return (_byte_scales(blocks.device, "ue4m3")[idx].view(-1, 4, 1),)


IQ_KERNELS: dict[T, Kernel] = {
    T.IQ1_S: Kernel(_iq1_s_prepare, _iq1_s),
    T.IQ1_M: Kernel(_iq1_m_prepare, _iq1_m),
    T.IQ2_XXS: Kernel(_iq2_xxs_prepare, _iq2_xxs),
    T.IQ2_XS: Kernel(_iq2_xs_prepare, _iq2_xs),
    T.IQ2_S: Kernel(_iq2_s_prepare, _iq2_s),
    T.IQ3_XXS: Kernel(_iq3_xxs_prepare, _iq3_xxs),
    T.IQ3_S: Kernel(_iq3_s_prepare, _iq3_s),
    T.TQ1_0: Kernel(_d(52), _tq1_0),
    T.TQ2_0: Kernel(_d(64), _tq2_0),
    T.MXFP4: Kernel(_mxfp4_prepare, _mxfp4),
    T.NVFP4: Kernel(_nvfp4_prepare, _nvfp4),
}
