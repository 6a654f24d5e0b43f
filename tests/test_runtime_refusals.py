"""Plans the runtime cannot apply correctly are refused whole, with a reason naming the tensor,
and the served model's outputs stay exactly as they were."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_helpers import (
    WAIT_S,
    ModelDir,
    Q,
    logits,
    one_thread,
    open_runtime,
)

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import (
    DerivedTensor,
    HotSwapRuntime,
    PlanRejected,
    PlanState,
    PlanTicket,
    Storage,
)
from ggufswap.runtime.models import Transformer
from ggufswap.shards import TensorRecord, read_header
from ggufswap.shards.writer import RawTensor, write_gguf

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN1 = "blk.1.ffn_down_exps.weight"  # Q8_0, ne (64, 64, 4)
ATTN_K0 = "blk.0.attn_k.weight"  # Q4_1, ne (64, 32)


def lone_tensor_file(path: Path, name: str, ggml_type: Q, ne: tuple[int, ...]) -> TensorRecord:
    """Write a GGUF file holding one tensor of arbitrary bytes; returns its record."""
    from gguf import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    nbytes = int(np.prod(ne)) // block_size * type_size
    data = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    write_gguf(path, n_kv=0, kv_bytes=b"", tensors=[RawTensor(name, ggml_type, ne, data)])
    return read_header(path).tensor_map()[name]


def rejected(runtime: HotSwapRuntime, plan: Plan) -> PlanTicket:
    """Submit ``plan``, let the runtime run batch boundaries, and return its (final) ticket."""
    ticket = runtime.submit(plan)
    while not ticket.state.final:
        runtime.wait_staged(timeout=WAIT_S)
        runtime.at_batch_boundary()
    assert ticket.state is PlanState.REJECTED, ticket.summary()
    return ticket


def reasons_for(ticket: PlanTicket) -> Mapping[str, str]:
    return {r.tensor: r.reason for r in ticket.reasons}


@pytest.fixture
def served(tmp_path: Path) -> tuple[ModelDir, HotSwapRuntime, Transformer, torch.Tensor]:
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, model = open_runtime(model_dir.first, storage=Storage.DEQUANTIZED, strict=True)
    yield model_dir, runtime, model, logits(model)
    runtime.close()


Served = tuple[ModelDir, HotSwapRuntime, Transformer, torch.Tensor]


def assert_unchanged(runtime: HotSwapRuntime, model: Transformer, baseline: torch.Tensor) -> None:
    assert runtime.weight_version == 0
    assert torch.equal(logits(model), baseline)


def test_shape_change_is_refused(served: Served) -> None:
    """A file holding the tensor with another logical shape is refused, naming the shapes."""
    model_dir, runtime, model, baseline = served
    record = lone_tensor_file(model_dir.root / "wide.gguf", ATTN_K0, Q.Q8_0, (64, 64))
    ticket = rejected(runtime, Plan("shape", "", (Job(record),)))
    reason = reasons_for(ticket)[ATTN_K0]
    assert "[64, 64]" in reason
    assert "[32, 64]" in reason
    assert "restart" in reason
    assert not ticket.stale
    assert_unchanged(runtime, model, baseline)


def test_type_without_kernel_is_refused_when_strict(served: Served) -> None:
    """A Q8_1 tensor (no torch kernel) is refused under strict mode, naming the type."""
    model_dir, runtime, model, baseline = served
    record = lone_tensor_file(model_dir.root / "q81.gguf", ATTN_K0, Q.Q8_1, (64, 32))
    ticket = rejected(runtime, Plan("q8_1", "", (Job(record),)))
    assert "Q8_1" in reasons_for(ticket)[ATTN_K0]
    assert_unchanged(runtime, model, baseline)


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_undecodable_type_is_refused_even_when_not_strict(tmp_path: Path, storage: Storage) -> None:
    """A type nothing can dequantize (Q8_1) is refused without strict mode too, in both storage
    modes (native storage would otherwise commit bytes that every later batch fails on)."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, model = open_runtime(model_dir.first, storage=storage, strict=False)
    try:
        baseline = logits(model)
        record = lone_tensor_file(model_dir.root / "q81.gguf", ATTN_K0, Q.Q8_1, (64, 32))
        ticket = rejected(runtime, Plan("q8_1", "", (Job(record),)))
        assert "Q8_1" in reasons_for(ticket)[ATTN_K0]
        assert_unchanged(runtime, model, baseline)
    finally:
        runtime.close()


def test_paired_kernel_type_from_lone_file_is_accepted(served: Served) -> None:
    """Against over-rejecting: a lone file with the right shape and a kernel type is applied."""
    model_dir, runtime, model, baseline = served
    record = lone_tensor_file(model_dir.root / "q5.gguf", ATTN_K0, Q.Q8_0, (64, 32))
    ticket = runtime.apply(Plan("ok", "", (Job(record),)))
    assert ticket.state is PlanState.COMMITTED
    assert ticket.changed == (ATTN_K0,)
    assert not torch.equal(logits(model), baseline)


