"""Weight updates asked for over HTTP: a shard set (or some of its tensors) read from disk and
committed as one plan, as SGLang's ``POST /update_weights_from_disk`` does.

The agent stays the default trigger (it watches the files and plans by itself); this is for a
client that wants to say *when*. The shard set is read with the same reader and diffed with the
same code as the agent's (``shards.diff``), against what the runtime has loaded: every tensor
whose file record differs is reloaded, or exactly the ``tensors`` named (reloaded even when their
record is equal: a write the identity cannot see). The plan goes through
:meth:`HotSwapRuntime.submit` like any other (validation, allowed roots, staging, commit between
requests), so every refusal names its tensor.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime.plans import PlanState
from ggufswap.runtime.serving.errors import bad_request
from ggufswap.shards import ShardError, open_shard_set
from ggufswap.shards.diff import ChangeKind, diff_tables

if TYPE_CHECKING:
    from ggufswap.runtime.engine import HotSwapRuntime

DEFAULT_UPDATE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class UpdateRequest:
    model_path: str | None  # a member of the shard set; None: the served model's own files
    tensors: tuple[str, ...] | None  # None: every tensor whose record changed
    timeout_s: float


def parse_update(body: object) -> UpdateRequest:
    """``{"model_path"?, "tensors"?, "timeout_s"?}``; raise a 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, found {type(body).__name__}")
    unknown = sorted(set(body) - {"model_path", "tensors", "timeout_s"})
    if unknown:
        raise bad_request(
            f"unknown parameter {unknown[0]!r} (accepted: model_path, tensors, timeout_s)",
            "unknown_parameter",
            param=unknown[0],
        )
    path, tensors, timeout = body.get("model_path"), body.get("tensors"), body.get("timeout_s")
    problems = []
    if path is not None and (not isinstance(path, str) or not path):
        problems.append("'model_path' must be the path of a GGUF file (any shard of the set)")
    if tensors is not None and (
        not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors)
    ):
        problems.append("'tensors' must be a list of tensor names")
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0
    ):
        problems.append("'timeout_s' must be a number > 0")
    if problems:
        raise bad_request("; ".join(problems))
    return UpdateRequest(
        model_path=path,
        tensors=None if tensors is None else tuple(tensors),
        timeout_s=float(timeout) if timeout is not None else DEFAULT_UPDATE_TIMEOUT_S,
    )


def build_plan(runtime: HotSwapRuntime, request: UpdateRequest) -> Plan | None:
    """The plan that makes the runtime hold what ``request`` names; None when nothing differs."""
    path = request.model_path
    if path is None:
        assert runtime.shards is not None, "open() always records the shard set"
        path = runtime.shards.first.path
    try:
        shard_set = open_shard_set(os.path.abspath(path))
    except (ShardError, OSError) as exc:
        raise bad_request(
            f"cannot read {path}: {exc}", "bad_shard_set", param="model_path"
        ) from None
    on_disk = shard_set.tensors
    loaded = {name: slot.record for name, slot in runtime.store.slots.items()}
    names = _selected(request.tensors, on_disk, loaded)
    jobs = [Job(on_disk[name]) for name in names]
    if not jobs:
        return None
    return Plan(f"http-{uuid.uuid4().hex}", runtime.model_name, tuple(jobs))


def _selected(
    named: Sequence[str] | None, on_disk: Mapping[str, Any], loaded: Mapping[str, Any]
) -> list[str]:
    """The tensors to reload: ``named`` (each must exist on both sides), else every tensor whose
    record changed; a tensor added, removed or reshaped is refused as the runtime would."""
    if named is not None:
        missing = [n for n in named if n not in on_disk or n not in loaded]
        if missing:
            raise bad_request(
                f"{len(missing)} tensor(s) are not in both the shard set and the served model: "
                f"{', '.join(missing[:10])}",
                "unknown_tensor",
                param="tensors",
            )
        return sorted(set(named))
    names, refused = [], []
    for change in diff_tables(loaded, on_disk):
        if change.kind is ChangeKind.MODIFIED:
            names.append(change.name)
        else:
            refused.append(f"{change.name}: {change.kind.value}")
    if refused:
        raise bad_request(
            "the shard set does not have the served model's tensors: "
            + "; ".join(refused[:10])
            + ("; ..." if len(refused) > 10 else ""),
            "incompatible_shard_set",
            param="model_path",
        )
    return names


def apply_update(runtime: HotSwapRuntime, request: UpdateRequest) -> dict[str, Any]:
    """Build, submit and wait for the plan (blocking: call it off the event loop); the outcome
    in the reply's shape."""
    plan = build_plan(runtime, request)
    if plan is None:
        return {
            "success": True,
            "outcome": "unchanged",
            "message": "the served weights already equal the files",
            "plan_id": None,
            "weight_version": runtime.weight_version,
            "tensors": [],
            "changed": [],
            "reasons": [],
        }
    ticket = runtime.submit(plan)
    state = ticket.wait(request.timeout_s)
    outcome = {PlanState.COMMITTED: "committed", PlanState.REJECTED: "rejected"}.get(
        state, "pending"
    )
    reasons = [str(r) for r in ticket.reasons]
    message = {
        "committed": f"committed as weight_version {ticket.weight_version}",
        "rejected": "; ".join(reasons),
        "pending": f"not committed within {request.timeout_s:g} s; it still may be",
    }[outcome]
    return {
        "success": outcome == "committed",
        "outcome": outcome,
        "message": message,
        "plan_id": plan.plan_id,
        "weight_version": ticket.weight_version
        if outcome == "committed"
        else runtime.weight_version,
        "tensors": list(plan.names()),
        "changed": list(ticket.changed),
        "reasons": reasons,
    }
