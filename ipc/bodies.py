"""The typed bodies of the messages but ``plan`` (:mod:`ggufswap.ipc.plan`), each a frozen
record with its readers from the wire and writers to it.

A reader refuses a body that does not match the schema with a ``MalformedMessage`` naming the
field; :mod:`ggufswap.ipc.schema` runs the reader of each message's type once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ggufswap.ipc import _check as c
from ggufswap.ipc.errors import MalformedMessage
from ggufswap.ipc.messages import ErrorCode, Fields, Process, SlotState
from ggufswap.ipc.plan import fingerprint_from_wire, record_fast, record_fields, record_from_wire
from ggufswap.shards.records import TensorRecord

_SLOTS: Final = {slot.value: slot for slot in SlotState}
# The fingerprint a runtime reports for a tensor out of service (its bytes changed outside any
# commit: runtime/integrity.py): not a digest, so equal to no content; an agent plans it.
LOST_FINGERPRINT: Final = "lost"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One loaded tensor as the runtime reports it: where it came from and where it lives."""

    record: TensorRecord
    fingerprint: str | None
    slot: SlotState


@dataclass(frozen=True, slots=True)
class RuntimeState:
    """The body of ``state_reply``: what the runtime has loaded, at which weight version.

    ``instance`` names the runtime's weight history: versions of two instances are unrelated
    (None from a runtime that answers no deltas). A delta (``since`` set) holds only the tensors
    whose slots changed after weight version ``since``, to apply over the full state read then.
    """

    model: str
    weight_version: int
    tensors: tuple[TensorEntry, ...]
    instance: str | None = None
    since: int | None = None
    events: str | None = None  # the runtime's PUB endpoint; None when it publishes none

    def by_name(self) -> dict[str, TensorEntry]:
        return {entry.record.name: entry for entry in self.tensors}


@dataclass(frozen=True, slots=True)
class StateRequest:
    """The body of ``state``: the full state, or with ``since`` (a weight version the client
    holds, read from runtime ``instance``) only what changed after it."""

    since: int | None = None
    instance: str | None = None


def state_request_to_wire(body: StateRequest) -> dict[str, Any]:
    if body.since is None:
        return {}
    return {Fields.SINCE: body.since, Fields.INSTANCE: body.instance}


def state_request_from_wire(d: object) -> StateRequest:
    m = c.require_map(d, "state")
    since = m.get(Fields.SINCE)
    if since is None:
        return StateRequest()
    if Fields.INSTANCE not in m:
        raise MalformedMessage(
            f"field {Fields.INSTANCE!r}: missing; a request with {Fields.SINCE!r} names the "
            f"runtime instance its weight version came from (state_reply.{Fields.INSTANCE})"
        )
    return StateRequest(
        since=c.as_int(since, Fields.SINCE, minimum=0),
        instance=c.as_str(m[Fields.INSTANCE], Fields.INSTANCE, nonempty=True),
    )


def state_to_wire(state: RuntimeState) -> dict[str, Any]:
    """The body of ``state_reply``; tensor entries are keyed by name and carry no ``name``."""
    t = Fields.Tensor
    tensors: dict[str, Any] = {}
    for entry in state.tensors:
        tensors[entry.record.name] = {
            **record_fields(entry.record),
            t.FINGERPRINT: entry.fingerprint,
            t.SLOT: entry.slot.value,
        }
    body: dict[str, Any] = {
        Fields.MODEL: state.model,
        Fields.WEIGHT_VERSION: state.weight_version,
        Fields.INSTANCE: state.instance,
        Fields.SINCE: state.since,
        Fields.TENSORS: tensors,
    }
    if state.events is not None:
        body[Fields.EVENTS] = state.events
    return body


def _entry_fast(raw: object, name: object) -> TensorEntry | None:
    """Like :func:`record_fast`, for a ``state_reply`` entry."""
    record = record_fast(raw, name)
    if record is None:
        return None
    assert isinstance(raw, dict), "record_fast reads only maps"
    t = Fields.Tensor
    fingerprint, slot = raw.get(t.FINGERPRINT, 0), raw.get(t.SLOT)  # 0: neither nil nor str
    state = _SLOTS.get(slot) if type(slot) is str else None
    if state is None or not (fingerprint is None or type(fingerprint) is str):
        return None
    return TensorEntry(record, fingerprint, state)


