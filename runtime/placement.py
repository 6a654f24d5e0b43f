"""Where each tensor starts: llama.cpp's placement vocabulary over the runtime's pools.

The pools other than the fallback pool stand for llama.cpp's GPUs, in order (``CUDA0``,
``CUDA1``, ...), and the fallback pool for its CPU. The rules follow llama.cpp's sources (the
commit read is named in docs/configuration.md):

- ``gpu_layers`` is ``-ngl``: llama.cpp counts the output layer as one more layer after the
  blocks and offloads from the end, ``i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0)``
  (``src/llama-model.cpp``, ``load_tensors``): ``-ngl 1`` offloads the output alone, ``-ngl 2``
  the output and the last block. The input layer (``token_embd``) always stays on the CPU
  (``dev_input``); a tied output head (no ``output.weight``) is llama.cpp's duplicate of
  ``token_embd`` on the output layer's device, so a tied ``token_embd`` is placed with the output
  layer. ``rope_freqs`` and ``token_embd_norm`` are layer 0's, as llama.cpp creates them.
- the offloaded layers go to the GPU pools by ``tensor_split``: layer ``il`` goes to the first
  device whose cumulative share exceeds ``(il - i_gpu_start) / n_offloaded``
  (``std::upper_bound`` over the normalized cumulative split); no split, or all zeros, splits
  by each device's free memory.
- ``override_tensor`` rules (``-ot REGEX=BUFFER``) are tried in order on every tensor's name
  with ``re.search`` (``std::regex_search``); the first that matches chooses its pool, whatever
  the layer says. ``cpu_moe`` and ``n_cpu_moe`` are such rules (``common/common.h``:
  ``\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` -> CPU, and ``blk\\.<i>`` + that for the first
  ``n`` blocks), appended after the explicit ones.
- ``gpu_layers: auto`` is llama.cpp's ``--fit``: with nothing else set (llama.cpp's
  ``llama_params_fit`` refuses to change arguments the user set), every layer is offloaded if
  that fits the devices' free memory less a margin; else, for an MoE model whose dense tensors
  fit, the experts of the first blocks go to the CPU, as few blocks as fit; else as many layers
  as fit are offloaded.

A family (an MoE block's experts) shares one pool: when rules send its members to different
pools, it goes to the one latest in preference order (the fallback last), and the log says so.
Without any of these keys every tensor prefers the first pool (the runtime's default).
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import torch

from ggufswap.config import Storage
from ggufswap.config.schema import CPU_BUFFER, OverrideRule, PlacementConfig, block_regex
from ggufswap.logs import get_logger
from ggufswap.runtime.errors import PlacementError
from ggufswap.runtime.families import block_of, expert_of, family_of
from ggufswap.runtime.kernels import ggml_library
from ggufswap.runtime.pools import Pool, PoolSet
from ggufswap.runtime.split import ExpertSplit
from ggufswap.shards import GGMLType, TensorRecord

log = get_logger(__name__)

# The runtime's placement is the configuration's record (one type per idea).
Placement = PlacementConfig

# llama-arch.cpp's LLM_TENSOR_LAYER_INPUT tensors (kept on the CPU: dev_input).
INPUT_TENSORS: Final = frozenset(
    {"token_embd.weight", "position_embd.weight", "token_types.weight"}
)
# Created with layer 0's device though they sit outside the blocks.
FIRST_LAYER_TENSORS: Final = frozenset({"rope_freqs.weight", "token_embd_norm.weight"})
TIED_SOURCE: Final = "token_embd.weight"
OUTPUT: Final = "output.weight"


@dataclass(frozen=True)
class Layers:
    """llama.cpp's layer-to-device assignment: ``n_blocks`` blocks, then the output layer."""

    n_blocks: int
    n_gpu_layers: int
    devices: tuple[Pool, ...]
    cpu: Pool
    splits: tuple[float, ...] = field(default=())  # normalized cumulative shares per device

    def pool(self, il: int | None) -> Pool:
        """The pool of layer ``il`` (``n_blocks``: the output layer; None: the input layer)."""
        if il is None or not self.devices:
            return self.cpu
        start = max(self.n_blocks + 1 - self.n_gpu_layers, 0)
        active = min(self.n_gpu_layers, self.n_blocks + 1)
        if il < start or il - start >= active:
            return self.cpu
        index = bisect.bisect_right(self.splits, (il - start) / active)
        return self.devices[min(index, len(self.devices) - 1)]


