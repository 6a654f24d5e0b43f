"""Plans submitted from one thread while another runs batches: each batch computes with exactly
one whole plan's weights, plans apply at most once, and closing never leaves a plan half-done."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    WAIT_S,
    ModelDir,
    Q,
    fresh_logits,
    logits,
    one_thread,
    open_runtime,
)

from ggufswap.ipc import (
    PlanAcceptedEvent,
    PlanCommittedEvent,
    PlanRejectedEvent,
    PlanStagedEvent,
)
from ggufswap.runtime import DerivedTensor, PlanState, PlanTicket, Storage

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN0 = "blk.0.ffn_down_exps.weight"
GATE1 = "blk.1.ffn_gate_exps.weight"
ATTN_Q2 = "blk.2.attn_q.weight"
OUTPUT = "output.weight"
NAMES = (DOWN0, GATE1, ATTN_Q2, OUTPUT)


class BatchLoop:
    """The inference thread: commit at each boundary, run a batch, keep one output per version
    (and note any batch of a version whose output differs from that version's first)."""

    def __init__(self, runtime: object, model: torch.nn.Module) -> None:
        self.runtime = runtime
        self.model = model
        self.outputs: dict[int, torch.Tensor] = {}
        self.inconsistent: set[int] = set()
        self.errors: list[BaseException] = []
        self.batches = 0
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self.run, name="batch-loop")

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                version = self.runtime.at_batch_boundary()  # type: ignore[attr-defined]
                out = logits(self.model)  # type: ignore[arg-type]
                with self.cond:
                    first = self.outputs.setdefault(version, out)
                    if not torch.equal(first, out):
                        self.inconsistent.add(version)
                    self.batches += 1
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 (reported to the test thread)
            self.errors.append(exc)
            with self.cond:
                self.cond.notify_all()

    def ran_on(self, version: int) -> bool:
        """Wait until a batch has run on ``version``."""
        with self.cond:
            return self.cond.wait_for(lambda: version in self.outputs or self.errors, WAIT_S)


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_each_batch_runs_on_one_whole_plan(tmp_path: Path, storage: Storage) -> None:
    """Every batch's logits equal the fresh load of exactly the file set of the version it ran
    on; re-submitting a committed plan id changes nothing."""
    model_dir = ModelDir.write(tmp_path / "model")
    store = tmp_path / "variants"
    saved = {n: model_dir.save(n, tmp_path / "saved") for n in NAMES}

    def v(name: str, t: Q) -> Path:
        return model_dir.variant(name, t, store)

    states: list[Mapping[str, Path]] = [
        {DOWN0: v(DOWN0, Q.Q4_0), GATE1: v(GATE1, Q.Q8_0), ATTN_Q2: v(ATTN_Q2, Q.BF16)},
        {DOWN0: saved[DOWN0], GATE1: v(GATE1, Q.F16), OUTPUT: v(OUTPUT, Q.Q4_1)},
        {DOWN0: v(DOWN0, Q.Q5_1), ATTN_Q2: saved[ATTN_Q2], OUTPUT: v(OUTPUT, Q.Q8_0)},
        dict(saved),
        {DOWN0: v(DOWN0, Q.F16), GATE1: v(GATE1, Q.Q5_0), ATTN_Q2: v(ATTN_Q2, Q.Q4_0)},
    ]
    runtime, model = open_runtime(model_dir.first, storage=storage)
    loop = BatchLoop(runtime, model)
    files: dict[int, dict[str, Path]] = {0: dict(saved)}
    current = dict(saved)
    loop.thread.start()
    try:
        assert loop.ran_on(0)
        for k, state in enumerate(states):
            for name, source in state.items():
                model_dir.put(name, source)
            current.update(state)
            plan = model_dir.plan(f"state-{k}", state)
            ticket = runtime.submit(plan)
            assert ticket.wait(WAIT_S) is PlanState.COMMITTED, ticket.summary()
            assert ticket.weight_version == k + 1
            files[k + 1] = dict(current)
            assert loop.ran_on(k + 1), loop.errors
            again = runtime.submit(plan)
            assert again is ticket
            assert again.weight_version == k + 1
        assert loop.ran_on(len(states))
        batches = loop.batches
        with loop.cond:  # a few more batches: the re-submissions never commit anything
            assert loop.cond.wait_for(lambda: loop.batches >= batches + 3, WAIT_S)
    finally:
        loop.stop.set()
        loop.thread.join(WAIT_S)
        runtime.close()
    assert not loop.thread.is_alive()
    assert loop.errors == []
    assert runtime.weight_version == len(states)
    assert sorted(loop.outputs) == sorted(files), "a batch ran on a version no plan made"
    assert loop.inconsistent == set()
    for version, out in loop.outputs.items():
        fresh_dir = model_dir.clone(tmp_path / f"fresh-{version}", files[version])
        assert torch.equal(out, fresh_logits(fresh_dir.first, storage=storage)), version


