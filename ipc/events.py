"""Events: what the runtime reports as it works, one record per :class:`Topic`.

The runtime library hands these records to its ``on_event`` listeners; the control server
publishes them on the PUB socket as ``[topic, payload]``, the payload being the event envelope
plus the record's fields (``docs/protocol.md``). Subscribers read a payload back with
:func:`event_from_wire`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ggufswap.ipc import _check as c
from ggufswap.ipc.bodies import Reason, reasons_from_wire, reasons_to_wire
from ggufswap.ipc.errors import MalformedMessage
from ggufswap.ipc.messages import Fields, Topic, make_event


@dataclass(frozen=True, slots=True)
class PlanAcceptedEvent:
    """A plan passed validation and is queued for staging."""

    topic: ClassVar[Topic] = Topic.PLAN_ACCEPTED
    plan_id: str
    tensors: int  # jobs in the plan


@dataclass(frozen=True, slots=True)
class PlanStagedEvent:
    """A plan's weights are read, verified and placed; it waits for a batch boundary."""

    topic: ClassVar[Topic] = Topic.PLAN_STAGED
    plan_id: str
    stage_ms: float


@dataclass(frozen=True, slots=True)
class PlanCommittedEvent:
    """A plan is live from ``weight_version`` on; ``changed`` names the tensors whose bytes did."""

    topic: ClassVar[Topic] = Topic.PLAN_COMMITTED
    plan_id: str
    weight_version: int
    stall_ms: float
    changed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PlanRejectedEvent:
    """A plan was refused as a whole; ``stale``: a source file changed, re-planning fixes it."""

    topic: ClassVar[Topic] = Topic.PLAN_REJECTED
    plan_id: str
    stale: bool
    reasons: tuple[Reason, ...]


@dataclass(frozen=True, slots=True)
class TensorFallbackEvent:
    """A tensor (with its family) went to ``pool``, the fallback pool, its home being full."""

    topic: ClassVar[Topic] = Topic.TENSOR_FALLBACK
    tensor: str
    pool: str


@dataclass(frozen=True, slots=True)
class TensorReattachedEvent:
    """A tensor is back in the buffer it was loaded into, its private buffer freed."""

    topic: ClassVar[Topic] = Topic.TENSOR_REATTACHED
    tensor: str


@dataclass(frozen=True, slots=True)
class ShardInvalidEvent:
    """A shard file failed validation (reserved: no process publishes it yet)."""

    topic: ClassVar[Topic] = Topic.SHARD_INVALID
    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class TensorsLostEvent:
    """Served tensors are out of service: their bytes changed outside any commit (a mapped
    shard written or truncated under the runtime); one reason per tensor. No batch runs until
    a commit restores them, so a subscriber (the agent) re-syncs and plans them at once."""

    topic: ClassVar[Topic] = Topic.TENSORS_LOST
    reasons: tuple[Reason, ...]


Event = (
    PlanAcceptedEvent
    | PlanStagedEvent
    | PlanCommittedEvent
    | PlanRejectedEvent
    | TensorFallbackEvent
    | TensorReattachedEvent
    | ShardInvalidEvent
    | TensorsLostEvent
)


def event_to_wire(event: Event) -> dict[str, Any]:
    """An event's payload fields (no envelope): ``make_event(event.topic, **event_to_wire(e))``."""
    if isinstance(event, PlanAcceptedEvent):
        return {Fields.PLAN_ID: event.plan_id, Fields.TENSORS: event.tensors}
    if isinstance(event, PlanStagedEvent):
        return {Fields.PLAN_ID: event.plan_id, Fields.STAGE_MS: event.stage_ms}
    if isinstance(event, PlanCommittedEvent):
        return {
            Fields.PLAN_ID: event.plan_id,
            Fields.WEIGHT_VERSION: event.weight_version,
            Fields.STALL_MS: event.stall_ms,
            Fields.CHANGED: list(event.changed),
        }
    if isinstance(event, PlanRejectedEvent):
        return {
            Fields.PLAN_ID: event.plan_id,
            Fields.STALE: event.stale,
            Fields.REASONS: reasons_to_wire(event.reasons),
        }
    if isinstance(event, TensorFallbackEvent):
        return {Fields.TENSOR: event.tensor, Fields.POOL: event.pool}
    if isinstance(event, TensorReattachedEvent):
        return {Fields.TENSOR: event.tensor}
    if isinstance(event, TensorsLostEvent):
        return {Fields.REASONS: reasons_to_wire(event.reasons)}
    return {Fields.PATH: event.path, Fields.REASON: event.reason}


def event_message(event: Event) -> dict[str, Any]:
    """The whole payload of ``event``: the envelope, the topic and its fields."""
    return make_event(event.topic, **event_to_wire(event))


def event_from_wire(payload: Mapping[str, Any]) -> Event:
    """The record of an event payload (its ``topic`` field decides which); unknown fields are
    ignored, an unknown topic is ``MalformedMessage``."""
    m = c.require_map(payload, "event")
    raw_topic = c.as_str(c.get(m, Fields.TOPIC, ""), Fields.TOPIC, nonempty=True)
    try:
        topic = Topic(raw_topic)
    except ValueError:
        raise MalformedMessage(f"field 'topic': unknown event topic {raw_topic!r}") from None

    def text(key: str) -> str:
        return c.as_str(c.get(m, key, ""), key)

    def plan_id() -> str:
        return c.as_str(c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, nonempty=True)

    def number(key: str) -> float:
        return c.as_number(c.get(m, key, ""), key, minimum=0.0)

    if topic is Topic.PLAN_ACCEPTED:
        tensors = c.as_int(c.get(m, Fields.TENSORS, ""), Fields.TENSORS, minimum=0)
        return PlanAcceptedEvent(plan_id(), tensors)
    if topic is Topic.PLAN_STAGED:
        return PlanStagedEvent(plan_id(), number(Fields.STAGE_MS))
    if topic is Topic.PLAN_COMMITTED:
        version = c.as_int(c.get(m, Fields.WEIGHT_VERSION, ""), Fields.WEIGHT_VERSION, minimum=0)
        changed = c.as_list(c.get(m, Fields.CHANGED, ""), Fields.CHANGED)
        names = tuple(c.as_str(n, c.field_path(Fields.CHANGED, i)) for i, n in enumerate(changed))
        return PlanCommittedEvent(plan_id(), version, number(Fields.STALL_MS), names)
    if topic is Topic.PLAN_REJECTED:
        stale = c.as_bool(c.get(m, Fields.STALE, ""), Fields.STALE)
        return PlanRejectedEvent(plan_id(), stale, reasons_from_wire(m, stale=stale))
    if topic is Topic.TENSOR_FALLBACK:
        return TensorFallbackEvent(text(Fields.TENSOR), text(Fields.POOL))
    if topic is Topic.TENSOR_REATTACHED:
        return TensorReattachedEvent(text(Fields.TENSOR))
    if topic is Topic.TENSORS_LOST:
        return TensorsLostEvent(reasons_from_wire(m, stale=False))
    return ShardInvalidEvent(text(Fields.PATH), text(Fields.REASON))