def _entry_strict(d: object, name: object) -> TensorEntry:
    where = f"{Fields.TENSORS}[{name!r}]"
    raw = c.require_map(d, where)
    record = record_from_wire(raw, where=where, name=c.as_str(name, where, nonempty=True))
    slot_where = c.field_path(where, Fields.Tensor.SLOT)
    slot = c.as_choice(c.get(raw, Fields.Tensor.SLOT, where), slot_where, tuple(_SLOTS))
    return TensorEntry(record, fingerprint_from_wire(raw, where), _SLOTS[slot])


def state_from_wire(d: object) -> RuntimeState:
    """A ``state_reply`` body: the full state, or a delta when ``since`` is an integer."""
    m = c.require_map(d, "state_reply")
    tensors_raw = c.require_map(c.get(m, Fields.TENSORS, ""), Fields.TENSORS)
    entries = tuple(
        _entry_fast(raw, name) or _entry_strict(raw, name) for name, raw in tensors_raw.items()
    )
    since, instance = m.get(Fields.SINCE), m.get(Fields.INSTANCE)
    events = m.get(Fields.EVENTS)
    if since is not None and instance is None:
        raise MalformedMessage(
            f"field {Fields.INSTANCE!r}: a delta ({Fields.SINCE!r} = {since!r}) names the runtime "
            "instance it belongs to, found nil or missing"
        )
    return RuntimeState(
        model=c.as_str(c.get(m, Fields.MODEL, ""), Fields.MODEL),
        weight_version=c.as_int(
            c.get(m, Fields.WEIGHT_VERSION, ""), Fields.WEIGHT_VERSION, minimum=0
        ),
        tensors=entries,
        instance=None if instance is None else c.as_str(instance, Fields.INSTANCE, nonempty=True),
        since=None if since is None else c.as_int(since, Fields.SINCE, minimum=0),
        events=None if events is None else c.as_str(events, Fields.EVENTS, nonempty=True),
    )


@dataclass(frozen=True, slots=True)
class Reason:
    """Why one tensor cannot be applied (by the runtime) or planned (by the agent).

    ``tensor`` is the tensor's name, or ``*`` for the plan as a whole. ``stale``: the tensor's
    source file changed under the plan, so re-planning will fix it. The wire carries it once per
    plan (``rejected.stale``: every reason is stale), so a reason read from the wire is stale
    exactly when its plan was.
    """

    tensor: str
    reason: str
    stale: bool = False

    def __str__(self) -> str:
        return f"{self.tensor}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Committed:
    """The body of ``committed``: the plan is live from ``weight_version`` on."""

    plan_id: str
    weight_version: int
    stall_ms: float


@dataclass(frozen=True, slots=True)
class Rejected:
    """The body of ``rejected``; ``stale`` means a source file changed: re-plan and resend."""

    plan_id: str
    stale: bool
    reasons: tuple[Reason, ...]


@dataclass(frozen=True, slots=True)
class Accepted:
    """The body of ``accepted``: the plan passed validation and is queued for staging."""

    plan_id: str


@dataclass(frozen=True, slots=True)
class Staged:
    """The body of ``staged``: the plan's weights are staged; it waits for a batch boundary."""

    plan_id: str


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """The body of ``error``."""

    in_reply_to: str | None
    code: ErrorCode
    message: str


def committed_to_wire(body: Committed) -> dict[str, Any]:
    return {
        Fields.PLAN_ID: body.plan_id,
        Fields.WEIGHT_VERSION: body.weight_version,
        Fields.STALL_MS: body.stall_ms,
    }


def committed_from_wire(d: object) -> Committed:
    m = c.require_map(d, "committed")
    return Committed(
        plan_id=c.as_str(c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, nonempty=True),
        weight_version=c.as_int(
            c.get(m, Fields.WEIGHT_VERSION, ""), Fields.WEIGHT_VERSION, minimum=0
        ),
        stall_ms=c.as_number(c.get(m, Fields.STALL_MS, ""), Fields.STALL_MS, minimum=0.0),
    )


