"""Native storage on small pools: a tensor that outgrows its pool falls back to host memory with
its MoE family, outputs stay exact, and returning to the original gives the memory back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    WAIT_S,
    ModelDir,
    Q,
    cpu_pools,
    fresh_logits,
    loaded_bytes,
    logits,
    one_thread,
    open_runtime,
    slot_states,
)

from ggufswap.ipc import Event, TensorFallbackEvent, TensorReattachedEvent
from ggufswap.runtime import PlanState, SlotState, Storage

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN1 = "blk.1.ffn_down_exps.weight"  # Q8_0: 17408 bytes native, 32768 as F16
DOWN2 = "blk.2.ffn_down_exps.weight"
FAMILY1 = ("blk.1.ffn_down_exps.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight")
HEADROOM = 4096  # dev pool bytes left free after the load: less than any F16 expert tensor


@pytest.mark.parametrize("stable", [False, True], ids=["swap", "stable"])
def test_family_falls_back_and_oscillation_returns_to_baseline(
    tmp_path: Path, stable: bool
) -> None:
    """A type change that no longer fits moves the whole family to FALLBACK_CPU with outputs equal
    to a fresh load; after 100 round trips the pools are exactly at their baseline."""
    model_dir = ModelDir.write(tmp_path / "model")
    pools = cpu_pools(loaded_bytes(model_dir.first, Storage.NATIVE) + HEADROOM)
    saved = model_dir.save(DOWN1, tmp_path / "saved")
    big = model_dir.variant(DOWN1, Q.F16, tmp_path / "variants")
    runtime, model = open_runtime(
        model_dir.first, storage=Storage.NATIVE, pools=pools, stable_pointers=stable
    )
    events: list[Event] = []
    runtime.on_event(events.append)
    try:
        baseline = logits(model)
        usage = runtime.store.pools.usage()
        assert usage["host"] == 0
        others = tuple(n for n in runtime.store.slots if n not in FAMILY1)

        model_dir.put(DOWN1, big)
        runtime.apply(model_dir.plan("big-0", [DOWN1]))
        assert slot_states(runtime, FAMILY1) == {SlotState.FALLBACK_CPU}
        assert slot_states(runtime, others) == {SlotState.ON_ORIGINAL}
        assert {e.tensor for e in events if isinstance(e, TensorFallbackEvent)} == set(FAMILY1)
        assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=Storage.NATIVE))
        assert runtime.store.pools.usage()["dev"] == usage["dev"]  # originals stay reserved
        assert runtime.store.pools.usage()["host"] > 0

        model_dir.put(DOWN1, saved)
        runtime.apply(model_dir.plan("orig-0", [DOWN1]))
        assert {e.tensor for e in events if isinstance(e, TensorReattachedEvent)} == set(FAMILY1)
        for i in range(1, 100):
            model_dir.put(DOWN1, big)
            runtime.apply(model_dir.plan(f"big-{i}", [DOWN1]))
            model_dir.put(DOWN1, saved)
            runtime.apply(model_dir.plan(f"orig-{i}", [DOWN1]))
        assert runtime.store.pools.usage() == usage
        assert slot_states(runtime, tuple(runtime.store.slots)) == {SlotState.ON_ORIGINAL}
        assert torch.equal(logits(model), baseline)
        assert runtime.weight_version == 200
    finally:
        runtime.close()


def test_growth_that_fits_detaches_alone(tmp_path: Path) -> None:
    """With room in its pool, a tensor that grows moves to a private buffer there (DETACHED),
    its siblings stay put, and going back frees the private buffer."""
    model_dir = ModelDir.write(tmp_path / "model")
    pools = cpu_pools(loaded_bytes(model_dir.first, Storage.NATIVE) + 64 * 1024)
    saved = model_dir.save(DOWN1, tmp_path / "saved")
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, pools=pools)
    try:
        baseline, usage = logits(model), runtime.store.pools.usage()
        model_dir.put(DOWN1, model_dir.variant(DOWN1, Q.F16, tmp_path / "variants"))
        runtime.apply(model_dir.plan("grow", [DOWN1]))
        assert runtime.store.slots[DOWN1].state is SlotState.DETACHED
        assert slot_states(runtime, FAMILY1[1:]) == {SlotState.ON_ORIGINAL}
        assert runtime.store.pools.usage() == {"dev": usage["dev"] + 32768, "host": 0}
        assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=Storage.NATIVE))
        model_dir.put(DOWN1, saved)
        runtime.apply(model_dir.plan("back", [DOWN1]))
        assert runtime.store.pools.usage() == usage
        assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()


def test_plan_that_runs_out_of_memory_midway_is_rejected_whole(tmp_path: Path) -> None:
    """When the second family of a plan fits nowhere, the plan is rejected whole: the first
    family's fallback buffers are freed, pools, states and outputs are as before."""
    model_dir = ModelDir.write(tmp_path / "model")
    family_f16 = 32768 + 9216 + 12288  # down as F16, gate Q4_0, up Q5_1 (native bytes)
    pools = cpu_pools(
        loaded_bytes(model_dir.first, Storage.NATIVE) + HEADROOM, host_budget=family_f16 + 1000
    )
    variants = tmp_path / "variants"
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, pools=pools)
    try:
        baseline, usage = logits(model), runtime.store.pools.usage()
        for name in (DOWN1, DOWN2):
            model_dir.put(name, model_dir.variant(name, Q.F16, variants))
        ticket = runtime.submit(model_dir.plan("both", [DOWN1, DOWN2]))
        assert ticket.wait(WAIT_S) is PlanState.REJECTED
        assert not ticket.stale
        assert "host" in " ".join(r.reason for r in ticket.reasons)
        assert runtime.store.pools.usage() == usage
        assert slot_states(runtime, tuple(runtime.store.slots)) == {SlotState.ON_ORIGINAL}
        assert runtime.weight_version == 0
        assert torch.equal(logits(model), baseline)
        ticket = runtime.apply(model_dir.plan("one", [DOWN1]))  # one family alone does fit
        assert slot_states(runtime, FAMILY1) == {SlotState.FALLBACK_CPU}
    finally:
        runtime.close()


