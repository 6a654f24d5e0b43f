"""Hostile peers on the control socket, and what they cannot do (issue 16's red-team findings).

Each test sends one attack to a real control server over a real ZeroMQ socket, checks that it is
refused before anything is read from disk and that good input still goes through, and records
its row in the reliability matrix.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile import RawPeer
from runtime_helpers import WAIT_S, ModelDir, open_runtime

from ggufswap.ipc import ErrorCode, Fields, Job, MessageType, Plan, encode, message_from
from ggufswap.ipc import plan_to_wire as _plan_to_wire
from ggufswap.ipc._check import MAX_PATH_COMPONENTS
from ggufswap.ipc.messages import MAX_PLAN_ID_LENGTH, MAX_PLAN_JOBS
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.control import MAX_PLANS_IN_FLIGHT_PER_PEER, ControlServer

OUTPUT = "output.weight"


@dataclasses.dataclass
class Served:
    model_dir: ModelDir
    runtime: HotSwapRuntime
    control: ControlServer


@pytest.fixture
def served(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    sockdir = tmp_path_factory.mktemp("s")  # short: a socket path holds at most 107 bytes
    model_dir = ModelDir.write(tmp_path / "m")
    runtime, _ = open_runtime(model_dir.first)
    control = ControlServer(runtime, control_endpoint=f"ipc://{sockdir}/control.sock").start()
    try:
        yield Served(model_dir, runtime, control)
    finally:
        control.close()
        runtime.close()


def plan_frame(plan: Plan) -> tuple[str, bytes]:
    msg = message_from(MessageType.PLAN, _plan_to_wire(plan))
    return str(msg[Fields.ID]), encode(msg)


def outcome(peer: RawPeer, runtime: HotSwapRuntime, msg_id: str) -> dict[str, Any]:
    """The final reply to request ``msg_id`` (committed, rejected or error), acting as the
    inference loop meanwhile."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        runtime.at_batch_boundary()
        for reply in peer.replies(timeout=0.02):
            if reply.get(Fields.IN_REPLY_TO) == msg_id and reply[Fields.TYPE] in {
                "committed",
                "rejected",
                "error",
            }:
                return reply
    raise AssertionError(f"no outcome for {msg_id} within {WAIT_S}s")


@pytest.mark.reliability(
    "security",
    "plans over the bounds: 80,000-component path, 1 MiB plan id, 70,000 jobs",
    tries=3,
    outcome="error MALFORMED naming the bound, before any file-system call; model unchanged",
)
def test_plans_over_the_bounds_are_malformed(served: Served) -> None:
    """A path of 80,000 components, a plan id of 1 MiB and more jobs than MAX_PLAN_JOBS are each
    answered ``error MALFORMED`` naming the bound (never validated against the disk); a plan
    within the bounds still commits."""
    record = served.model_dir.record(OUTPUT)
    deep = str(served.model_dir.root) + "/." * 80_000 + "/" + Path(record.path).name
    job = Job(record)
    attacks = {
        "components": Plan("deep", "", (Job(dataclasses.replace(record, path=deep)),)),
        "plan_id": Plan("x" * (1 << 20), "", (job,)),
        "jobs": Plan(
            "many",
            "",
            tuple(Job(dataclasses.replace(record, name=f"t{i}")) for i in range(MAX_PLAN_JOBS + 1)),
        ),
    }
    expected = {
        "components": f"{MAX_PATH_COMPONENTS} components",
        "plan_id": f"at most {MAX_PLAN_ID_LENGTH} characters",
        "jobs": f"at most {MAX_PLAN_JOBS} jobs",
    }
    with RawPeer(served.control.control.endpoint) as peer:
        for what, plan in attacks.items():
            msg_id, frame = plan_frame(plan)
            peer.send([frame])
            reply = outcome(peer, served.runtime, msg_id)
            assert reply[Fields.TYPE] == "error", (what, reply)
            assert reply[Fields.CODE] == ErrorCode.MALFORMED, (what, reply)
            assert expected[what] in reply[Fields.MESSAGE], (what, reply)
        assert served.runtime.weight_version == 0
        msg_id, frame = plan_frame(served.model_dir.plan("good", [OUTPUT]))
        peer.send([frame])
        assert outcome(peer, served.runtime, msg_id)[Fields.TYPE] == "committed"


@pytest.mark.reliability(
    "security",
    "one client floods 50 plans, then another sends its update",
    tries=50,
    outcome="flooder capped at 4 in flight, the rest rejected stale; the update commits "
    "after at most 4 of the flood's plans",
)
def test_a_flooding_client_cannot_queue_ahead_of_another(served: Served) -> None:
    """A client with MAX_PLANS_IN_FLIGHT_PER_PEER plans in flight gets its further plans
    rejected (stale, to resend later), so another client's plan is committed after at most that
    many of the flood's."""
    flood = 50
    with (
        RawPeer(served.control.control.endpoint) as flooder,
        RawPeer(served.control.control.endpoint) as agent,
    ):
        ids = []
        for i in range(flood):
            msg_id, frame = plan_frame(served.model_dir.plan(f"flood-{i}", [OUTPUT]))
            flooder.send([frame])
            ids.append(msg_id)
        first = {}
        deadline = time.monotonic() + WAIT_S
        while len(first) < flood and time.monotonic() < deadline:
            for reply in flooder.replies(timeout=0.1, want=flood):
                first.setdefault(reply[Fields.IN_REPLY_TO], reply[Fields.TYPE])
        assert len(first) == flood
        kinds = [first[i] for i in ids]
        assert kinds.count("accepted") == MAX_PLANS_IN_FLIGHT_PER_PEER, kinds
        assert kinds.count("rejected") == flood - MAX_PLANS_IN_FLIGHT_PER_PEER, kinds
        msg_id, frame = plan_frame(served.model_dir.plan("agent", [OUTPUT]))
        agent.send([frame])
        reply = outcome(agent, served.runtime, msg_id)
        assert reply[Fields.TYPE] == "committed", reply
        assert reply[Fields.WEIGHT_VERSION] <= MAX_PLANS_IN_FLIGHT_PER_PEER + 1, reply
        # Once its plans are decided the flooder may send again.
        msg_id, frame = plan_frame(served.model_dir.plan("flood-again", [OUTPUT]))
        flooder.send([frame])
        assert outcome(flooder, served.runtime, msg_id)[Fields.TYPE] == "committed"
