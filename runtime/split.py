"""Expert splits: a family's stacked experts held as contiguous expert ranges on several pools.

ggml stores experts in the slowest dimension (``ne[-1] = n_expert``), so each expert's bytes are
contiguous, in the GGUF file and in a buffer of either storage mode. A family that fits no single
pool can therefore be held as parts ``[start, stop)`` of experts, one buffer per part and pool,
the same ranges for every member (an expert's gate, up and down live together). The model reads
a split tensor one expert at a time through :class:`SplitTensor`, on that expert's device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from ggufswap.runtime.kernels import QuantizedExperts, QuantizedMatrix, dequantize, grouped
from ggufswap.runtime.pools import Buffer, Pool
from ggufswap.shards import TensorRecord


@dataclass(frozen=True)
class ExpertSplit:
    """Expert ranges ``[start, stop)`` per pool, contiguous and in pool preference order."""

    ranges: tuple[tuple[Pool, int, int], ...]

    def __post_init__(self) -> None:
        stops = [0, *(stop for _, _, stop in self.ranges)]
        starts = [start for _, start, _ in self.ranges]
        assert starts == stops[:-1], f"expert ranges must be contiguous from 0: {self.describe()}"

    @property
    def n_expert(self) -> int:
        return self.ranges[-1][2]

    def pools(self) -> set[Pool]:
        return {pool for pool, _, _ in self.ranges}

    def describe(self) -> str:
        return ", ".join(f"{pool.name}[{start}:{stop}]" for pool, start, stop in self.ranges)

    @classmethod
    def greedy(
        cls,
        n_expert: int,
        per_expert: int,
        pools: Sequence[Pool],
        room: Callable[[Pool], int | None],
    ) -> ExpertSplit | None:
        """As many whole experts as fit on each pool in turn (``room``: free bytes, None =
        unbounded); None when the experts do not all fit."""
        ranges: list[tuple[Pool, int, int]] = []
        start = 0
        for pool in pools:
            free = room(pool)
            take = n_expert - start
            if free is not None and per_expert > 0:
                take = min(take, max(free, 0) // per_expert)
            if take > 0:
                ranges.append((pool, start, start + take))
                start += take
            if start == n_expert:
                return cls(tuple(ranges))
        return None


@dataclass(frozen=True)
class Part:
    """Experts ``[start, stop)`` of one split tensor, in a buffer of their own."""

    buffer: Buffer
    start: int
    stop: int

    @property
    def pool(self) -> Pool:
        return self.buffer.pool


def split_of(parts: Iterable[Part]) -> ExpertSplit:
    return ExpertSplit(tuple((p.pool, p.start, p.stop) for p in parts))


def expert_numel(spec: tuple[int, torch.dtype], n_expert: int) -> int:
    """Buffer elements per expert for a buffer spec ``(numel, dtype)`` of the whole tensor."""
    numel, _ = spec
    assert numel % n_expert == 0, f"{numel} buffer elements do not divide into {n_expert} experts"
    return numel // n_expert


def range_ne(record: TensorRecord, start: int, stop: int) -> tuple[int, ...]:
    """The ggml shape of experts ``[start, stop)`` of ``record``."""
    return (*record.ne[:-1], stop - start)


def encode_range(
    raw: torch.Tensor,
    record: TensorRecord,
    start: int,
    stop: int,
    dest: torch.Tensor,
    *,
    dtype: torch.dtype | None,
    strict: bool,
) -> None:
    """Write experts ``[start, stop)`` of raw GGUF bytes (the whole tensor, uint8, CPU) into the
    flat ``dest``: as they are (``dtype=None``, native storage) or dequantized to ``dtype``."""
    per_expert = record.nbytes // record.ne[-1]
    piece = raw[start * per_expert : stop * per_expert]
    if dtype is None:
        dest[: piece.numel()].copy_(piece)
        return
    ne = range_ne(record, start, stop)
    on_device = piece.to(dest.device, non_blocking=True)
    out = dest.view(tuple(reversed(ne)))
    dequantize(on_device, record.ggml_type, ne, dtype=dtype, strict=strict, out=out)


def copy_range(parts: Sequence[Part], unit: int, start: int, stop: int, dest: torch.Tensor) -> None:
    """Copy experts ``[start, stop)`` from ``parts`` (``unit`` buffer elements per expert) into
    the flat ``dest``, whichever parts and devices they come from."""
    for part in parts:
        lo, hi = max(start, part.start), min(stop, part.stop)
        if lo >= hi:
            continue
        src = part.buffer.tensor[(lo - part.start) * unit : (hi - part.start) * unit]
        dest[(lo - start) * unit : (hi - start) * unit].copy_(src)


class SplitTensor:
    """A stacked expert tensor whose expert ranges live in different buffers (and devices).

    ``t[e]`` is expert ``e`` in logical shape (``shape[1:]``), in the compute dtype, on the
    device of the part that holds it; in native storage, that expert's blocks as a
    :class:`~ggufswap.runtime.kernels.QuantizedMatrix`, which the model multiplies from without
    decoding the stack. A whole native stack is the one-part case.
    """

    def __init__(
        self,
        parts: Sequence[Part],
        record: TensorRecord,
        *,
        native: bool,
        compute_dtype: torch.dtype,
    ) -> None:
        self.parts = tuple(parts)
        self.record = record
        self.native = native
        self.dtype = compute_dtype
        self.shape = torch.Size(record.shape)
        n_expert = record.ne[-1]
        numel = record.nbytes if native else record.n_elements
        self._unit = numel // n_expert

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int, /) -> torch.Tensor | QuantizedMatrix:
        """Expert ``e``: a view of its values, or in native storage its blocks as a
        :class:`QuantizedMatrix` (``linear`` multiplies from them; nothing is decoded here)."""
        flat = self._flat(e)
        if not self.native:
            return flat.view(self.shape[1:])
        rows, cols = self.shape[1], self.shape[2]
        return QuantizedMatrix(flat, self.record.ggml_type, (rows, cols), self.record.name)

    @functools.cached_property
    def _blocks(self) -> QuantizedExperts | None:
        return self._make_blocks()

    def blocks(self) -> QuantizedExperts | None:
        """The whole stack in its GGUF blocks, when it is one part in native storage (what one
        grouped product multiplies from); None for a split or decoded stack. Made once: the
        parts and record of a stack never change (a commit makes new stacks)."""
        return self._blocks

    def _make_blocks(self) -> QuantizedExperts | None:
        if not self.native or len(self.parts) != 1:
            return None
        _, rows, cols = self.shape
        raw = self.parts[0].buffer.tensor[: self._unit * len(self)]
        return QuantizedExperts(
            raw, self.record.ggml_type, (len(self), rows, cols), self.record.name
        )

    def routed(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[N, k, rows]`` products of the experts ``ids`` ``[N, k]`` routes each token to
        (``x``: ``[N, cols]``, or ``[N, k, cols]`` one input per slot), in ``x``'s dtype and on
        its device: one grouped call for a whole native stack (ggml's ``mul_mat_id`` where it
        runs), else one product per expert present."""
        stack = self.blocks()
        if stack is not None:
            dtype = x.dtype if x.is_floating_point() else torch.float32
            y = stack.routed(x, ids, dtype=dtype)
        else:
            y = grouped(self._product, x, ids, self.shape[1])
        return y.to(device=x.device, dtype=x.dtype)

    def _product(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W[e].T`` on expert ``e``'s device, in its dtype (the compute dtype)."""
        w = self[e]
        if isinstance(w, QuantizedMatrix):
            return w.linear(x, dtype=self.dtype)
        return F.linear(x.to(device=w.device, dtype=w.dtype), w)

    def _flat(self, e: int) -> torch.Tensor:
        if not 0 <= e < len(self):
            raise IndexError(f"expert {e} out of range for {len(self)} experts")
        part = next(p for p in self.parts if p.start <= e < p.stop)
        offset = (e - part.start) * self._unit
        return part.buffer.tensor[offset : offset + self._unit]

    def full(self, device: torch.device) -> torch.Tensor:
        """Every expert stacked into one tensor on ``device``, in the compute dtype (a copy)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=device)
        for e in range(len(self)):
            flat = self._flat(e)
            if not self.native:
                out[e].copy_(flat.view(self.shape[1:]))
                continue
            ne = self.record.ne[:-1]
            value = dequantize(flat, self.record.ggml_type, ne, dtype=self.dtype, strict=False)
            out[e].copy_(value)
        return out