def test_path_outside_allowed_roots_is_refused(served: Served, tmp_path: Path) -> None:
    """A file outside the allowed roots, directly or through a symlink inside the root, is
    refused with the resolved path named."""
    model_dir, runtime, model, baseline = served
    outside = tmp_path / "outside"
    outside.mkdir()
    record = lone_tensor_file(outside / "k.gguf", ATTN_K0, Q.Q8_0, (64, 32))
    link = model_dir.root / "link.gguf"
    os.symlink(outside / "k.gguf", link)
    via_link = dataclasses.replace(record, path=str(link))
    linked_dir = model_dir.root / "sub"
    os.symlink(outside, linked_dir)
    via_dir = dataclasses.replace(record, path=str(linked_dir / "k.gguf"))
    for i, rec in enumerate([record, via_link, via_dir]):
        ticket = rejected(runtime, Plan(f"outside-{i}", "", (Job(rec),)))
        reason = reasons_for(ticket)[ATTN_K0]
        assert "outside the allowed roots" in reason
        assert str(outside) in reason
    assert_unchanged(runtime, model, baseline)


def test_path_that_names_no_file_is_refused_and_the_plan_ends(served: Served) -> None:
    """A path with an embedded NUL (which no file can have) is refused with a reason, and the
    plan's ticket is final: resending the same plan id gets the same refusal, never a plan that
    stays accepted forever; a valid plan still commits afterwards."""
    model_dir, runtime, model, baseline = served
    record = lone_tensor_file(model_dir.root / "k.gguf", ATTN_K0, Q.Q8_0, (64, 32))
    nul = dataclasses.replace(record, path=record.path + "\x00")
    plan = Plan("nul-path", "", (Job(nul),))
    ticket = rejected(runtime, plan)
    assert "names no file" in reasons_for(ticket)[ATTN_K0]
    again = runtime.submit(plan)
    assert again.state is PlanState.REJECTED
    assert_unchanged(runtime, model, baseline)
    assert runtime.apply(Plan("valid", "", (Job(record),))).state is PlanState.COMMITTED


def test_file_replaced_before_submit_is_stale(served: Served, tmp_path: Path) -> None:
    """A plan whose file was replaced after planning is rejected as stale at submit."""
    model_dir, runtime, model, baseline = served
    variant = model_dir.variant(DOWN1, Q.Q4_0, tmp_path / "variants")
    plan = model_dir.plan("old", [DOWN1])
    model_dir.put(DOWN1, variant)
    ticket = rejected(runtime, plan)
    assert ticket.stale
    assert "stale" in reasons_for(ticket)[DOWN1]
    assert_unchanged(runtime, model, baseline)


def test_file_replaced_between_validation_and_staging_is_stale(
    served: Served, tmp_path: Path
) -> None:
    """A file replaced after the plan passed validation but before the stager read it makes the
    whole plan stale (no job of it applied); the plan staged before it still commits."""
    model_dir, runtime, model, baseline = served
    variants = tmp_path / "variants"
    first = model_dir.variant(ATTN_K0, Q.Q8_0, variants)
    down = model_dir.variant(DOWN1, Q.Q4_0, variants)
    model_dir.put(ATTN_K0, first)
    ticket_a = runtime.submit(model_dir.plan("a", [ATTN_K0]))
    assert runtime.wait_staged(timeout=WAIT_S)  # the stager now holds "a" until it commits
    model_dir.put(DOWN1, down)
    plan_b = model_dir.plan("b", [DOWN1, ATTN_K0])  # two jobs; only one goes stale
    ticket_b = runtime.submit(plan_b)
    assert ticket_b.state is PlanState.RECEIVED  # validated, queued behind "a"
    model_dir.put(DOWN1, model_dir.variant(DOWN1, Q.Q5_0, variants))  # replaced again
    after_a = None
    while not ticket_b.state.final:
        runtime.wait_staged(timeout=WAIT_S)
        runtime.at_batch_boundary()
        after_a = after_a if after_a is not None else logits(model)
    assert ticket_a.state is PlanState.COMMITTED
    assert runtime.weight_version == 1
    assert ticket_b.state is PlanState.REJECTED
    assert ticket_b.stale
    assert "identity changed" in reasons_for(ticket_b)[DOWN1]
    assert torch.equal(logits(model), after_a)
    assert not torch.equal(after_a, baseline)


