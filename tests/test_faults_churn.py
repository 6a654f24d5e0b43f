"""Serving under churn, and device memory running out in the middle of staging: batches never
fail, each equals a fresh load of the version it reports, and a plan is never half-applied."""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from reliability import record
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
)

from ggufswap.runtime import HotSwapRuntime, PlanState, Pool, SlotState, Storage
from ggufswap.runtime.pools import Buffer
from ggufswap.runtime.serving.serve import logits_digest

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

# make test runs the churn over CHURN_SWAPS plans, make soak (the slow tier) over SOAK_SWAPS.
CHURN_SWAPS = 60
SOAK_SWAPS = 200
HEADROOM = 12288  # dev bytes free after the load: an F16 expert tensor (32 KiB) falls back
DOWN1 = "blk.1.ffn_down_exps.weight"  # Q8_0
GATE2 = "blk.2.ffn_gate_exps.weight"  # Q4_0
ATTN_K0 = "blk.0.attn_k.weight"  # Q4_1, 1280 bytes: grows into a private buffer at home
ATTN_Q3 = "blk.3.attn_q.weight"  # F16
OUTPUT = "output.weight"  # F16
SAVED = "saved"
# Per tensor, the states churn picks from (besides the original, SAVED): family fallbacks,
# detachments, smaller types that stay in the original buffer.
CHOICES: dict[str, tuple[str, ...]] = {
    DOWN1: (Q.F16.name, Q.Q4_0.name),
    GATE2: (Q.Q8_0.name, Q.F16.name),
    ATTN_K0: (Q.Q8_0.name, Q.F16.name),
    ATTN_Q3: (Q.Q4_0.name, Q.F32.name),
    OUTPUT: (Q.Q8_0.name, Q.Q4_1.name),
}


@dataclass
class Server:
    """The inference thread: commits at every boundary and runs batches without pause, keeping
    the digest of every batch's logits under the version it ran on."""

    runtime: HotSwapRuntime
    model: torch.nn.Module
    digests: dict[int, Counter[str]] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    batches: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self.run, name="churn-server")

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                version = self.runtime.at_batch_boundary()
                digest = logits_digest(logits(self.model))  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001 (a failed batch, reported below)
                self.errors.append(exc)
                continue
            self.digests.setdefault(version, Counter())[digest] += 1
            self.batches += 1

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the serving thread did not stop"


