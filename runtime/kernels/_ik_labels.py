"""Labelled bits: ik_llama.cpp's repack loops run on bits that carry their own index.

Each bit of a base block is labelled with its index; a transcription of ik's ``repack_*`` loop
(``ggml/src/iqk/iqk_quantize.cpp`` at commit 8337e4cd3) runs on such values (shifts, masks and
ORs move labels, a byte store keeps the low 8), so the big block it writes says which base bit
every one of its bits is: the permutation ``_ik_interleaved.py`` inverts. Here: the labelled
values (:class:`Bits`, :class:`Block`), the helpers the transcriptions share, and the repack of
the types ik first converts to levels (:func:`levels_repack` over :class:`Plane` s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

WIDTH = 32  # bits of an intermediate value (C's int arithmetic), truncated to 8 on a byte store


class Bits:
    """A value whose bits are labels: ``lab[i]`` is the base bit now at bit ``i`` (-1: zero)."""

    __slots__ = ("lab",)

    def __init__(self, lab: np.ndarray) -> None:
        self.lab = lab

    def __and__(self, mask: int) -> Bits:
        keep = np.array([(mask >> i) & 1 for i in range(WIDTH)], dtype=bool)
        return Bits(np.where(keep, self.lab, -1))

    def __rshift__(self, n: int) -> Bits:
        lab = np.full(WIDTH, -1)
        lab[: WIDTH - n] = self.lab[n:]
        return Bits(lab)

    def __lshift__(self, n: int) -> Bits:
        lab = np.full(WIDTH, -1)
        lab[n:] = self.lab[: WIDTH - n]
        return Bits(lab)

    def __or__(self, other: Bits) -> Bits:
        both = (self.lab >= 0) & (other.lab >= 0)
        assert not both.any(), "overlapping bits"
        return Bits(np.maximum(self.lab, other.lab))


ZERO = Bits(np.full(WIDTH, -1))


class Block:
    """A block's bytes as labelled values; ``b[off]`` reads a byte, ``b[off] = v`` stores the
    low 8 bits of ``v`` (``|=`` works as in C)."""

    def __init__(self, nbytes: int, first_label: int | None = None) -> None:
        self.bytes: list[Bits] = []
        for j in range(nbytes):
            lab = np.full(WIDTH, -1)
            if first_label is not None:
                lab[:8] = np.arange(8) + first_label + 8 * j
            self.bytes.append(Bits(lab))

    def __getitem__(self, off: int) -> Bits:
        return self.bytes[off]

    def __setitem__(self, off: int, v: Bits) -> None:
        lab = v.lab.copy()
        lab[8:] = -1
        self.bytes[off] = Bits(lab)

    def copy(self, dst_off: int, src: Block, src_off: int, count: int) -> None:
        for j in range(count):
            self[dst_off + j] = src[src_off + j]


Repack = Callable[[list[Block], Block], None]


# --- ik's repack_* loops, one big block (ggml/src/iqk/iqk_quantize.cpp) ------------------------


def copy_d(y: Block, x: list[Block], src_off: int, dst_off: int = 0) -> None:
    """``y.d[k] = x[k].d`` (fp16) for every row ``k``."""
    for k, xk in enumerate(x):
        y.copy(dst_off + 2 * k, xk, src_off, 2)


def or_into(y: Block, at: int, v: Bits) -> None:
    """``y[at] |= v``."""
    y[at] = y[at] | v


def u16(x: Block, off: int) -> Bits:
    return x[off] | (x[off + 1] << 8)


# Q5_0, Q6_0, the k-quants and IQ*_K: ik converts each row's block to its levels (one small int per
# value; 32 a block, or 256 in 8 sub-blocks of 32), then writes them in planes of ``width``-bit
# fields, four rows interleaved 4 bytes at a time; the row headers (d, dmin, extra, scales) apart.

Levels = Callable[[Block], list[Bits]]  # a base block -> its levels
Head = Callable[[Block, Block, int], None]  # (big block, row k's block, k): headers and scales


@dataclass(frozen=True, slots=True)
class Plane:
    """Bits ``shift .. shift + width`` of the levels, packed at ``at``: per sub-block ``ib``, row
    ``k`` and ``i`` in 0..3, one byte per entry of ``fields`` (16 bytes apart) holding the levels
    ``32 ib + i + o`` for ``o`` in the entry, lowest field first."""

    at: int
    fields: tuple[tuple[int, ...], ...]
    width: int
    shift: int = 0

    def write(self, y: Block, lv: list[Bits], k: int) -> None:
        mask, stride = (1 << self.width) - 1, 16 * len(self.fields)
        for ib in range(len(lv) // 32):
            for i in range(4):
                q = 32 * ib + i
                for n, offsets in enumerate(self.fields):
                    v = ZERO
                    for j, o in enumerate(offsets):
                        v = v | (((lv[q + o] >> self.shift) & mask) << self.width * j)
                    y[self.at + stride * ib + 4 * k + i + 16 * n] = v


NIBBLES = ((0, 8), (16, 24), (4, 12), (20, 28))  # the low 4 bits, 4 bytes per 32 values
CRUMBS = ((0, 4, 8, 12), (16, 20, 24, 28))  # 2-bit fields, 2 bytes per 32 values
BIT2 = ((0, 4, 8, 12, 16, 20, 24, 28),)  # one high bit (bit 2) per value, q3_k / iq3_k
BIT4_K = ((0, 8, 4, 12, 16, 24, 20, 28),)  # one high bit (bit 4), q5_k
BIT4_IQ = ((0, 8, 16, 24, 4, 12, 20, 28),)  # one high bit (bit 4), iq5_k / iq5_ks


def levels_repack(head: Head, levels: Levels, *planes: Plane) -> Repack:
    """ik's repack of an r4 type given its row headers, its levels and their planes."""

    def repack(x: list[Block], y: Block) -> None:
        for k, xk in enumerate(x):
            head(y, xk, k)
            lv = levels(xk)
            for plane in planes:
                plane.write(y, lv, k)

    return repack
