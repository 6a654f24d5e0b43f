"""Hostile peers on the control socket, and what they cannot do (issue 16's red-team findings).

Each test sends one attack to a real control server over a real ZeroMQ socket, checks that it is
refused before anything is read from disk and that good input still goes through, and records
its row in the reliability matrix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flood_peer import FloodPeer
from hostile import MODEL, STARTUP_TIMEOUT_S, TENSOR, RawPeer
from processes import GGUFSWAP, PROBE, Proc, status_of, wait_for, write_config
from runtime_helpers import WAIT_S, ModelDir, Q, control_server, open_runtime

from ggufswap.config import ConfigError, load_config
from ggufswap.config.endpoints import default_runtime_dir, socket_dir_problem
from ggufswap.config.loader import MAX_CONFIG_BYTES
from ggufswap.ipc import (
    DealerClient,
    ErrorCode,
    Fields,
    Job,
    MessageType,
    Plan,
    PlanCommittedEvent,
    RequestServer,
    encode,
    job_to_wire,
    make_message,
    message_from,
)
from ggufswap.ipc import plan_to_wire as _plan_to_wire
from ggufswap.ipc._check import MAX_PATH_COMPONENTS
from ggufswap.ipc.errors import InsecureEndpoint
from ggufswap.ipc.plan import MAX_PLAN_ID_LENGTH, MAX_PLAN_JOBS
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.control import (
    MAX_PLANS_IN_FLIGHT_PER_PEER,
    RUNTIME_WINDOW,
    ControlServer,
)
from ggufswap.shards import Layout, open_shard_set, requantize, tiny_moe, write_model

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
    return body_frame(_plan_to_wire(plan))


def body_frame(body: dict[str, Any]) -> tuple[str, bytes]:
    """A ``plan`` message of ``body`` (as ``plan_to_wire`` gives it, or built by hand): its id
    and its frame."""
    msg = message_from(MessageType.PLAN, body)
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
    wire = job_to_wire(job)  # one job's fields, renamed for each of the many (built once)
    attacks = {
        "components": _plan_to_wire(
            Plan("deep", "", (Job(dataclasses.replace(record, path=deep)),))
        ),
        "plan_id": _plan_to_wire(Plan("x" * (1 << 20), "", (job,))),
        "jobs": {
            Fields.PLAN_ID: "many",
            Fields.MODEL: "",
            Fields.JOBS: [{**wire, Fields.Tensor.NAME: f"t{i}"} for i in range(MAX_PLAN_JOBS + 1)],
        },
    }
    expected = {
        "components": f"{MAX_PATH_COMPONENTS} components",
        "plan_id": f"at most {MAX_PLAN_ID_LENGTH} characters",
        "jobs": f"at most {MAX_PLAN_JOBS} jobs",
    }
    with RawPeer(served.control.control.endpoint) as peer:
        for what, body in attacks.items():
            msg_id, frame = body_frame(body)
            peer.send([frame])
            reply = outcome(peer, served.runtime, msg_id)
            assert reply[Fields.TYPE] == "error", (what, reply)
            assert reply[Fields.CODE] == ErrorCode.MALFORMED, (what, reply)
            assert expected[what] in reply[Fields.MESSAGE], (what, reply)
        assert served.runtime.weight_version == 0
        msg_id, frame = plan_frame(served.model_dir.plan("good", [OUTPUT]))
        peer.send([frame])
        assert outcome(peer, served.runtime, msg_id)[Fields.TYPE] == "committed"


@pytest.mark.process
@pytest.mark.reliability(
    "security",
    "one client floods 50 plans, then another sends its update",
    tries=50,
    outcome="flooder capped at 4 in flight, the rest rejected stale; the update commits "
    "after at most 4 of the flood's plans",
)
def test_a_flooding_client_cannot_queue_ahead_of_another(served: Served, tmp_path: Path) -> None:
    """A client (a process of its own) with MAX_PLANS_IN_FLIGHT_PER_PEER plans in flight gets
    its further plans rejected (stale, to resend later), so another client's plan is committed
    after at most that many of the flood's; then no client has anything in flight."""
    flood = 50
    endpoint = served.control.control.endpoint
    committed = committed_order(served.runtime)
    frames = [plan_frame(served.model_dir.plan(f"flood-{i}", [OUTPUT])) for i in range(flood)]
    with FloodPeer(endpoint, frames, connections=1, tmp=tmp_path) as flooder:
        first = flooder.first_replies()
        kinds = [first.get(msg_id) for msg_id, _ in frames]
        assert kinds.count("accepted") == MAX_PLANS_IN_FLIGHT_PER_PEER, kinds
        assert kinds.count("rejected") == flood - MAX_PLANS_IN_FLIGHT_PER_PEER, kinds
        with RawPeer(endpoint) as agent:
            msg_id, frame = plan_frame(served.model_dir.plan("agent", [OUTPUT]))
            agent.send([frame])
            # Queued before any commit (nothing commits until the loop below runs).
            assert [r[Fields.TYPE] for r in agent.replies()] == ["accepted"]
            with RawPeer(endpoint) as other:  # another plan under the queued plan's id
                _, frame = plan_frame(served.model_dir.plan("agent", ["blk.0.attn_k.weight"]))
                other.send([frame])
                [refused] = other.replies()
                assert refused[Fields.TYPE] == "rejected", refused
                assert "'agent' names another plan (its state: waiting)" in str(refused)
                assert served.control.fairness()["id_reused"] == 1
            reply = outcome(agent, served.runtime, msg_id)
        assert reply[Fields.TYPE] == "committed", reply
        assert committed.index("agent") <= MAX_PLANS_IN_FLIGHT_PER_PEER, committed
        drain(served, committed, MAX_PLANS_IN_FLIGHT_PER_PEER + 1)
    assert served.control.fairness()["clients_in_flight"] == {}