@pytest.mark.parametrize("swaps", [CHURN_SWAPS, pytest.param(SOAK_SWAPS, marks=pytest.mark.slow)])
def test_serving_never_fails_and_matches_fresh_loads_through_swaps(
    tmp_path: Path, swaps: int
) -> None:
    """A loop serves batches without pause while plans (60, or 200 in the slow tier) apply type
    changes, restores, MoE family fallbacks and reattachments: no batch fails, every batch equals
    a fresh load of the files of the version it reports, and the final restore returns memory to
    its baseline."""
    model_dir = ModelDir.write(tmp_path / "model")
    storage = Storage.NATIVE
    pools = cpu_pools(loaded_bytes(model_dir.first, storage) + HEADROOM)
    variants = tmp_path / "variants"
    sources = {
        name: {SAVED: model_dir.save(name, tmp_path / "saved")}
        | {t: model_dir.variant(name, Q[t], variants) for t in types}
        for name, types in CHOICES.items()
    }
    runtime, model = open_runtime(model_dir.first, storage=storage, pools=pools)
    events: Counter[str] = Counter()
    runtime.on_event(lambda event: events.update([event.topic.value]))
    baseline_usage = runtime.store.pools.usage()
    rng = random.Random(6)
    current = dict.fromkeys(CHOICES, SAVED)
    state_of: dict[int, tuple[tuple[str, str], ...]] = {0: tuple(sorted(current.items()))}
    fresh: dict[tuple[tuple[str, str], ...], str] = {}
    kinds: Counter[str] = Counter()

    def fresh_digest() -> str:
        return logits_digest(fresh_logits(model_dir.first, storage=storage))

    fresh[state_of[0]] = fresh_digest()
    try:
        with Server(runtime, model) as server:
            for step in range(swaps + 1):
                if step < swaps:
                    names = rng.sample(sorted(CHOICES), rng.choice((1, 1, 2, 3)))
                    changes = {
                        n: rng.choice([s for s in (SAVED, *CHOICES[n]) if s != current[n]])
                        for n in names
                    }
                else:  # finally everything back to the original files
                    changes = {n: SAVED for n, s in current.items() if s != SAVED}
                for name, state in changes.items():
                    model_dir.put(name, sources[name][state])
                    kinds["restore" if state == SAVED else "type change"] += 1
                current.update(changes)
                ticket = runtime.submit(model_dir.plan(f"churn-{step}", changes))
                assert ticket.wait(WAIT_S) is PlanState.COMMITTED, ticket.summary()
                assert ticket.weight_version == step + 1, ticket.summary()
                key = tuple(sorted(current.items()))
                state_of[step + 1] = key
                if key not in fresh:
                    fresh[key] = fresh_digest()
    finally:
        runtime.close()
    assert server.errors == [], server.errors[:3]
    assert runtime.weight_version == swaps + 1
    wrong = {v: sorted(d) for v, d in server.digests.items() if set(d) != {fresh[state_of[v]]}}
    assert wrong == {}, f"batches that differ from a fresh load of their version: {wrong}"
    assert len(server.digests) > swaps // 2, "batches ran on most versions"
    assert events["tensor.fallback"] > 0, events
    assert events["tensor.reattached"] > 0, events
    assert runtime.store.pools.usage() == baseline_usage
    assert set(runtime.store.state_counts()) <= {SlotState.ON_ORIGINAL.value} or all(
        n == 0 for s, n in runtime.store.state_counts().items() if s != SlotState.ON_ORIGINAL.value
    )
    record(
        "faults",
        "serving under churn: type changes, restores, MoE family fallbacks, reattachments",
        tries=swaps + 1,
        outcome=f"{server.batches} batches, 0 failed; each equals a fresh load of its version; "
        "memory back at baseline",
        test="test_faults_churn::test_serving_never_fails_and_matches_fresh_loads",
    )


@dataclass
class Squeeze:
    """Another tenant of the device: at the ``at``-th allocation after ``armed`` it takes every
    free byte of ``target`` (default: the pool being allocated from), just before staging's own
    allocation."""

    at: int
    target: Pool | None = None
    armed: bool = False
    count: int = 0
    taken: list[Buffer] = field(default_factory=list)

    def before_allocation(self, pool: Pool) -> None:
        if not self.armed:
            return
        self.count += 1
        victim = self.target or pool
        if self.count == self.at and victim.free:
            self.taken.append(Pool.allocate(victim, victim.free, torch.uint8))

    def release(self) -> None:
        for buffer in self.taken:
            buffer.release()


@dataclass(eq=False)
class SharedPool(Pool):
    """A budgeted pool shared with a :class:`Squeeze` tenant."""

    squeeze: Squeeze | None = None

    def allocate(self, numel: int, dtype: torch.dtype, *, credit: int = 0) -> Buffer:
        if self.squeeze is not None:
            self.squeeze.before_allocation(self)
        return super().allocate(numel, dtype, credit=credit)


DOWN2 = "blk.2.ffn_down_exps.weight"
ATTN_K1 = "blk.1.attn_k.weight"
OOM_PLAN = {DOWN1: Q.F16, DOWN2: Q.F16, ATTN_K0: Q.F16, ATTN_K1: Q.F16, ATTN_Q3: Q.F32}


