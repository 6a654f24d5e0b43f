"""Where a model's tensors live: the storage mode ``storage: auto`` picks, and the pool each
tensor is loaded into (an MoE family as one unit, or split by expert over several pools).

Placement is decided once, before the load reads anything, from the records alone: like
llama.cpp's ``n_gpu_layers``, the first ``gpu_layers`` blocks go to the first pool and the rest
to the fallback; a pool whose budget is spent passes its tensors to the next one in preference
order. The store loads each tensor into the home chosen here (:meth:`TensorStore.load`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ggufswap.config import Storage
from ggufswap.runtime.families import block_of, expert_of, family_of
from ggufswap.runtime.pools import Pool, PoolSet
from ggufswap.runtime.split import ExpertSplit
from ggufswap.shards import TensorRecord


@dataclass(frozen=True)
class Placement:
    """Where tensors go at load: like llama.cpp's ``n_gpu_layers``, plus a pool for experts."""

    gpu_layers: int = -1  # blocks [0, gpu_layers) on the first pool; -1 = all
    experts_pool: str | None = None
    # An MoE family that fits no single non-fallback pool is split into expert ranges over the
    # pools in preference order (the fallback last), instead of going whole to the fallback.
    split_experts: bool = False


def choose_storage(
    records: Iterable[TensorRecord], pools: PoolSet, compute_dtype: torch.dtype
) -> tuple[Storage, str]:
    """``storage: auto``: dequantized when every tensor fits the pools in ``compute_dtype``,
    else native (quantized tensors keep their GGUF bytes; float tensors are read as views).
    Returns the choice and why, in numbers."""
    need = sum(r.n_elements for r in records) * compute_dtype.itemsize
    room = sum(_room(pool) for pool in pools)
    if need <= room:
        return Storage.DEQUANTIZED, f"{need} dequantized bytes fit the pools' {room}"
    return Storage.NATIVE, f"{need} dequantized bytes exceed the pools' {room}"


# Of the memory a device reports free, the share ``storage: auto`` counts on (the rest is for
# activations, the KV cache and the process itself).
_AUTO_HEADROOM = 0.8


def _room(pool: Pool) -> int:
    """Bytes a pool can take: its budget, or what its device has free."""
    if pool.budget is not None:
        return pool.budget - pool.used
    if pool.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(pool.device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * _AUTO_HEADROOM)


def plan_placement(
    records: Iterable[TensorRecord],
    placement: Placement,
    n_blocks: int,
    *,
    pools: PoolSet,
    nbytes: Callable[[TensorRecord], int],
) -> dict[str, Pool | ExpertSplit]:
    """Choose a home pool for every tensor; a family lands in one pool as a unit, or, with
    ``split_experts``, in the same expert ranges on several pools when no pool holds it."""
    ordered = pools.ordered()
    primary, fallback = ordered[0], pools.fallback
    units: dict[str, list[TensorRecord]] = {}
    for record in records:
        units.setdefault(family_of(record.name) or record.name, []).append(record)
    tally: dict[str, int] = {p.name: 0 for p in ordered}
    homes: dict[str, Pool | ExpertSplit] = {}
    for members in units.values():
        first = members[0].name
        block = block_of(first)
        on_primary = (
            placement.gpu_layers < 0
            or (block is not None and block < placement.gpu_layers)
            or (block is None and placement.gpu_layers > n_blocks)
        )
        preferred = primary if on_primary else fallback
        if placement.experts_pool is not None and family_of(first) is not None:
            preferred = pools[placement.experts_pool]
        need = sum(nbytes(r) for r in members)
        candidates = [preferred, *(p for p in ordered if p is not preferred)]
        chosen: Pool | ExpertSplit = next(
            (p for p in candidates if p.budget is None or tally[p.name] + need <= p.budget),
            fallback,
        )
        if chosen is fallback and preferred is not fallback and placement.split_experts:
            chosen = (
                _split_at_load(members, candidates, tally, pools=pools, nbytes=nbytes) or chosen
            )
        if isinstance(chosen, ExpertSplit):
            per_expert = need // chosen.n_expert
            for pool, start, stop in chosen.ranges:
                tally[pool.name] += per_expert * (stop - start)
        else:
            tally[chosen.name] += need
        for record in members:
            homes[record.name] = chosen
    return homes


def _split_at_load(
    members: list[TensorRecord],
    candidates: list[Pool],
    tally: dict[str, int],
    *,
    pools: PoolSet,
    nbytes: Callable[[TensorRecord], int],
) -> ExpertSplit | None:
    """Expert ranges over ``candidates`` (the fallback last) for a family, or None when it
    is not a stack of experts or would not be split."""
    if family_of(members[0].name) is None:
        return None
    if any(expert_of(r.name) is not None for r in members):
        return None  # one tensor per expert (old Mixtral): not a stack to split by expert
    n_expert = members[0].ne[-1]
    if n_expert < 2 or any(r.ne[-1] != n_expert for r in members):
        return None
    per_expert = sum(nbytes(r) for r in members) // n_expert
    order = [p for p in candidates if p is not pools.fallback] + [pools.fallback]
    split = ExpertSplit.greedy(
        n_expert,
        per_expert,
        order,
        lambda p: None if p.budget is None else p.budget - tally[p.name],
    )
    return split if split is not None and len(split.ranges) > 1 else None
