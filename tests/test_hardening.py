"""Hostile peers on the control socket, and what they cannot do (issue 16's red-team findings).

Each test sends one attack to a real control server over a real ZeroMQ socket, checks that it is
refused before anything is read from disk and that good input still goes through, and records
its row in the reliability matrix.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile import RawPeer
from runtime_helpers import WAIT_S, ModelDir, open_runtime

from ggufswap.config import ConfigError, load_config
from ggufswap.config.endpoints import default_runtime_dir, socket_dir_problem
from ggufswap.ipc import (
    DealerClient,
    ErrorCode,
    Fields,
    Job,
    MessageType,
    Plan,
    RequestServer,
    encode,
    make_message,
    message_from,
)
from ggufswap.ipc import plan_to_wire as _plan_to_wire
from ggufswap.ipc._check import MAX_PATH_COMPONENTS
from ggufswap.ipc.errors import InsecureEndpoint
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


# -- socket directories (finding 5) -----------------------------------------------------------

NOBODY = 65534


def foreign_dir(path: Path, mode: int = 0o755) -> Path:
    """A directory owned by another user (as an attacker who created it first)."""
    path.mkdir(mode=mode)
    os.chmod(path, mode)
    os.chown(path, NOBODY, NOBODY)
    return path


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@needs_root
@pytest.mark.reliability(
    "security",
    "socket directory pre-created by another user, or under an ancestor others can write",
    tries=4,
    outcome="bind and connect refused naming the directory and owner; check-config names the line",
)
def test_a_socket_directory_someone_else_controls_is_refused(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server refuses to bind in a directory owned by another user, or under an ancestor
    others may write (without the sticky bit); a client refuses to connect through its default
    runtime directory when another user created it; check-config reports both at their line."""
    base = tmp_path_factory.mktemp("d")
    hijacked = foreign_dir(base / "hijacked")
    open_parent = base / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)
    (open_parent / "sub").mkdir(mode=0o700)
    for directory, why in ((hijacked, f"owned by uid {NOBODY}"), (open_parent / "sub", "0777")):
        server = RequestServer(f"ipc://{directory}/rt.sock", lambda r: None, name="t")
        with pytest.raises(InsecureEndpoint, match=why):
            server.start()
        assert not (directory / "rt.sock").exists()
    # The client side: XDG_RUNTIME_DIR/ggufswap is this user's default runtime directory.
    xdg = base / "xdg"
    xdg.mkdir(mode=0o700)
    foreign_dir(xdg / "ggufswap")
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert default_runtime_dir() == xdg / "ggufswap"
    with pytest.raises(InsecureEndpoint, match=f"owned by uid {NOBODY}"):
        DealerClient(f"ipc://{xdg}/ggufswap/rt.sock")
    config = base / "c.yaml"
    config.write_text(
        f"runtime:\n  name: m\n  model: {base}/m.gguf\n"
        f"  control_endpoint: ipc://{hijacked}/rt.sock\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert f"{config}:4" in str(caught.value), caught.value
    assert f"owned by uid {NOBODY}" in str(caught.value), caught.value


def test_a_private_socket_directory_is_accepted(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Paired: a directory of this user's, mode 0700, under /tmp (sticky, root's) binds and
    answers."""
    directory = tmp_path_factory.mktemp("ok")
    os.chmod(directory, 0o700)
    assert socket_dir_problem(directory) is None
    assert socket_dir_problem(Path(tempfile.gettempdir()) / "not-yet-created") is None
    with RequestServer(f"ipc://{directory}/rt.sock", lambda r: None, name="t") as server:
        with RawPeer(server.endpoint) as peer:
            peer.send([encode(make_message(MessageType.PING))])
            assert [r[Fields.TYPE] for r in peer.replies()] == ["pong"]