def test_fingerprint_mismatch_is_stale(served: Served) -> None:
    """A job whose bytes do not hash to the plan's fingerprint is stale; nothing is applied."""
    model_dir, runtime, model, baseline = served
    record = model_dir.records()[DOWN1]
    ticket = rejected(runtime, Plan("fp", "", (Job(record, fingerprint="0" * 32),)))
    assert ticket.stale
    assert "fingerprint" in reasons_for(ticket)[DOWN1]
    assert_unchanged(runtime, model, baseline)


def test_every_failing_tensor_is_listed(served: Served) -> None:
    """A plan with several problems lists each (unknown tensor, duplicate, wrong model)."""
    model_dir, runtime, model, baseline = served
    records = model_dir.records()
    ghost = dataclasses.replace(records[DOWN1], name="blk.9.ffn_down_exps.weight")
    plan = Plan("many", "other-model", (Job(records[DOWN1]), Job(records[DOWN1]), Job(ghost)))
    ticket = rejected(runtime, plan)
    found = reasons_for(ticket)
    assert "twice" in found[DOWN1]
    assert "no tensor" in found["blk.9.ffn_down_exps.weight"]
    assert "other-model" in found["*"]
    with pytest.raises(PlanRejected, match="twice"):
        runtime.apply(plan)
    assert_unchanged(runtime, model, baseline)


def test_unrebuildable_derived_tensor_refuses_its_sources(served: Served, tmp_path: Path) -> None:
    """Changing a source of a derived tensor that cannot be rebuilt is refused, naming both."""
    model_dir, runtime, model, baseline = served
    value = runtime.store.weight(DOWN1).sum(dim=0)
    runtime.store.register_derived(
        DerivedTensor("down1.summed", (DOWN1,), rebuild=None, why_not="fused by the server"),
        value=value.clone(),
    )
    model_dir.put(DOWN1, model_dir.variant(DOWN1, Q.Q4_0, tmp_path / "variants"))
    ticket = rejected(runtime, model_dir.plan("derived", [DOWN1]))
    reason = reasons_for(ticket)[DOWN1]
    assert "down1.summed" in reason
    assert "fused by the server" in reason
    assert torch.equal(runtime.store.weight("down1.summed"), value)
    assert_unchanged(runtime, model, baseline)


def test_rebuildable_derived_tensor_is_rebuilt_in_the_same_commit(
    served: Served, tmp_path: Path
) -> None:
    """A derived tensor is rebuilt from the new sources and becomes visible in the same commit
    as they do (one weight version), also when only one of its sources changes."""
    model_dir, runtime, model, baseline = served
    gate, up = "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"

    def fuse(sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([sources[gate], sources[up]], dim=1)  # [E, 2*F, D]

    runtime.store.register_derived(DerivedTensor("blk.1.ffn_gate_up.fused", (gate, up), fuse))
    seen: list[tuple[int, bool]] = []

    def on_commit(version: int, changed: tuple[str, ...]) -> None:
        current = {n: runtime.store.weight(n) for n in (gate, up)}
        seen.append(
            (version, torch.equal(runtime.store.weight("blk.1.ffn_gate_up.fused"), fuse(current)))
        )

    runtime.on_commit(on_commit)
    before = runtime.store.weight("blk.1.ffn_gate_up.fused").clone()
    model_dir.put(up, model_dir.variant(up, Q.Q4_0, tmp_path / "variants"))
    ticket = runtime.apply(model_dir.plan("up", [up]))
    assert ticket.changed == (up,)
    assert runtime.weight_version == 1
    assert seen == [(1, True)]
    fused = runtime.store.weight("blk.1.ffn_gate_up.fused")
    assert not torch.equal(fused, before)
    assert torch.equal(
        fused, fuse({gate: runtime.store.weight(gate), up: runtime.store.weight(up)})
    )
    assert not torch.equal(logits(model), baseline)


def test_byte_identical_file_changes_nothing(served: Served, tmp_path: Path) -> None:
    """A source re-written with byte-identical content (new inode) commits without a new weight
    version and without rebuilding the derived tensors it feeds."""
    model_dir, runtime, model, baseline = served
    calls: list[int] = []

    def rebuild(sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
        calls.append(1)
        return sources[DOWN1] * 2

    runtime.store.register_derived(DerivedTensor("down1.doubled", (DOWN1,), rebuild))
    saved = model_dir.save(DOWN1, tmp_path / "saved")
    inode = model_dir.shard_of(DOWN1).stat().st_ino
    model_dir.put(DOWN1, saved)
    assert model_dir.shard_of(DOWN1).stat().st_ino != inode
    ticket = runtime.apply(model_dir.plan("same", [DOWN1]))
    assert ticket.state is PlanState.COMMITTED
    assert ticket.changed == ()
    assert runtime.store.slots[DOWN1].record == model_dir.records()[DOWN1]
    assert calls == [1]  # built once at registration, not rebuilt
    assert_unchanged(runtime, model, baseline)