def committed_order(runtime: HotSwapRuntime) -> list[str]:
    """The plan ids the runtime commits from now on, in order (filled as it commits)."""
    order: list[str] = []

    def note(event: object) -> None:
        if isinstance(event, PlanCommittedEvent):
            order.append(event.plan_id)

    runtime.on_event(note)
    return order


def drain(served: Served, committed: list[str], count: int) -> None:
    """Act as the inference loop until ``count`` plans are committed."""
    deadline = time.monotonic() + WAIT_S
    while len(committed) < count and time.monotonic() < deadline:
        served.runtime.at_batch_boundary()
        served.runtime.wait_staged(0.05)
    assert len(committed) == count, committed


@pytest.mark.process
@pytest.mark.reliability(
    "security",
    "3 flooding processes, 4 connections each, 4 no-op plans per connection; then the agent's "
    "update",
    tries=48,
    outcome="each process capped at 4 in flight over all its connections (SO_PEERCRED), the "
    "rest rejected stale; clients served round-robin: the update committed after at most "
    "RUNTIME_WINDOW + 3 flood plans",
)
def test_many_connections_do_not_starve_the_agents_update(served: Served, tmp_path: Path) -> None:
    """Flooders that open many connections count as one client each (their process, from
    SO_PEERCRED) and the runtime's control queue serves clients round-robin, so the agent's
    update is committed after at most RUNTIME_WINDOW plans already handed to the runtime plus
    one plan of each flooder, however many connections and plans they send."""
    flooders, connections, per_connection = 3, 4, 4
    endpoint = served.control.control.endpoint
    committed = committed_order(served.runtime)
    with contextlib.ExitStack() as stack:
        floods = []
        for f in range(flooders):
            frames = [
                plan_frame(served.model_dir.plan(f"flood-{f}-{i}", [OUTPUT]))
                for i in range(connections * per_connection)
            ]
            peer = FloodPeer(endpoint, frames, connections=connections, tmp=tmp_path)
            floods.append((stack.enter_context(peer), frames))
        kinds = []
        for peer, frames in floods:
            first = peer.first_replies()
            kinds.append([first.get(msg_id) for msg_id, _ in frames])
        with RawPeer(endpoint) as agent:
            msg_id, frame = plan_frame(served.model_dir.plan("agent", [OUTPUT]))
            agent.send([frame])
            # Queued before any commit (nothing commits until the loop below runs).
            assert [r[Fields.TYPE] for r in agent.replies()] == ["accepted"]
            reply = outcome(agent, served.runtime, msg_id)
        assert reply[Fields.TYPE] == "committed", reply
        position = committed.index("agent")  # flood plans committed before the agent's
        assert position <= RUNTIME_WINDOW + flooders, (position, committed)
        for each in kinds:  # every connection of a process counts against the one limit
            assert each.count("accepted") == MAX_PLANS_IN_FLIGHT_PER_PEER, each
            assert each.count("rejected") == len(each) - MAX_PLANS_IN_FLIGHT_PER_PEER, each
        drain(served, committed, flooders * MAX_PLANS_IN_FLIGHT_PER_PEER + 1)
    assert served.control.fairness() == {
        "waiting": {},
        "handed": 0,
        "clients_in_flight": {},
        "id_reused": 0,
    }


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


