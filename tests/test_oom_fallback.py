"""A device whose allocator refuses (CUDA out of memory) is a full pool, at load and at staging
alike: the family goes to the fallback pool and the plan commits; memory returns to its
baseline when it comes back. The refusal is real: ``ScarcePool``'s allocation call raises
``torch.OutOfMemoryError`` once its device holds ``capacity`` bytes, with no budget set."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    WAIT_S,
    ModelDir,
    Q,
    fresh_logits,
    loaded_bytes,
    logits,
    one_thread,
    open_runtime,
    slot_states,
)

from ggufswap.ipc import Event, TensorFallbackEvent
from ggufswap.runtime import PlanState, Pool, PoolFull, SlotState, Storage
from ggufswap.runtime.errors import NoPoolFits
from ggufswap.runtime.pools import Buffer, first_fit

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

CPU = torch.device("cpu")
DOWN1 = "blk.1.ffn_down_exps.weight"  # Q8_0: 17408 bytes native, 32768 as F16
FAMILY1 = ("blk.1.ffn_down_exps.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight")
HEADROOM = 4096  # device bytes left after the load: less than any F16 expert tensor


@dataclass(eq=False)
class ScarcePool(Pool):
    """A pool on a device of ``capacity`` bytes and no budget: the allocation call itself
    raises ``torch.OutOfMemoryError`` past them, as CUDA's caching allocator does."""

    capacity: int = 0
    refusals: int = 0

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.used > self.capacity:  # ``used`` already counts this allocation
            self.refusals += 1
            raise torch.OutOfMemoryError(
                f"simulated: tried to allocate {numel * dtype.itemsize} bytes "
                f"({self.capacity} bytes total capacity)"
            )
        return super()._empty(numel, dtype)


def scarce_pools(capacity: int, host_budget: int | None = None) -> list[Pool]:
    return [ScarcePool("gpu0", CPU, capacity=capacity), Pool("host", CPU, budget=host_budget)]


def test_refused_allocation_is_a_full_pool_and_first_fit_gives_back_what_it_took() -> None:
    """An allocator refusal raises PoolFull naming the pool with the accounting unchanged, and
    first_fit releases a failed attempt's buffers before trying the next pool."""
    gpu = ScarcePool("gpu0", CPU, capacity=1000)
    host = Pool("host", CPU)
    kept = gpu.allocate(200, torch.float32)  # 800 bytes
    with pytest.raises(PoolFull, match="'gpu0': the device could not allocate 800 bytes"):
        gpu.allocate(200, torch.float32)
    assert (gpu.used, gpu.refusals, gpu.budget) == (800, 1, None)
    taken: list[Buffer] = []

    def both(pool: Pool) -> list[Buffer]:  # a family of two 160-byte tensors
        for _ in range(2):
            taken.append(pool.allocate(40, torch.float32))
        return taken[-2:]

    pool, buffers = first_fit([gpu, host], both, taken)
    assert pool is host
    assert taken == buffers
    assert gpu.used == 800
    assert host.used == 320
    with pytest.raises(NoPoolFits, match=r"'gpu0'.*; then pool 'gpu0'"):
        first_fit([gpu, gpu], both, taken)
    assert gpu.used == 800
    assert len(taken) == 2
    kept.release()


