"""Expert splits: an MoE family that fits no single pool is held as the same expert ranges on
several pools; swaps keep every member on one split, outputs stay exact, and returning to the
original content restores the original split and the pools' baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import (
    WAIT_S,
    ModelDir,
    Q,
    cpu_pools,
    fresh_logits,
    logits,
    one_thread,
    open_runtime,
    slot_states,
)

from ggufswap.runtime import Placement, PlanState, SlotState, Storage
from ggufswap.runtime.split import ExpertSplit, split_of
from ggufswap.shards import TensorRecord

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

FAMILY3 = ("blk.3.ffn_down_exps.weight", "blk.3.ffn_gate_exps.weight", "blk.3.ffn_up_exps.weight")
DOWN3, GATE3, _ = FAMILY3
SPLIT = Placement(split_experts=True)
ROOM = 9000  # dev bytes left after the load: one grown native expert (8192), not a whole one


def nbytes(record: TensorRecord, storage: Storage) -> int:
    return record.nbytes if storage is Storage.NATIVE else record.n_elements * 4


def dev_budget(model_dir: ModelDir, storage: Storage, *, experts_on_dev: int) -> int:
    """A dev budget that holds every tensor loaded before the last expert family,
    ``experts_on_dev`` of that family's experts, and ``ROOM`` more bytes."""
    records = list(model_dir.records().values())
    first = min(i for i, r in enumerate(records) if r.name in FAMILY3)
    before = sum(nbytes(r, storage) for r in records[:first])
    per_expert = sum(nbytes(r, storage) for r in records if r.name in FAMILY3) // 4
    return before + experts_on_dev * per_expert + ROOM


def splits(runtime: Any, names: tuple[str, ...] = FAMILY3) -> set[ExpertSplit]:
    return {split_of(runtime.store.slots[n].parts) for n in names}


def part_bytes(runtime: Any) -> dict[str, int]:
    """Bytes each pool holds for the slots, counted from their buffers."""
    held: dict[str, int] = dict.fromkeys(runtime.store.pools.pools, 0)
    for slot in runtime.store.slots.values():
        buffers = [p.buffer for p in slot.parts] if slot.is_split else [slot.active]
        if slot.is_split and slot.parts is not slot.original_parts:
            buffers += [p.buffer for p in slot.original_parts]
        elif not slot.is_split and slot.active is not slot.original:
            buffers.append(slot.original)
        for buffer in buffers:
            held[buffer.pool.name] += buffer.nbytes
    return held


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_family_that_fits_no_pool_is_split_at_load(tmp_path: Path, storage: Storage) -> None:
    """With split_experts, a family too big for any single non-fallback pool is split into the
    same expert ranges for every member; outputs equal a fresh load; without it, it goes whole."""
    model_dir = ModelDir.write(tmp_path / "model")
    budget = dev_budget(model_dir, storage, experts_on_dev=2)
    runtime, model = open_runtime(
        model_dir.first, storage=storage, pools=cpu_pools(budget), placement=SPLIT
    )
    try:
        (split,) = splits(runtime)
        assert [(p.name, a, b) for p, a, b in split.ranges] == [("dev", 0, 2), ("host", 2, 4)]
        assert {n for n, s in runtime.store.slots.items() if s.is_split} == set(FAMILY3)
        assert part_bytes(runtime) == runtime.store.pools.usage()
        assert runtime.store.experts(DOWN3).shape == runtime.store.weight(DOWN3).shape
        assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=storage))
    finally:
        runtime.close()
    runtime, _ = open_runtime(model_dir.first, storage=storage, pools=cpu_pools(budget))
    try:
        assert not any(s.is_split for s in runtime.store.slots.values())
        assert {runtime.store.slots[n].home.name for n in FAMILY3} == {"host"}
    finally:
        runtime.close()


def test_dequantized_type_change_updates_the_parts_in_place(tmp_path: Path) -> None:
    """In dequantized storage a new type of a split member is written into its parts: the split,
    the states and the pools stay as loaded, and outputs equal a fresh load."""
    model_dir = ModelDir.write(tmp_path / "model")
    budget = dev_budget(model_dir, Storage.DEQUANTIZED, experts_on_dev=2)
    saved = model_dir.save(DOWN3, tmp_path / "saved")
    runtime, model = open_runtime(
        model_dir.first, storage=Storage.DEQUANTIZED, pools=cpu_pools(budget), placement=SPLIT
    )
    try:
        baseline, usage, loaded = logits(model), runtime.store.pools.usage(), splits(runtime)
        model_dir.put(DOWN3, model_dir.variant(DOWN3, Q.Q4_0, tmp_path / "variants"))
        runtime.apply(model_dir.plan("q4", [DOWN3]))
        assert splits(runtime) == loaded
        assert slot_states(runtime, FAMILY3) == {SlotState.ON_ORIGINAL}
        assert runtime.store.pools.usage() == usage
        assert torch.equal(
            logits(model), fresh_logits(model_dir.first, storage=Storage.DEQUANTIZED)
        )
        model_dir.put(DOWN3, saved)
        runtime.apply(model_dir.plan("back", [DOWN3]))
        assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()