def layer_of(name: str, n_blocks: int, *, tied: bool) -> int | None:
    """llama.cpp's layer of a tensor: its block, ``n_blocks`` for the output layer, None for the
    input layer."""
    block = block_of(name)
    if block is not None:
        return block
    if name in FIRST_LAYER_TENSORS:
        return 0
    if name in INPUT_TENSORS and not (tied and name == TIED_SOURCE):
        return None
    return n_blocks


def free_bytes(pool: Pool) -> int:
    """What a pool can still take: its budget's rest, else its device's free memory."""
    if pool.budget is not None:
        return pool.budget - pool.used
    if pool.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(pool.device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cumulative_splits(devices: Sequence[Pool], tensor_split: Sequence[float]) -> tuple[float, ...]:
    """llama.cpp's split points: ``tensor_split`` (or, all zero, each device's free memory)
    summed and normalized."""
    shares = [float(x) for x in tensor_split[: len(devices)]]
    shares += [0.0] * (len(devices) - len(shares))
    if not any(shares):
        shares = [float(max(free_bytes(p), 0)) for p in devices]
    total = sum(shares) or 1.0
    out, running = [], 0.0
    for share in shares:
        running += share
        out.append(running / total)
    return tuple(out)


def buffer_names(pools: PoolSet) -> dict[str, Pool]:
    """llama.cpp's buffer names for the pools: ``CPU`` is the fallback pool, ``CUDA<i>`` the
    pool on ``cuda:<i>``; where no pool is on a CUDA device (CPU pools standing in for GPUs),
    ``CUDA<i>`` is the i-th pool before the fallback."""
    names = {CPU_BUFFER: pools.fallback}
    devices = [p for p in pools.ordered() if p is not pools.fallback]
    cuda = [p for p in devices if p.device.type == "cuda"]
    if cuda:
        for pool in reversed(cuda):  # the first pool on a device wins
            names[f"CUDA{pool.device.index or 0}"] = pool
    else:
        names.update({f"CUDA{i}": pool for i, pool in enumerate(devices)})
    return names


def resolve_target(target: str, pools: PoolSet) -> Pool:
    """The pool a rule's target names (a pool's name first); PlacementError lists the names."""
    if target in pools.pools:
        return pools[target]
    buffers = buffer_names(pools)
    if target in buffers:
        return buffers[target]
    names = [*pools.pools, *sorted(buffers)]
    raise PlacementError(
        f"override target {target!r} names no pool; targets: {', '.join(names)} "
        "(a pool's name, CPU for the fallback pool, CUDA<i> for the pool on cuda:<i>)"
    )


class _Matcher(Protocol):
    def search(self, name: str, /) -> object: ...


class _FamilyMatcher:
    """Matches every member of an expert family (``experts_pool``'s rule)."""

    def search(self, name: str, /) -> object:
        return family_of(name)


_FAMILY: Final = _FamilyMatcher()


class Placer:
    """Chooses the preferred pool of every placement unit (a family, or a lone tensor)."""

    def __init__(
        self,
        placement: Placement,
        pools: PoolSet,
        *,
        n_blocks: int,
        nbytes: Callable[[TensorRecord], int],
    ) -> None:
        self.placement = placement
        self.pools = pools
        self.n_blocks = n_blocks
        self.nbytes = nbytes
        self.devices = tuple(p for p in pools.ordered() if p is not pools.fallback)

    def preferred(self, units: Mapping[str, list[TensorRecord]]) -> dict[str, Pool]:
        """Unit name -> the pool its rules and layers choose (before budgets)."""
        placement = self.placement
        names = {r.name for members in units.values() for r in members}
        tied = OUTPUT not in names
        rules = self._compiled(placement.rules())
        layers = None
        if placement.llama_layers:
            n_gpu_layers, fitted = self._gpu_layers(units, tied)
            rules += self._compiled(fitted)
            layers = Layers(
                self.n_blocks,
                n_gpu_layers,
                self.devices,
                self.pools.fallback,
                cumulative_splits(self.devices, placement.tensor_split),
            )
        if placement.experts_pool is not None:  # every family: as family_of() finds them
            rules.append((_FAMILY, self.pools[placement.experts_pool]))
        first = self.pools.ordered()[0]
        out: dict[str, Pool] = {}
        for unit, members in units.items():
            chosen = [self._pool_of(r.name, rules, layers, first, tied) for r in members]
            out[unit] = self._agree(unit, members, chosen)
        return out

    def _compiled(self, rules: list[OverrideRule]) -> list[tuple[_Matcher, Pool]]:
        return [(re.compile(r.pattern), resolve_target(r.target, self.pools)) for r in rules]

    def _pool_of(
        self,
        name: str,
        rules: list[tuple[_Matcher, Pool]],
        layers: Layers | None,
        first: Pool,
        tied: bool,
    ) -> Pool:
        for pattern, pool in rules:
            if pattern.search(name):
                return pool
        if layers is None:
            return first
        return layers.pool(layer_of(name, self.n_blocks, tied=tied))

    def _agree(self, unit: str, members: list[TensorRecord], chosen: list[Pool]) -> Pool:
        """A family's one pool: the latest in preference order among its members' choices."""
        distinct = set(chosen)
        if len(distinct) == 1:
            return chosen[0]
        order = self.pools.ordered()
        pool = max(distinct, key=order.index)
        log.warning(
            "placement.family_disagrees",
            family=unit,
            members={r.name: p.name for r, p in zip(members, chosen, strict=True)},
            pool=pool.name,
            reason="a family shares one pool: the latest in preference order is taken",
        )
        return pool

    # -- gpu_layers and --fit ------------------------------------------------------------------

    def _gpu_layers(
        self, units: Mapping[str, list[TensorRecord]], tied: bool
    ) -> tuple[int, list[OverrideRule]]:
        """``-ngl`` as a count (all = the blocks and the output), and the rules a fit adds."""
        every = self.n_blocks + 1
        value = self.placement.gpu_layers
        if value == "all" or value is None:
            return every, []
        if value != "auto":  # a negative count is all, as llama_model::n_gpu_layers() reads it
            return (every if int(value) < 0 else int(value)), []
        placement = self.placement
        if placement.user_rules or placement.tensor_split or not self.devices:
            return every, []  # llama_params_fit changes nothing the user set
        return Fit(self, units, tied).solve()


class Fit:
    """llama.cpp's ``--fit`` over the GPU pools' free memory (less ``fit_margin`` each)."""

    def __init__(self, placer: Placer, units: Mapping[str, list[TensorRecord]], tied: bool) -> None:
        self.placer = placer
        n_blocks = placer.n_blocks
        self.dense = [0] * (n_blocks + 1)  # bytes per layer, experts excluded (output last)
        self.experts = [0] * (n_blocks + 1)
        for members in units.values():
            for record in members:
                il = layer_of(record.name, n_blocks, tied=tied)
                if il is None:
                    continue  # the input layer stays on the CPU
                table = self.experts if family_of(record.name) is not None else self.dense
                table[il] += placer.nbytes(record)
        margin = placer.placement.fit_margin
        self.room = {p: free_bytes(p) - (margin if p.budget is None else 0) for p in placer.devices}
        self.splits = cumulative_splits(placer.devices, ())

    def fits(self, n_gpu_layers: int, n_cpu_moe: int) -> bool:
        layers = Layers(
            self.placer.n_blocks,
            n_gpu_layers,
            self.placer.devices,
            self.placer.pools.fallback,
            self.splits,
        )
        used: dict[Pool, int] = {}
        for il in range(self.placer.n_blocks + 1):
            pool = layers.pool(il)
            if pool in self.room:
                experts = self.experts[il] if il >= n_cpu_moe else 0
                used[pool] = used.get(pool, 0) + self.dense[il] + experts
        return all(n <= self.room[p] for p, n in used.items())

    def solve(self) -> tuple[int, list[OverrideRule]]:
        every = self.placer.n_blocks + 1
        if self.fits(every, 0):
            return every, []
        moe = any(self.experts)
        if moe and self.fits(every, every):
            n = next(n for n in range(every + 1) if self.fits(every, n))
            log.info("placement.fit", n_gpu_layers=every, n_cpu_moe=n)
            return every, [OverrideRule(block_regex(i), CPU_BUFFER) for i in range(n)]
        n_gpu = next((n for n in range(every, -1, -1) if self.fits(n, 0)), 0)
        log.info("placement.fit", n_gpu_layers=n_gpu, n_cpu_moe=0)
        return n_gpu, []


# --- storage: auto, and each tensor's home at load ---------------------------------------------

# Of the memory a pool can take (its budget's rest, or its device's free memory), the share
# ``storage: auto`` counts on (the rest is for activations, the KV cache and the process itself).
_AUTO_HEADROOM = 0.8
# storage: auto goes native on the CPU when ggml's kernels multiply at least this share of the
# quantized matrices' bytes (the rest multiply from their blocks with the float kernels).
_AUTO_GGML_SHARE = 0.9
_FLOAT_TYPES: Final = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})