@pytest.mark.parametrize("stable", [False, True], ids=["swap", "stable"])
def test_family_falls_back_when_the_device_refuses_and_returns_to_baseline(
    tmp_path: Path, stable: bool
) -> None:
    """With no budget and a device that refuses the growth of an expert (native storage), the
    whole family moves to the host pool and the plan commits with a fresh load's logits; going
    back ten times returns both pools and the device to their baseline bytes."""
    model_dir = ModelDir.write(tmp_path / "model")
    capacity = loaded_bytes(model_dir.first, Storage.NATIVE) + HEADROOM
    pools = scarce_pools(capacity)
    gpu = pools[0]
    assert isinstance(gpu, ScarcePool)
    saved = model_dir.save(DOWN1, tmp_path / "saved")
    big = model_dir.variant(DOWN1, Q.F16, tmp_path / "variants")
    runtime, model = open_runtime(
        model_dir.first, storage=Storage.NATIVE, pools=pools, stable_pointers=stable
    )
    events: list[Event] = []
    runtime.on_event(events.append)
    try:
        baseline, usage = logits(model), runtime.store.pools.usage()
        assert usage == {"gpu0": capacity - HEADROOM, "host": 0}
        assert gpu.refusals == 0
        model_dir.put(DOWN1, big)
        ticket = runtime.apply(model_dir.plan("big", [DOWN1]))
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        assert gpu.refusals >= 1
        assert slot_states(runtime, FAMILY1) == {SlotState.FALLBACK_CPU}
        assert {e.tensor for e in events if isinstance(e, TensorFallbackEvent)} == set(FAMILY1)
        fallen = runtime.store.pools.usage()
        assert fallen["gpu0"] == usage["gpu0"]  # the originals stay reserved
        assert fallen["host"] == sum(runtime.store.slots[n].active.nbytes for n in FAMILY1)
        assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=Storage.NATIVE))
        for i in range(10):
            model_dir.put(DOWN1, saved)
            runtime.apply(model_dir.plan(f"back-{i}", [DOWN1]))
            assert runtime.store.pools.usage() == usage
            model_dir.put(DOWN1, big)
            runtime.apply(model_dir.plan(f"big-{i}", [DOWN1]))
            assert runtime.store.pools.usage() == fallen
        model_dir.put(DOWN1, saved)
        runtime.apply(model_dir.plan("home", [DOWN1]))
        assert runtime.store.pools.usage() == usage
        assert slot_states(runtime, tuple(runtime.store.slots)) == {SlotState.ON_ORIGINAL}
        assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()


def test_plan_is_refused_only_when_no_pool_can_hold_it(tmp_path: Path) -> None:
    """When the device refuses and the host pool has no room either, the plan is rejected whole
    naming both pools, and everything is as before; with room on the host it commits."""
    model_dir = ModelDir.write(tmp_path / "model")
    capacity = loaded_bytes(model_dir.first, Storage.NATIVE) + HEADROOM
    runtime, model = open_runtime(
        model_dir.first, storage=Storage.NATIVE, pools=scarce_pools(capacity, host_budget=1024)
    )
    try:
        baseline, usage = logits(model), runtime.store.pools.usage()
        model_dir.put(DOWN1, model_dir.variant(DOWN1, Q.F16, tmp_path / "variants"))
        ticket = runtime.submit(model_dir.plan("big", [DOWN1]))
        assert ticket.wait(WAIT_S) is PlanState.REJECTED
        reasons = " ".join(r.reason for r in ticket.reasons)
        assert "'gpu0': the device could not allocate" in reasons
        assert "'host'" in reasons
        assert runtime.store.pools.usage() == usage
        assert slot_states(runtime, tuple(runtime.store.slots)) == {SlotState.ON_ORIGINAL}
        assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()


def test_load_places_a_refused_family_whole_on_the_fallback(tmp_path: Path) -> None:
    """At load, a device that runs out of memory part-way through a family sends the whole
    family to the fallback pool (never a family split by the allocator), and the logits equal
    a load on one unbounded pool."""
    model_dir = ModelDir.write(tmp_path / "model")
    total = loaded_bytes(model_dir.first, Storage.NATIVE)
    pools = scarce_pools(total // 2)
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, pools=pools)
    try:
        assert isinstance(pools[0], ScarcePool)
        assert pools[0].refusals >= 1
        homes = {name: slot.home.name for name, slot in runtime.store.slots.items()}
        assert set(homes.values()) == {"gpu0", "host"}
        for family, members in runtime.store.families.items():
            assert len({homes[m] for m in members}) == 1, family
        assert runtime.store.pools["gpu0"].used <= total // 2
        assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=Storage.NATIVE))
    finally:
        runtime.close()