def test_type_changes_keep_the_family_on_one_split_and_return_to_baseline(tmp_path: Path) -> None:
    """Native storage: a smaller type stays in the original parts; a grown member gets private
    parts with the same ranges while they fit; when they do not, the whole family moves to a new
    split (here all of it on the fallback pool) in one commit. Outputs equal a fresh load each
    time, and after 20 round trips the original split and the pools' baseline are back exactly."""
    model_dir = ModelDir.write(tmp_path / "model")
    budget = dev_budget(model_dir, Storage.NATIVE, experts_on_dev=1)
    saved = {n: model_dir.save(n, tmp_path / "saved") for n in (DOWN3, GATE3)}
    variants = tmp_path / "variants"
    runtime, model = open_runtime(
        model_dir.first, storage=Storage.NATIVE, pools=cpu_pools(budget), placement=SPLIT
    )

    def fresh() -> torch.Tensor:
        return fresh_logits(model_dir.first, storage=Storage.NATIVE)

    try:
        baseline, usage, (loaded,) = logits(model), runtime.store.pools.usage(), splits(runtime)
        assert [(p.name, a, b) for p, a, b in loaded.ranges] == [("dev", 0, 1), ("host", 1, 4)]

        model_dir.put(DOWN3, model_dir.variant(DOWN3, Q.Q4_0, variants))  # smaller
        runtime.apply(model_dir.plan("small", [DOWN3]))
        assert splits(runtime) == {loaded}
        assert slot_states(runtime, FAMILY3) == {SlotState.ON_ORIGINAL}
        assert runtime.store.pools.usage() == usage
        assert torch.equal(logits(model), fresh())

        model_dir.put(DOWN3, model_dir.variant(DOWN3, Q.F16, variants))  # grows, fits at home
        runtime.apply(model_dir.plan("grow", [DOWN3]))
        assert splits(runtime) == {loaded}
        assert runtime.store.slots[DOWN3].state is SlotState.DETACHED
        assert slot_states(runtime, FAMILY3[1:]) == {SlotState.ON_ORIGINAL}
        assert torch.equal(logits(model), fresh())

        model_dir.put(GATE3, model_dir.variant(GATE3, Q.F16, variants))  # no room: all move
        runtime.apply(model_dir.plan("grow-more", [GATE3]))
        (moved,) = splits(runtime)
        assert [(p.name, a, b) for p, a, b in moved.ranges] == [("host", 0, 4)]
        assert slot_states(runtime, FAMILY3) == {SlotState.FALLBACK_CPU}
        assert part_bytes(runtime) == runtime.store.pools.usage()
        assert torch.equal(logits(model), fresh())

        for name, path in saved.items():
            model_dir.put(name, path)
        runtime.apply(model_dir.plan("back", [DOWN3, GATE3]))
        assert all(
            runtime.store.slots[n].parts is runtime.store.slots[n].original_parts for n in FAMILY3
        )
        assert runtime.store.pools.usage() == usage
        assert torch.equal(logits(model), baseline)

        big = {n: model_dir.variant(n, Q.F16, variants) for n in (DOWN3, GATE3)}
        for i in range(20):
            for name, path in big.items():
                model_dir.put(name, path)
            runtime.apply(model_dir.plan(f"big-{i}", list(big)))
            assert len(splits(runtime)) == 1
            for name, path in saved.items():
                model_dir.put(name, path)
            runtime.apply(model_dir.plan(f"orig-{i}", list(big)))
        assert splits(runtime) == {loaded}
        assert slot_states(runtime, tuple(runtime.store.slots)) == {SlotState.ON_ORIGINAL}
        assert runtime.store.pools.usage() == usage
        assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()


def test_plan_that_cannot_be_placed_is_rejected_whole(tmp_path: Path) -> None:
    """When a split family's new sizes fit no split over the pools, the plan is rejected whole:
    its other jobs are not applied, and pools, splits, states and outputs are as before."""
    model_dir = ModelDir.write(tmp_path / "model")
    budget = dev_budget(model_dir, Storage.NATIVE, experts_on_dev=1)
    probe, _ = open_runtime(
        model_dir.first, storage=Storage.NATIVE, pools=cpu_pools(budget), placement=SPLIT
    )
    host_used = probe.store.pools.usage()["host"]
    probe.close()
    variants = tmp_path / "variants"
    other = "blk.0.attn_q.weight"
    runtime, model = open_runtime(
        model_dir.first,
        storage=Storage.NATIVE,
        pools=cpu_pools(budget, host_budget=host_used + 4096),
        placement=SPLIT,
    )
    try:
        baseline, usage, loaded = logits(model), runtime.store.pools.usage(), splits(runtime)
        for name in (other, DOWN3, GATE3):
            model_dir.put(
                name, model_dir.variant(name, Q.F16 if name != other else Q.Q8_0, variants)
            )
        ticket = runtime.submit(model_dir.plan("too-big", [other, DOWN3, GATE3]))
        assert ticket.wait(WAIT_S) is PlanState.REJECTED
        assert not ticket.stale
        assert any(r.tensor in FAMILY3 for r in ticket.reasons)
        assert runtime.store.pools.usage() == usage
        assert splits(runtime) == loaded
        assert slot_states(runtime, tuple(runtime.store.slots)) == {SlotState.ON_ORIGINAL}
        assert runtime.weight_version == 0
        assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()
