"""Memory pools: named byte budgets on torch devices, and the one way buffers are placed.

A pool accounts for every buffer the runtime allocates on it. The budget is enforced by the
accounting (so CPU-only machines exercise placement, fallback and reattachment for real with
small CPU pools), and a refusal of the device's allocator (``torch.OutOfMemoryError`` on CUDA,
any allocator error) also counts as "full": both raise :class:`PoolFull`.

:func:`first_fit` is how the load and staging alike place a tensor or a family: the candidate
pools in order, the fallback last; an attempt that any allocation of it refuses gives back
everything it took, and the next candidate is tried.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ggufswap.runtime.errors import NoPoolFits, PoolFull

C = TypeVar("C")
R = TypeVar("R")


@dataclass(eq=False)
class Buffer:
    """One allocation on a pool: a flat tensor and the pool it is accounted to."""

    tensor: torch.Tensor
    pool: Pool
    nbytes: int
    released: bool = False
    mapped: bool = False  # a view of a shard file's pages (:mod:`.mapping`), not allocated here

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._release(self.nbytes)


@dataclass(eq=False)
class Pool:
    """A byte budget on one device. ``budget=None`` means as much as the device has."""

    name: str
    device: torch.device
    budget: int | None = None
    used: int = 0
    peak: int = 0
    pin_staging: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def free(self) -> int | None:
        return None if self.budget is None else self.budget - self.used

    def fits(self, nbytes: int, *, credit: int = 0) -> bool:
        """Whether ``nbytes`` fit, counting ``credit`` bytes that are about to be released."""
        return self.budget is None or self.used + nbytes <= self.budget + credit

    def allocate(self, numel: int, dtype: torch.dtype, *, credit: int = 0) -> Buffer:
        """Allocate a flat ``numel`` x ``dtype`` buffer, or raise :class:`PoolFull` (past the
        budget, or refused by the device's allocator)."""
        nbytes = numel * dtype.itemsize
        self._reserve(nbytes, credit)
        try:
            tensor = self._empty(numel, dtype)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one; any allocator error
            self._release(nbytes)
            raise PoolFull(self.name, nbytes, self.free or 0, device_error=str(exc)) from None
        return Buffer(tensor=tensor, pool=self, nbytes=nbytes)

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The device allocation itself (the one call a refusing allocator raises from)."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def adopt(self, tensor: torch.Tensor) -> Buffer:
        """Account a flat tensor held elsewhere (a view of a mapped shard file) to this pool,
        like an allocation of its size, or raise :class:`PoolFull`."""
        nbytes = tensor.numel() * tensor.element_size()
        self._reserve(nbytes, 0)
        return Buffer(tensor=tensor, pool=self, nbytes=nbytes, mapped=True)

    def _reserve(self, nbytes: int, credit: int) -> None:
        with self._lock:
            if not self.fits(nbytes, credit=credit):
                raise PoolFull(self.name, nbytes, (self.free or 0) + credit)
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            assert self.used >= 0, f"pool {self.name}: released more than allocated"

    def snapshot(self) -> dict[str, object]:
        return {
            "device": str(self.device),
            "budget": self.budget,
            "used": self.used,
            "peak": self.peak,
        }


class PoolSet:
    """The runtime's pools in preference order, plus the host pool that takes fallbacks."""

    def __init__(self, pools: list[Pool], *, fallback: str | None = None) -> None:
        if not pools:
            pools = [Pool(name="host", device=torch.device("cpu"))]
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate pool names in {names}")
        self.pools = {p.name: p for p in pools}
        if fallback is None:
            cpu = [p for p in pools if p.device.type == "cpu"]
            if cpu:
                fallback = cpu[-1].name
            else:
                host = Pool(name="host", device=torch.device("cpu"))
                self.pools[host.name] = host
                fallback = host.name
        if fallback not in self.pools:
            raise ValueError(f"fallback pool {fallback!r} is not one of {names}")
        self.fallback = self.pools[fallback]

    def __getitem__(self, name: str) -> Pool:
        return self.pools[name]

    def __iter__(self) -> Iterator[Pool]:
        return iter(self.pools.values())

    def ordered(self) -> list[Pool]:
        return list(self.pools.values())

    def usage(self) -> dict[str, int]:
        return {name: p.used for name, p in self.pools.items()}

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {name: p.snapshot() for name, p in self.pools.items()}


def first_fit(
    candidates: Iterable[C], attempt: Callable[[C], R], taken: list[Buffer]
) -> tuple[C, R]:
    """The first candidate (a pool, or a way to place a family) whose ``attempt`` allocates
    everything it needs, and what the attempt returned.

    An attempt appends every buffer it allocates to ``taken``; when one of its allocations raises
    :class:`PoolFull` (a budget, or the device's allocator), the buffers it appended are
    released and removed, and the next candidate is tried. Raises :class:`NoPoolFits` with every
    refusal when no candidate fits.
    """
    failures: list[PoolFull] = []
    for candidate in candidates:
        mark = len(taken)
        try:
            return candidate, attempt(candidate)
        except PoolFull as exc:
            for buffer in taken[mark:]:
                buffer.release()
            del taken[mark:]
            failures.extend(exc.failures if isinstance(exc, NoPoolFits) else [exc])
    if not failures:
        raise ValueError("first_fit needs at least one candidate")
    raise NoPoolFits(failures)
