"""Events: one typed record per topic, with the payload fields docs/protocol.md lists."""

from __future__ import annotations

import pytest

from ggufswap.ipc import (
    Event,
    Fields,
    MalformedMessage,
    PlanAcceptedEvent,
    PlanCommittedEvent,
    PlanRejectedEvent,
    PlanStagedEvent,
    Reason,
    ShardInvalidEvent,
    TensorFallbackEvent,
    TensorReattachedEvent,
    TensorsLostEvent,
    Topic,
    decode,
    encode,
    event_from_wire,
    event_message,
    make_event,
)

EVENTS: dict[Topic, tuple[Event, dict[str, object]]] = {
    Topic.PLAN_ACCEPTED: (PlanAcceptedEvent("p", 3), {"plan_id": "p", "tensors": 3}),
    Topic.PLAN_STAGED: (PlanStagedEvent("p", 1.5), {"plan_id": "p", "stage_ms": 1.5}),
    Topic.PLAN_COMMITTED: (
        PlanCommittedEvent("p", 4, 0.25, ("a", "b")),
        {"plan_id": "p", "weight_version": 4, "stall_ms": 0.25, "changed": ["a", "b"]},
    ),
    Topic.PLAN_REJECTED: (
        PlanRejectedEvent("p", True, (Reason("a", "stale: file changed", stale=True),)),
        {
            "plan_id": "p",
            "stale": True,
            "reasons": [{"tensor": "a", "reason": "stale: file changed"}],
        },
    ),
    Topic.TENSOR_FALLBACK: (TensorFallbackEvent("a", "host"), {"tensor": "a", "pool": "host"}),
    Topic.TENSOR_REATTACHED: (TensorReattachedEvent("a"), {"tensor": "a"}),
    Topic.TENSORS_LOST: (
        TensorsLostEvent((Reason("a", "/m/x.gguf: truncated under its mapping"),)),
        {"reasons": [{"tensor": "a", "reason": "/m/x.gguf: truncated under its mapping"}]},
    ),
    Topic.SHARD_INVALID: (
        ShardInvalidEvent("/m/x.gguf", "truncated"),
        {"path": "/m/x.gguf", "reason": "truncated"},
    ),
}


def test_every_topic_has_an_event_record() -> None:
    """Each Topic is the topic of exactly one event record."""
    assert set(EVENTS) == set(Topic)
    assert all(event.topic is topic for topic, (event, _) in EVENTS.items())


@pytest.mark.parametrize("topic", list(Topic), ids=lambda t: t.value)
def test_event_payload_fields_and_roundtrip(topic: Topic) -> None:
    """An event's payload is the event envelope, its topic and its fields, and reads back as the
    same record through the codec."""
    event, fields = EVENTS[topic]
    payload = decode(encode(event_message(event)))
    assert payload[Fields.TYPE] == "event"
    assert payload[Fields.TOPIC] == topic.value
    assert {k: v for k, v in payload.items() if k not in ("v", "type", "id", "topic")} == fields
    assert event_from_wire(payload) == event


def test_unknown_event_topic_is_malformed() -> None:
    """A payload with a topic no record has is refused, naming the topic."""
    payload = make_event(Topic.PLAN_STAGED, plan_id="p", stage_ms=1.0)
    payload[Fields.TOPIC] = "plan.exploded"
    with pytest.raises(MalformedMessage, match=r"plan\.exploded"):
        event_from_wire(payload)
