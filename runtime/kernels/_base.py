"""The shared base of the torch dequantization kernels: the kernel record, the scratch arena,
and the SWAR and scale helpers every kernel table (:mod:`._mainline`, :mod:`._iq`) builds on.

A kernel has two halves, both run per chunk of blocks (``blocks`` is ``[c, type_size]`` uint8, one
GGUF block per row): ``prepare(blocks, arena)`` computes the per-block float32 scales, and
``body(blocks, out, arena, *scales)`` dequantizes into ``out`` (``[c, block_size]`` float32,
contiguous). The driver (:mod:`.dequant`) keeps chunks small enough to stay in the last-level
cache between passes, and ``arena`` hands out temporaries that are reused from chunk to chunk and
call to call (fresh allocations pay a page fault per 4 KiB, which costs as much as the arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Prepare = Callable[[torch.Tensor, "Arena"], tuple[torch.Tensor, ...]]
Body = Callable[..., None]


@dataclass(frozen=True, slots=True)
class Kernel:
    """Per-tensor scale preparation plus the per-chunk dequantization body."""

    prepare: Prepare
    body: Body


class Arena:
    """Named scratch buffers for one dequantization call, reused across its chunks."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (uninitialised); the same memory on every call."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        nbytes = -(-nbytes // 8) * 8
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            self._buffers[name] = buf
        return buf[:nbytes].view(dtype)[:numel]


# --- helpers ----------------------------------------------------------------------------------


def _i64(value: int) -> int:
    """A 64-bit pattern as the signed integer torch's int64 scalars take."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _rep(byte: int) -> int:
    """``byte`` repeated in all 8 bytes of an int64 (a SWAR mask)."""
    return _i64(byte * 0x0101010101010101)


def _words(flat: torch.Tensor, arena: Arena) -> torch.Tensor:
    """``flat`` (uint8) as int64 words for byte-wise SWAR ops, zero-padded to whole words.

    A shift of a word followed by a per-byte mask is a per-byte shift, done at an eighth of the
    element count (torch does not vectorize uint8 shifts).
    """
    n = flat.numel()
    if n % 8 == 0 and flat.data_ptr() % 8 == 0:
        return flat.view(torch.int64)
    words = arena.take("words", -(-n // 8), torch.int64)
    padded = words.view(torch.uint8)
    padded[n:].zero_()
    padded[:n].copy_(flat)
    return words


def _f16(blocks: torch.Tensor, offset: int, arena: Arena) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 ``[n, 1]``."""
    d = arena.take(f"f16@{offset}", blocks.shape[0], torch.float32).view(-1, 1)
    return d.copy_(blocks[:, offset : offset + 2].view(torch.float16))


def _no_scales(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
    return ()


def _to_float(src: torch.Tensor, arena: Arena, name: str = "f") -> torch.Tensor:
    """Contiguous int->float32 conversion of ``src`` into a reused buffer of the same shape."""
    f = arena.take(name, src.numel(), torch.float32).view(src.shape)
    f.copy_(src)
    return f


def _d(offset: int, divisor: float = 1.0) -> Prepare:
    """Prepare the single fp16 scale at ``offset``, divided by a power of two (exact)."""

    def prepare(blocks: torch.Tensor, arena: Arena) -> tuple[torch.Tensor, ...]:
        d = _f16(blocks, offset, arena)
        return (d if divisor == 1.0 else d.mul_(1.0 / divisor),)

    return prepare