# -- names that are not UTF-8 (findings 6 and 9) ----------------------------------------------


@pytest.mark.process
@pytest.mark.reliability(
    "bad input",
    "model directory reached through a non-UTF-8 path, and a file junk\\xff.gguf beside it",
    tries=2,
    outcome="both processes' status and state encode; the update commits once; names carried "
    "byte for byte",
)
def test_non_utf8_names_are_carried_byte_for_byte(tmp_path: Path) -> None:
    """A model whose real directory name is not UTF-8 (reached through a symlink), with a file
    named ``junk\\xff.gguf`` beside its shards: both processes answer status, the runtime's
    state names the shard by its real bytes, and an update is committed."""
    real_dir = tmp_path / os.fsdecode(b"model-\xff")
    real_dir.mkdir()
    first = Path(write_model(tiny_moe(), real_dir, layout=Layout.PER_TENSOR)[0])
    (real_dir / os.fsdecode(b"junk\xff.gguf")).write_bytes(b"not a gguf")
    link = tmp_path / "model"
    link.symlink_to(real_dir)
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path, model_dir=link, first=link / first.name, run_dir=run_dir, model=MODEL
    )
    control = f"ipc://{run_dir}/rt.sock"
    agent_status = f"ipc://{run_dir}/agent.sock"
    runtime = Proc(["runtime", "--config", str(config), *PROBE], log=tmp_path / "runtime.log")
    agent: Proc | None = None
    try:
        wait_for(lambda: status_of(control), timeout=STARTUP_TIMEOUT_S, what="the runtime")
        agent = Proc(["agent", "--config", str(config)], log=tmp_path / "agent.log")
        wait_for(lambda: status_of(agent_status), timeout=STARTUP_TIMEOUT_S, what="the agent")
        target = open_shard_set(first).tensors[TENSOR].path
        requantize(target, TENSOR, Q.Q4_0)
        wait_for(
            lambda: (s := status_of(control)) is not None and s["weight_version"] == 1,
            timeout=STARTUP_TIMEOUT_S,
            what="the update committed",
        )
        assert status_of(agent_status) is not None
        with DealerClient(control) as client:
            client.send(make_message(MessageType.STATE))
            state = wait_for(lambda: client.poll(0.2), timeout=WAIT_S, what="state")
        paths = {entry[Fields.Tensor.PATH] for entry in state[Fields.TENSORS].values()}
        assert all(os.fsencode(p).startswith(os.fsencode(real_dir)) for p in paths), paths
    finally:
        if agent is not None:
            agent.stop()
        runtime.stop()


# -- watch roots and configuration files (finding 9) ------------------------------------------


