"""One owner per piece of runtime state: the commit module changes slots, derived tensors and the
weight version; slot and plan moves are guarded; the runtime's errors share one base class."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from runtime_helpers import ModelDir, open_runtime

import ggufswap.config
import ggufswap.ipc
import ggufswap.runtime
from ggufswap.runtime import PlanState, PlanTicket
from ggufswap.runtime.commit import commit
from ggufswap.runtime.errors import (
    PlanStateError,
    SlotStateError,
)
from ggufswap.runtime.staged import Content, StagedOp, StagedPlan, Target

REPO = Path(__file__).resolve().parent.parent
SLOT_FIELDS = {"record", "fingerprint", "state", "active", "original", "held", "parts"}
OUTPUT = "output.weight"
NORM = "output_norm.weight"


def _writes(path: Path) -> list[str]:
    """``line: target`` of every write in ``path`` to a slot field, a store's ``weight_version``
    or ``derived_values``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if "derived_values" in ast.unparse(node.func.value):
                found.append(f"{node.lineno}: {ast.unparse(node.func)}()")
        for written in targets:
            target = written.value if isinstance(written, ast.Subscript) else written
            if not isinstance(target, ast.Attribute):
                continue
            owner = ast.unparse(target.value)
            slot_field = target.attr in SLOT_FIELDS and "slot" in owner
            store_field = target.attr in ("weight_version", "derived_values") and "store" in owner
            if slot_field or store_field:
                found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


def test_only_the_commit_module_changes_slots_derived_tensors_and_the_weight_version() -> None:
    """No module but runtime/commit.py writes a slot's fields, derived values or weight_version
    (the store itself only creates them at load)."""
    writers = {}
    for path in sorted([*REPO.glob("runtime/**/*.py"), *REPO.glob("cli/*.py")]):
        found = _writes(path)
        if found:
            writers[str(path.relative_to(REPO))] = found
    assert set(writers) == {"runtime/commit.py"}, writers


def test_a_slot_move_that_its_buffers_do_not_match_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    """A commit whose op would call a tensor FALLBACK_CPU while it stays in its original buffer
    raises SlotStateError naming the tensor and both states, and changes nothing at all."""
    model_dir = ModelDir.write(tmp_path / "m")
    runtime, _ = open_runtime(model_dir.first)
    try:
        store = runtime.store
        norm, output = store.slots[NORM], store.slots[OUTPUT]
        plan = model_dir.plan("bad", [NORM, OUTPUT])
        fine = StagedOp(norm, Content(norm.record, "0" * 32, None), Target.ORIGINAL)
        # A bug in staging: a fallback target, but no buffer in the fallback pool.
        bad = StagedOp(
            output, Content(output.record, output.fingerprint, None), Target.PRIVATE_FALLBACK
        )
        before = (store.weight_version, norm.fingerprint, output.state, output.active)
        with pytest.raises(SlotStateError) as raised:
            commit(store, StagedPlan(plan, [fine, bad]))
        assert str(raised.value).startswith(
            f"tensor {OUTPUT}: cannot go from ON_ORIGINAL to FALLBACK_CPU: "
        ), raised.value
        assert (store.weight_version, norm.fingerprint, output.state, output.active) == before
    finally:
        runtime.close()


def test_a_followed_ticket_reports_each_state_once_in_order(tmp_path: Path) -> None:
    """A follower sees the state at follow time, then every move once; an illegal move raises
    PlanStateError naming both states; a follow after the outcome sees just the outcome."""
    model_dir = ModelDir.write(tmp_path / "m")
    ticket = PlanTicket(model_dir.plan("p", [OUTPUT]))
    seen: list[PlanState] = []
    ticket.follow(lambda t: seen.append(t.state))
    for state in (PlanState.STAGING, PlanState.STAGED, PlanState.COMMITTED):
        ticket.move(state)
    assert seen == [PlanState.RECEIVED, PlanState.STAGING, PlanState.STAGED, PlanState.COMMITTED]
    with pytest.raises(PlanStateError, match="plan p: cannot go from COMMITTED to STAGING"):
        ticket.move(PlanState.STAGING)
    late: list[PlanState] = []
    ticket.follow(lambda t: late.append(t.state))
    assert late == [PlanState.COMMITTED]
    assert ticket.wait(0) is PlanState.COMMITTED


def test_one_type_per_idea_across_the_packages() -> None:
    """The runtime's SlotState and Reason are the wire contract's; its Storage is the config's."""
    assert ggufswap.runtime.SlotState is ggufswap.ipc.SlotState
    assert ggufswap.runtime.Reason is ggufswap.ipc.Reason
    assert ggufswap.runtime.Storage is ggufswap.config.Storage