def choose_storage(
    records: Iterable[TensorRecord], pools: PoolSet, compute_dtype: torch.dtype
) -> tuple[Storage, str]:
    """``storage: auto``: native where the dequantized tensors would not fit the pools, or where
    every pool is on the CPU and ggml's kernels multiply the model's quantized matrices (GGUF-size
    memory and llama.cpp's speed: bench/engine.py measures native over dequantized decode), else
    dequantized. Returns the choice and why, in numbers."""
    records = list(records)
    need = sum(r.n_elements for r in records) * compute_dtype.itemsize
    room = sum(_room(pool) for pool in pools)
    if need > room:
        return Storage.NATIVE, f"{need} dequantized bytes exceed the pools' {room}"
    quantized = [r for r in records if len(r.ne) >= 2 and r.ggml_type not in _FLOAT_TYPES]
    library = ggml_library()
    on_cpu = all(pool.device.type == "cpu" for pool in pools)
    if library is not None and on_cpu and quantized:
        by_ggml = sum(r.nbytes for r in quantized if r.ggml_type in library.types)
        share = by_ggml / sum(r.nbytes for r in quantized)
        if share >= _AUTO_GGML_SHARE:
            return Storage.NATIVE, f"{share:.0%} of the quantized bytes multiply in {library.name}"
    return Storage.DEQUANTIZED, f"{need} dequantized bytes fit the pools' {room}"