def test_plan_of_several_families_fits_via_fallback(tmp_path: Path) -> None:
    """With an unbounded host pool the same two-family plan commits: both families fall back
    together and the outputs equal a fresh load; restoring both returns to the baseline."""
    model_dir = ModelDir.write(tmp_path / "model")
    pools = cpu_pools(loaded_bytes(model_dir.first, Storage.NATIVE) + HEADROOM)
    saved = {n: model_dir.save(n, tmp_path / "saved") for n in (DOWN1, DOWN2)}
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, pools=pools)
    try:
        baseline, usage = logits(model), runtime.store.pools.usage()
        for name in (DOWN1, DOWN2):
            model_dir.put(name, model_dir.variant(name, Q.F16, tmp_path / "variants"))
        runtime.apply(model_dir.plan("both", [DOWN1, DOWN2]))
        assert runtime.store.state_counts()[SlotState.FALLBACK_CPU.value] == 6
        assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=Storage.NATIVE))
        for name, path in saved.items():
            model_dir.put(name, path)
        runtime.apply(model_dir.plan("back", [DOWN1, DOWN2]))
        assert runtime.store.pools.usage() == usage
        assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()


def test_memory_freed_by_a_plan_is_credit_for_all_its_allocations(tmp_path: Path) -> None:
    """Bytes a plan frees count for every allocation of that plan: after a reattachment frees
    8 KiB, two 4 KiB growths both fit at home (neither falls back)."""
    model_dir = ModelDir.write(tmp_path / "model")
    a, b, c = (f"blk.{i}.attn_k.weight" for i in range(3))  # Q4_1 (64, 32): 1280 bytes
    pools = cpu_pools(loaded_bytes(model_dir.first, Storage.NATIVE) + 8192 + 100)
    saved = model_dir.save(a, tmp_path / "saved")
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, pools=pools)
    try:
        usage = runtime.store.pools.usage()
        model_dir.put(a, model_dir.variant(a, Q.F32, tmp_path / "variants"))  # 8192 bytes
        runtime.apply(model_dir.plan("a-grows", [a]))
        assert runtime.store.slots[a].state is SlotState.DETACHED
        model_dir.put(a, saved)
        for name in (b, c):
            model_dir.put(name, model_dir.variant(name, Q.F16, tmp_path / "variants"))  # 4096
        runtime.apply(model_dir.plan("swap-room", [a, b, c]))
        assert slot_states(runtime, (a,)) == {SlotState.ON_ORIGINAL}
        assert slot_states(runtime, (b, c)) == {SlotState.DETACHED}
        assert runtime.store.pools.usage() == {"dev": usage["dev"] + 8192, "host": 0}
        assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=Storage.NATIVE))
    finally:
        runtime.close()


@pytest.mark.parametrize("stable", [False, True], ids=["swap", "stable"])
def test_smaller_type_stays_in_its_full_pool_and_returns_exactly(
    tmp_path: Path, stable: bool
) -> None:
    """On a full pool, a change to a smaller type stays in the original buffer (ON_ORIGINAL, no
    fallback), equals a fresh load, and the way back restores the baseline memory and outputs."""
    model_dir = ModelDir.write(tmp_path / "model")
    pools = cpu_pools(loaded_bytes(model_dir.first, Storage.NATIVE))  # no headroom at all
    saved = model_dir.save(DOWN1, tmp_path / "saved")
    small = model_dir.variant(DOWN1, Q.Q4_0, tmp_path / "variants")
    runtime, model = open_runtime(
        model_dir.first, storage=Storage.NATIVE, pools=pools, stable_pointers=stable
    )
    try:
        baseline = logits(model)
        usage = runtime.store.pools.usage()
        for round_trip in range(3):
            model_dir.put(DOWN1, small)
            runtime.apply(model_dir.plan(f"small-{round_trip}", [DOWN1]))
            assert slot_states(runtime, FAMILY1) == {SlotState.ON_ORIGINAL}
            assert runtime.store.pools.usage() == usage
            assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=Storage.NATIVE))
            model_dir.put(DOWN1, saved)
            runtime.apply(model_dir.plan(f"back-{round_trip}", [DOWN1]))
            assert runtime.store.pools.usage() == usage
            assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()