@pytest.mark.process
@pytest.mark.reliability(
    "bad input",
    "pseudo file systems (/proc, /sys, /dev, and a symlink to /proc) as watch roots",
    tries=4,
    outcome="ConfigError naming the line and the pseudo file system; check-config exits 1",
)
def test_pseudo_file_systems_are_refused_as_watch_roots(tmp_path: Path) -> None:
    """``/proc``, ``/sys``, ``/dev`` and a symlink into ``/proc`` are refused as watch roots,
    naming the line; ``ggufswap check-config`` exits 1 on them."""
    (tmp_path / "to-proc").symlink_to("/proc/self")
    for root in ("/proc", "/sys/kernel", "/dev", str(tmp_path / "to-proc")):
        config = tmp_path / "c.yaml"
        config.write_text(
            f"models:\n  - name: m\n    runtime: ipc://{tmp_path}/rt.sock\n    watch:\n"
            f"      - path: {root}\n        glob: '*'\n        recursive: true\n"
        )
        with pytest.raises(ConfigError, match="pseudo file system") as caught:
            load_config(config)
        assert f"{config}:5" in str(caught.value), caught.value
    done = subprocess.run(
        [GGUFSWAP, "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done
    assert "pseudo file system" in done.stdout + done.stderr


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_an_ordinary_watch_root_is_accepted(tmp_path: Path) -> None:
    """Paired: a directory of model files is accepted as a watch root, and so is one in
    ``/dev/shm`` (a tmpfs under ``/dev``: refused by type, not by prefix)."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        for root in (tmp_path, Path(shm)):
            config = tmp_path / "c.yaml"
            config.write_text(
                f"models:\n  - name: m\n    runtime: ipc://{tmp_path}/rt.sock\n    watch:\n"
                f"      - path: {root}\n"
            )
            assert load_config(config).models[0].watch[0].path == root


@pytest.mark.reliability(
    "bad input",
    "configuration path naming /dev/zero, a FIFO, a directory or a 2 MiB file",
    tries=4,
    outcome="ConfigError naming the file and why, before any byte is read; never hangs",
)
def test_config_files_must_be_regular_and_bounded(tmp_path: Path) -> None:
    """A configuration path naming ``/dev/zero``, a FIFO with no writer, a directory or a file
    over MAX_CONFIG_BYTES is refused with its reason (no read of the stream, no hang)."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    cases = {
        "/dev/zero": "not a regular file",
        str(fifo): "not a regular file",
        str(tmp_path): "not a regular file",
        str(big): f"at most {MAX_CONFIG_BYTES}",
    }
    for path, why in cases.items():
        with pytest.raises(ConfigError, match=why) as caught:
            load_config(path)
        assert path in str(caught.value), caught.value


@pytest.mark.reliability(
    "faults",
    "runtime shut down with a raw client's plans handed to it (staged, queued) and another "
    "client's plan waiting in the fair queue",
    tries=3,
    outcome="every plan answered rejected (stale: re-plan), none left undecided; no event "
    "published after the sockets closed (no 'publish() after close()' traceback)",
)
def test_a_shutdown_decides_every_plan_and_publishes_nothing_after_close(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capfd: pytest.CaptureFixture[str]
) -> None:
    """Shut down in the daemon's order (stop the intake, close the runtime, close the sockets)
    while plans are staged, queued and waiting: each client gets ``rejected`` for each of its
    plans, and the runtime's rejections after the sockets closed log no traceback."""
    sockdir = tmp_path_factory.mktemp("s")
    model_dir = ModelDir.write(tmp_path / "m")
    runtime, _ = open_runtime(model_dir.first)
    control = control_server(runtime, sockdir).start()
    endpoint = control.control.endpoint
    closed = False
    try:
        with RawPeer(endpoint) as first, RawPeer(endpoint) as second:
            handed = [plan_frame(model_dir.plan(f"handed-{i}", [OUTPUT])) for i in range(2)]
            for _, frame in handed:
                first.send([frame])
            accepted = [r for r in first.replies(want=3, timeout=2.0) if r[Fields.TYPE] != "staged"]
            assert [r[Fields.TYPE] for r in accepted] == ["accepted"] * 2, accepted
            runtime.wait_staged(WAIT_S)  # nothing commits: no inference loop runs
            waiting_id, frame = plan_frame(model_dir.plan("waiting", [OUTPUT]))
            second.send([frame])
            assert [r[Fields.TYPE] for r in second.replies()] == ["accepted"]
            control.stop_intake()
            runtime.close()
            replies = _finals(first, 2) + _finals(second, 1)
            control.close()
            closed = True
        outcomes = {r[Fields.IN_REPLY_TO]: (r[Fields.TYPE], r[Fields.STALE]) for r in replies}
        expected = [msg_id for msg_id, _ in handed] + [waiting_id]
        assert outcomes == dict.fromkeys(expected, ("rejected", True)), replies
    finally:
        if not closed:
            control.close()
            runtime.close()
    assert "publish() after close()" not in capfd.readouterr().err


def _finals(peer: RawPeer, count: int) -> list[dict[str, Any]]:
    """The next ``count`` outcomes (committed, rejected or error) ``peer`` receives, skipping
    ``staged``."""
    finals: list[dict[str, Any]] = []
    while len(finals) < count:
        got = peer.replies()
        assert got, f"no outcome within the reply timeout; have {finals}"
        finals += [r for r in got if r[Fields.TYPE] != "staged"]
    return finals