def reasons_to_wire(reasons: Iterable[Reason]) -> list[dict[str, Any]]:
    """``reasons`` as ``[{tensor, reason}]`` (the per-plan ``stale`` flag travels beside them)."""
    return [{Fields.TENSOR: r.tensor, Fields.REASON: r.reason} for r in reasons]


def reasons_from_wire(d: Mapping[str, Any], *, stale: bool) -> tuple[Reason, ...]:
    """The ``reasons`` of a map, each ``stale`` as its plan is."""
    reasons = []
    for i, raw in enumerate(c.as_list(c.get(d, Fields.REASONS, ""), Fields.REASONS)):
        where = c.field_path(Fields.REASONS, i)
        r = c.require_map(raw, where)
        reasons.append(
            Reason(
                tensor=c.as_str(c.get(r, Fields.TENSOR, where), c.field_path(where, Fields.TENSOR)),
                reason=c.as_str(c.get(r, Fields.REASON, where), c.field_path(where, Fields.REASON)),
                stale=stale,
            )
        )
    return tuple(reasons)


def rejected_to_wire(body: Rejected) -> dict[str, Any]:
    return {
        Fields.PLAN_ID: body.plan_id,
        Fields.STALE: body.stale,
        Fields.REASONS: reasons_to_wire(body.reasons),
    }


def rejected_from_wire(d: object) -> Rejected:
    m = c.require_map(d, "rejected")
    stale = c.as_bool(c.get(m, Fields.STALE, ""), Fields.STALE)
    return Rejected(
        plan_id=c.as_str(c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, nonempty=True),
        stale=stale,
        reasons=reasons_from_wire(m, stale=stale),
    )


def error_from_wire(d: object) -> ErrorReply:
    m = c.require_map(d, "error")
    code = c.as_int(c.get(m, Fields.CODE, ""), Fields.CODE)
    try:
        error_code = ErrorCode(code)
    except ValueError:
        error_code = ErrorCode.INTERNAL  # a newer peer's code: still an error, still readable
    return ErrorReply(
        in_reply_to=c.as_opt_str(c.get(m, Fields.IN_REPLY_TO, ""), Fields.IN_REPLY_TO),
        code=error_code,
        message=c.as_str(c.get(m, Fields.MESSAGE, ""), Fields.MESSAGE),
    )


def accepted_from_wire(d: object) -> Accepted:
    m = c.require_map(d, "accepted")
    return Accepted(c.as_str(c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, nonempty=True))


def staged_from_wire(d: object) -> Staged:
    m = c.require_map(d, "staged")
    return Staged(c.as_str(c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, nonempty=True))


# -- the small bodies: heartbeats and status


@dataclass(frozen=True, slots=True)
class Ping:
    """The (empty) body of ``ping``."""


@dataclass(frozen=True, slots=True)
class Pong:
    """The body of ``pong``: which process answered, up for how long."""

    process: str
    uptime_s: float


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """The (empty) body of ``status``."""


@dataclass(frozen=True, slots=True)
class StatusReply:
    """The body of ``status_reply``: the process's status map (``docs/protocol.md``), as it
    sent it; ``process`` says whose shape it has."""

    process: Process
    status: Mapping[str, Any]


def pong_from_wire(d: object) -> Pong:
    m = c.require_map(d, "pong")
    return Pong(
        process=c.as_str(c.get(m, Fields.PROCESS, ""), Fields.PROCESS),
        uptime_s=c.as_number(c.get(m, Fields.UPTIME_S, ""), Fields.UPTIME_S, minimum=0.0),
    )


def status_reply_from_wire(d: object) -> StatusReply:
    m = c.require_map(d, "status_reply")
    process = c.as_choice(
        c.get(m, Fields.PROCESS, ""), Fields.PROCESS, tuple(p.value for p in Process)
    )
    return StatusReply(Process(process), c.require_map(c.get(m, Fields.STATUS, ""), Fields.STATUS))
