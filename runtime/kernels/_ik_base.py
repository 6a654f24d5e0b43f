"""What ik_llama.cpp's dequantization kernels share (:mod:`._ik`, :mod:`._ik_trellis`): the kernel
record, the grid of IQ4_K that the trellis types scale by, per-device value tables, and the helpers
that read a block's fields (little-endian integers, fp16, bits, nibbles) as int32 tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

# Row scale per block, float32 [n, 1] (ones-free: None for types without a row header).
Decode = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]

# ik's non-linear 4-bit grid (ggml-common.h); its second half is the grid shifted by ``extra``.
IQ4K = (
    *(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
    *(-123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117),
)


@dataclass(frozen=True, slots=True)
class IkKernel:
    """A block decoder and the kind of per-row scale its type carries ("f16", "f32" or None)."""

    decode: Decode
    row_scale: str | None = None


# --- tables (per device, built once) -----------------------------------------------------------


@lru_cache(maxsize=64)
def table(device: torch.device, values: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


# --- field helpers -----------------------------------------------------------------------------


def u8(b: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Bytes ``start..start+count`` of every block as int32 ``[n, count]``."""
    return b[:, start : start + count].to(torch.int32)


def u16(b: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """``count`` little-endian uint16 at byte ``start`` of every block, int32 ``[n, count]``."""
    raw = b[:, start : start + 2 * count].contiguous().view(torch.int16)
    return raw.to(torch.int32) & 0xFFFF


def u32(b: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``count`` little-endian uint32 at byte ``start``, as int64 ``[n, count]``."""
    raw = b[:, start : start + 4 * count].contiguous().view(torch.int32)
    return raw.to(torch.int64) & 0xFFFFFFFF


def f16(b: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, float32 ``[n, 1]``."""
    return b[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def bits(x: torch.Tensor, count: int) -> torch.Tensor:
    """Bits ``0..count-1`` of ``x [n, 1]`` (int32), as ``[n, count]``."""
    shifts = torch.arange(count, dtype=torch.int32, device=x.device)
    return (x >> shifts) & 1


def nibbles(x: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` bytes -> ``[..., 2, k]``: low nibbles, then high nibbles."""
    return torch.stack((x & 0x0F, x >> 4), dim=-2)


def scaled(dl: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``dl [n, S]`` times ``values [n, S * L]`` sub-block by sub-block, as ``[n, S * L]``."""
    n, subs = dl.shape
    return (dl.view(n, subs, 1) * values.reshape(n, subs, -1)).view(n, -1)


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` (rows of ``table`` for a 2-D one): ``index_select`` on the flat index is
    several times faster than advanced indexing."""
    flat = table.index_select(0, index.reshape(-1).to(torch.int32))
    return flat.view(*index.shape, *table.shape[1:])