@pytest.mark.parametrize("victim", ["allocating", "dev"])
def test_memory_exhausted_midway_through_staging_fits_via_fallback_or_rejects_whole(
    tmp_path: Path, victim: str
) -> None:
    """At every allocation of a five-tensor plan in turn, another tenant exhausts a pool (the one
    being allocated from, or the device pool): the plan either commits (falling back where it
    must) with outputs equal to a fresh load, or is rejected whole with memory, states and
    outputs as before; once the tenant frees its memory the plan applies."""
    model_dir = ModelDir.write(tmp_path / "model")
    storage = Storage.NATIVE
    dev_budget = loaded_bytes(model_dir.first, storage) + 3 * 4096
    host_budget = 2 * (32768 + 9216 + 12288) + 16384 + 2 * 4096  # every tensor can fall back
    saved = {n: model_dir.save(n, tmp_path / "saved") for n in OOM_PLAN}
    changed = {n: model_dir.variant(n, t, tmp_path / "variants") for n, t in OOM_PLAN.items()}
    for name, path in changed.items():
        model_dir.put(name, path)
    expected = fresh_logits(model_dir.first, storage=storage)
    allocations = 0
    outcomes: Counter[str] = Counter()
    trip_at = 0  # 0: no squeeze, counts the plan's allocations
    while trip_at <= allocations:
        for name, path in saved.items():
            model_dir.put(name, path)
        squeeze = Squeeze(at=trip_at)
        pools: list[Pool] = [
            SharedPool("dev", torch.device("cpu"), budget=dev_budget, squeeze=squeeze),
            SharedPool("host", torch.device("cpu"), budget=host_budget, squeeze=squeeze),
        ]
        squeeze.target = pools[0] if victim == "dev" else None
        runtime, model = open_runtime(model_dir.first, storage=storage, pools=pools)
        try:
            records = {n: s.record for n, s in runtime.store.slots.items()}
            baseline, usage = logits(model), runtime.store.pools.usage()
            for name, path in changed.items():
                model_dir.put(name, path)
            squeeze.armed = True
            ticket = runtime.submit(model_dir.plan(f"oom-{trip_at}", OOM_PLAN))
            runtime.wait_staged(WAIT_S)
            runtime.at_batch_boundary()  # commits the plan if it staged
            state = ticket.wait(WAIT_S)
            squeeze.armed = False
            if trip_at == 0:
                assert state is PlanState.COMMITTED, ticket.summary()
                allocations = squeeze.count
                assert allocations >= 5, f"the plan made only {allocations} allocations"
            taken = sum(b.nbytes for b in squeeze.taken)
            if state is PlanState.REJECTED:
                outcomes["rejected whole"] += 1
                assert not ticket.stale, ticket.summary()
                after = runtime.store.pools.usage()
                assert sum(after.values()) == sum(usage.values()) + taken, (after, usage)
                assert runtime.weight_version == 0
                assert {s.state for s in runtime.store.slots.values()} == {SlotState.ON_ORIGINAL}
                assert {n: s.record for n, s in runtime.store.slots.items()} == records
                assert torch.equal(logits(model), baseline), "a half-applied plan"
                squeeze.release()
                runtime.apply(model_dir.plan(f"oom-{trip_at}-again", OOM_PLAN))
            else:
                assert state is PlanState.COMMITTED, ticket.summary()
                if trip_at:
                    outcomes["committed, squeezed" if taken else "committed"] += 1
            runtime.at_batch_boundary()
            assert runtime.weight_version == 1
            assert torch.equal(logits(model), expected)
        finally:
            runtime.close()
        trip_at += 1
    if victim == "allocating":  # the host squeezed too: nothing left to fall back to
        assert outcomes["rejected whole"] > 0, outcomes
    else:  # the device squeezed: every unit still fits the host (first_fit), so each plan commits
        assert outcomes["rejected whole"] == 0, outcomes
        assert outcomes["committed, squeezed"] > 0, outcomes
    record(
        "faults",
        f"memory exhausted ({victim} pool) at each allocation of a five-tensor plan in turn",
        tries=allocations,
        outcome=", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
        + "; never half-applied; applies once memory is back",
        test="test_faults_churn::test_memory_exhausted_midway_through_staging",
    )