def test_close_while_staging_rejects_the_plan_and_frees_its_buffers(tmp_path: Path) -> None:
    """close() during staging rejects that plan (and the queued ones), frees what staging
    allocated and stops the stager; a plan submitted after close() is rejected at once."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, model = open_runtime(model_dir.first, storage=Storage.DEQUANTIZED)
    baseline, usage = logits(model), runtime.store.pools.usage()
    entered, release = threading.Event(), threading.Event()

    def slow_rebuild(sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if sources[DOWN0].data_ptr() != runtime.store.weight(DOWN0).data_ptr():  # staging
            entered.set()
            release.wait(WAIT_S)
        return sources[DOWN0].sum(dim=0)

    runtime.store.register_derived(DerivedTensor("down0.summed", (DOWN0,), slow_rebuild))
    runtime.on_event(
        lambda e: release.set() if isinstance(e, PlanRejectedEvent) and e.plan_id == "b" else None
    )
    model_dir.put(DOWN0, model_dir.variant(DOWN0, Q.Q4_0, tmp_path / "variants"))
    ticket_a = runtime.submit(model_dir.plan("a", [DOWN0]))
    assert entered.wait(WAIT_S)
    model_dir.put(GATE1, model_dir.variant(GATE1, Q.Q8_0, tmp_path / "variants"))
    ticket_b = runtime.submit(model_dir.plan("b", [GATE1]))  # queued behind "a"
    closer = threading.Thread(target=runtime.close, kwargs={"timeout": WAIT_S})
    closer.start()  # rejects "b" (which releases the rebuild), then waits for the stager
    closer.join(WAIT_S * 2)
    assert not closer.is_alive()
    assert not runtime._thread.is_alive(), "the stager stopped"
    assert ticket_a.state is PlanState.REJECTED
    assert ticket_b.state is PlanState.REJECTED
    assert runtime.store.pools.usage() == usage
    late = runtime.submit(model_dir.plan("late", [GATE1]))
    assert late.state is PlanState.REJECTED
    assert "closed" in late.reasons[0].reason
    assert runtime.at_batch_boundary() == 0
    assert torch.equal(logits(model), baseline)


def test_failing_commit_callback_is_raised_after_the_commit_is_recorded(tmp_path: Path) -> None:
    """An on_commit callback that raises surfaces from at_batch_boundary, but the plan is
    committed, every callback ran, and the runtime goes on committing later plans."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, model = open_runtime(model_dir.first, storage=Storage.DEQUANTIZED)
    calls: list[int] = []

    def broken(version: int, changed: tuple[str, ...]) -> None:
        calls.append(version)
        if version == 1:
            raise RuntimeError("cache invalidation failed")

    runtime.on_commit(broken)
    runtime.on_commit(lambda version, changed: calls.append(-version))
    try:
        model_dir.put(DOWN0, model_dir.variant(DOWN0, Q.Q4_0, tmp_path / "variants"))
        ticket = runtime.submit(model_dir.plan("a", [DOWN0]))
        assert runtime.wait_staged(timeout=WAIT_S)
        with pytest.raises(RuntimeError, match="cache invalidation"):
            runtime.at_batch_boundary()
        assert ticket.state is PlanState.COMMITTED
        assert calls == [1, -1]
        model_dir.put(GATE1, model_dir.variant(GATE1, Q.Q8_0, tmp_path / "variants"))
        assert runtime.apply(model_dir.plan("b", [GATE1])).weight_version == 2
        assert torch.equal(
            logits(model), fresh_logits(model_dir.first, storage=Storage.DEQUANTIZED)
        )
    finally:
        runtime.close()


def test_plan_events_keep_their_order_when_the_commit_comes_at_once(tmp_path: Path) -> None:
    """An inference thread may commit a plan while the stager is still delivering its
    ``plan.staged`` (here the first listener holds delivery until the plan is committed):
    listeners still see accepted, staged, committed in that order, and a listener woken by
    ``plan.staged`` finds the plan ready to commit."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, _ = open_runtime(model_dir.first, storage=Storage.DEQUANTIZED)
    seen: list[type] = []
    woken = threading.Event()
    tickets: list[PlanTicket] = []

    def hold_until_committed(event: object) -> None:
        if isinstance(event, PlanStagedEvent):
            woken.set()
            deadline = time.monotonic() + WAIT_S
            while tickets[0].state is not PlanState.COMMITTED and time.monotonic() < deadline:
                time.sleep(0.001)

    runtime.on_event(hold_until_committed)
    runtime.on_event(lambda e: seen.append(type(e)))
    committed_at: list[int] = []

    def inference() -> None:
        assert woken.wait(WAIT_S)
        committed_at.append(runtime.at_batch_boundary())  # a plan.staged listener can commit

    thread = threading.Thread(target=inference)
    try:
        model_dir.put(DOWN0, model_dir.variant(DOWN0, Q.Q4_0, tmp_path / "variants"))
        thread.start()
        tickets.append(runtime.submit(model_dir.plan("a", [DOWN0])))
        thread.join(WAIT_S * 2)
        assert not thread.is_alive()
        assert committed_at == [1]
        assert tickets[0].wait(WAIT_S) is PlanState.COMMITTED
    finally:
        runtime.close()
    plan_events = [t for t in seen if t.__name__.startswith("Plan")]
    assert plan_events == [PlanAcceptedEvent, PlanStagedEvent, PlanCommittedEvent]