def _room(pool: Pool) -> int:
    """Bytes a pool can take for ``storage: auto``: its budget's rest, or a share of its
    device's free memory."""
    if pool.budget is not None:
        return pool.budget - pool.used
    return int(free_bytes(pool) * _AUTO_HEADROOM)


def placement_units(records: Iterable[TensorRecord]) -> dict[str, list[TensorRecord]]:
    """Placement units: each family's members together, every other tensor alone."""
    units: dict[str, list[TensorRecord]] = {}
    for record in records:
        units.setdefault(family_of(record.name) or record.name, []).append(record)
    return units


def plan_placement(
    records: Iterable[TensorRecord],
    placement: Placement,
    n_blocks: int,
    *,
    pools: PoolSet,
    nbytes: Callable[[TensorRecord], int],
) -> dict[str, Pool | ExpertSplit]:
    """Choose a home pool for every tensor: the pool its placement rules prefer (:class:`Placer`,
    llama.cpp's vocabulary), else the next pools in order with room, the fallback last; a family
    lands in one pool as a unit, or, with ``split_experts``, in the same expert ranges on several
    pools when no pool holds it."""
    ordered, fallback = pools.ordered(), pools.fallback
    units = placement_units(records)
    preferred = Placer(placement, pools, n_blocks=n_blocks, nbytes=nbytes).preferred(units)
    tally: dict[str, int] = {p.name: 0 for p in ordered}
    homes: dict[str, Pool | ExpertSplit] = {}
    for unit, members in units.items():
        need = sum(nbytes(r) for r in members)
        candidates = [preferred[unit], *(p for p in ordered if p is not preferred[unit])]
        chosen: Pool | ExpertSplit = next(
            (p for p in candidates if p.budget is None or tally[p.name] + need <= p.budget),
            fallback,
        )
        if chosen is fallback and preferred[unit] is not fallback and placement.split_experts:
            split = _split_at_load(members, candidates, tally, pools=pools, nbytes=nbytes)
            chosen = split or chosen
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
