"""The control server in-process: one parse per plan, replies that follow the plan's ticket, and
the runtime's typed events published on the PUB socket."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import WAIT_S, ModelDir, Q, control_server, open_runtime

import ggufswap.runtime.control as control_module
from ggufswap.ipc import (
    DealerClient,
    Fields,
    MessageType,
    PlanAcceptedEvent,
    PlanCommittedEvent,
    PlanStagedEvent,
    Subscriber,
    TensorReattachedEvent,
    Topic,
    event_from_wire,
    message_from,
    plan_to_wire,
)
from ggufswap.runtime import HotSwapRuntime, PlanState

OUTPUT = "output.weight"


def _replies(
    client: DealerClient, runtime: HotSwapRuntime, until: set[str]
) -> list[dict[str, Any]]:
    """Replies received while acting as the inference loop, up to one whose type is in
    ``until``."""
    replies: list[dict[str, Any]] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        runtime.at_batch_boundary()
        reply = client.poll(0.02)
        if reply is not None:
            replies.append(reply)
            if reply[Fields.TYPE] in until:
                return replies
    raise AssertionError(f"no {sorted(until)} within {WAIT_S}s; got {replies}")


def test_plan_replies_follow_the_ticket_and_events_are_published(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A plan gets accepted, staged and committed, each naming its request; re-sent, it gets its
    outcome again, and another plan under its id is refused; every plan event is published once,
    reading back as its typed record."""
    sockdir = tmp_path_factory.mktemp("s")  # short: a socket path holds at most 107 bytes
    model_dir = ModelDir.write(tmp_path / "m")
    runtime, _ = open_runtime(model_dir.first)
    model_dir.put(OUTPUT, model_dir.variant(OUTPUT, Q.Q8_0, tmp_path / "variants"))
    control = control_server(runtime, sockdir).start()
    publisher = control.publisher
    assert publisher is not None
    try:
        with (
            Subscriber(publisher.endpoint) as sub,
            DealerClient(control.control.endpoint) as client,
        ):
            for _ in range(200):  # PUB drops events until the subscription has propagated
                publisher.publish(TensorReattachedEvent(tensor="probe"))
                if sub.recv(0.02) is not None:
                    break
            plan = model_dir.plan("p1", [OUTPUT])
            msg = message_from(MessageType.PLAN, plan_to_wire(plan))
            client.send(msg)
            replies = _replies(client, runtime, {"committed", "rejected"})
            assert [r[Fields.TYPE] for r in replies] == ["accepted", "staged", "committed"]
            assert {r[Fields.IN_REPLY_TO] for r in replies} == {msg[Fields.ID]}
            assert {r[Fields.PLAN_ID] for r in replies} == {"p1"}
            version = replies[-1][Fields.WEIGHT_VERSION]
            assert version == runtime.weight_version == 1

            again = message_from(MessageType.PLAN, plan_to_wire(plan))
            client.send(again)
            (outcome,) = _replies(client, runtime, {"committed", "rejected"})
            assert (outcome[Fields.TYPE], outcome[Fields.IN_REPLY_TO]) == (
                "committed",
                again[Fields.ID],
            )
            assert outcome[Fields.WEIGHT_VERSION] == version

            # Another plan under the id is refused, naming the id; nothing is staged or announced.
            model_dir.put(OUTPUT, model_dir.variant(OUTPUT, Q.Q4_0, tmp_path / "variants"))
            other = message_from(MessageType.PLAN, plan_to_wire(model_dir.plan("p1", [OUTPUT])))
            client.send(other)
            (refused,) = _replies(client, runtime, {"committed", "rejected"})
            assert (refused[Fields.TYPE], refused[Fields.IN_REPLY_TO]) == (
                "rejected",
                other[Fields.ID],
            )
            [reason] = refused[Fields.REASONS]
            assert "plan id 'p1' names another plan (its state: committed)" in reason[Fields.REASON]
            assert runtime.weight_version == version
            assert runtime.ticket("p1").state is PlanState.COMMITTED  # type: ignore[union-attr]
            assert runtime.status()["plans"] == {"committed": 1, "id_reused": 1}

            events = []
            while (got := sub.recv(0.2)) is not None:
                topic, payload = got
                if topic.startswith("plan."):
                    events.append(event_from_wire(payload))
                    assert events[-1].topic is Topic(topic)
    finally:
        control.close()
        runtime.close()
    assert [type(e) for e in events] == [PlanAcceptedEvent, PlanStagedEvent, PlanCommittedEvent]
    committed = events[-1]
    assert isinstance(committed, PlanCommittedEvent)
    assert (committed.plan_id, committed.weight_version, committed.changed) == ("p1", 1, (OUTPUT,))


def test_a_release_frees_only_the_room_of_its_own_hand_off(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A plan's final state frees the room its own hand-off took: a later hand-off under the same
    id (the plan handed again, or another plan after the first was decided) keeps the runtime's
    window and its client's count until its own release."""
    sockdir = tmp_path_factory.mktemp("s")
    model_dir = ModelDir.write(tmp_path / "m")
    runtime, _ = open_runtime(model_dir.first)
    control = control_server(runtime, sockdir)
    try:
        plan = model_dir.plan("x", [OUTPUT])
        first, later = control_module._Handed(plan), control_module._Handed(plan)
        control._handed["x"] = later
        control._peer_plans["client"] = {"x"}
        control._release("client", "x", first)
        assert control.fairness()["handed"] == 1
        assert control.fairness()["clients_in_flight"] == {"client": 1}
        control._release("client", "x", later)
        assert control.fairness()["handed"] == 0
        assert control.fairness()["clients_in_flight"] == {}
    finally:
        control.close()
        runtime.close()
