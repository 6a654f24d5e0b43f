"""Attacks on both processes, one per test, each with a check that good input still works.

Pickled payloads, frames over the size cap, floods past the high-water mark, CURVE clients with no
key or the wrong key, plans naming files outside the allowed roots and YAML with Python object
tags: each is refused with a clear error, nothing is executed and nothing outside the roots is
opened. Every test records what it tried in the reliability matrix (tests/reliability.py).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.auth
from hostile import (
    MODEL,
    REPLY_TIMEOUT_S,
    TENSOR,
    Live,
    RawPeer,
    current_jobs,
    note,
    plan_message,
    plan_outcome,
    status_frame,
)
from processes import GGUFSWAP, PROBE, Proc, wait_for
from runtime_helpers import WAIT_S, ModelDir, Q, logits, one_thread, open_runtime

from ggufswap.config import ConfigError, load_config
from ggufswap.ipc import (
    DEFAULT_MAX_MSG_SIZE,
    CurveKeys,
    ErrorCode,
    Fields,
    Job,
    MessageType,
    PeerTimeout,
    Plan,
    SocketOptions,
    encode,
    make_message,
    message_from,
)
from ggufswap.ipc import request as ipc_request
from ggufswap.ipc.codec import STATUS_MAX_REQUEST_SIZE
from ggufswap.runtime import HotSwapRuntime, PlanState, Storage
from ggufswap.shards import open_shard_set, read_header, requantize

OUTSIDE = "outside the allowed roots"

pytestmark = pytest.mark.usefixtures(one_thread.__name__)  # torch on one thread (steadier)


def endpoints(live: Live) -> dict[str, str]:
    return {
        "runtime control": live.control,
        "runtime status": live.runtime_status,
        "agent status": live.agent_status,
    }


# --- pickle ---------------------------------------------------------------------------------


class MakesDirectory:
    """Unpickling this calls ``os.mkdir(path)``: proof that a pickle was executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (str(self.path),))


@pytest.mark.process
def test_pickled_payload_is_refused_and_never_unpickled(
    live: Live, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A pickle whose unpickling would create a directory gets MALFORMED on every socket, and the
    directory never appears."""
    armed = tmp_path / "control"
    pickle.loads(pickle.dumps(MakesDirectory(armed)))  # the payload is live: this runs it
    assert armed.is_dir()
    for where, endpoint in endpoints(live).items():
        marker = tmp_path / f"pwned-{where.replace(' ', '-')}"
        payloads = [
            pickle.dumps(MakesDirectory(marker), protocol=p) for p in (2, pickle.HIGHEST_PROTOCOL)
        ]
        for payload in payloads:
            with RawPeer(endpoint) as peer:
                peer.send([payload])
                (reply,) = peer.replies()
            assert reply[Fields.TYPE] == MessageType.ERROR.value, (where, reply)
            assert reply[Fields.CODE] == ErrorCode.MALFORMED, (where, reply)
        assert not marker.exists(), f"{where} unpickled the payload"
    live.alive()
    assert "ipc.malformed" in live.runtime.log()
    assert "ipc.malformed" in live.agent.log()
    note(
        request,
        "security",
        "pickled payload (__reduce__ → os.mkdir) to runtime control/status and agent status",
        tries=6,
        outcome="error MALFORMED, logged ipc.malformed; nothing unpickled",
    )


@pytest.mark.process
def test_plain_status_still_answered_everywhere(live: Live) -> None:
    """Paired with the pickle test: a well-formed status request gets status_reply everywhere."""
    for where, endpoint in endpoints(live).items():
        with RawPeer(endpoint) as peer:
            peer.send([status_frame()])
            (reply,) = peer.replies()
        assert reply[Fields.TYPE] == MessageType.STATUS_REPLY.value, (where, reply)


# --- size cap -------------------------------------------------------------------------------


def caps(live: Live) -> dict[str, int]:
    """Each socket's request cap: 64 MiB on the control socket, 64 KiB on the status sockets."""
    return {
        live.control: DEFAULT_MAX_MSG_SIZE,
        live.runtime_status: STATUS_MAX_REQUEST_SIZE,
        live.agent_status: STATUS_MAX_REQUEST_SIZE,
    }


@pytest.mark.process
def test_frame_just_over_the_cap_gets_too_large(live: Live, request: pytest.FixtureRequest) -> None:
    """A frame one byte over a socket's cap (64 MiB on the control socket, 64 KiB on the status
    sockets) is answered TOO_LARGE naming that cap, by both processes."""
    for where, endpoint in endpoints(live).items():
        cap = caps(live)[endpoint]
        with RawPeer(endpoint) as peer:
            peer.send([b"\x00" * (cap + 1)])
            (reply,) = peer.replies(timeout=20)
        assert reply[Fields.CODE] == ErrorCode.TOO_LARGE, (where, reply)
        assert str(cap) in reply[Fields.MESSAGE]
    live.alive()
    assert "ipc.message_too_large" in live.runtime.log()
    assert "ipc.message_too_large" in live.agent.log()
    note(
        request,
        "security",
        "frame 1 byte over each socket's cap (64 MiB control, 64 KiB status), to every socket",
        tries=3,
        outcome="error TOO_LARGE naming the cap, logged; process keeps serving",
    )


def _reset_peak_rss(pid: int) -> None:
    """Reset the process's peak resident size (VmHWM) to its current size (Linux, root)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def _map_bomb(count: int, msg_type: MessageType) -> bytes:
    """A ``msg_type`` message whose unknown field ``pad`` is an array of ``count`` empty maps:
    one byte each on the wire, ~70 bytes each decoded (issue 28's 3.2 GiB frame)."""
    envelope = encode(make_message(msg_type, pad=[]))  # ... "pad": [] (an empty fixarray)
    assert envelope.endswith(b"\xa3pad\x90"), envelope
    return envelope[:-1] + b"\xdd" + count.to_bytes(4, "big") + b"\x80" * count


BOMB_MAPS = 8 << 20  # an 8 MiB frame: ~600 MB decoded before the budget


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="resetting a process's peak RSS needs root")
def test_a_decode_bomb_under_the_cap_costs_no_memory(
    live: Live, request: pytest.FixtureRequest
) -> None:
    """An 8 MiB frame of 8 million empty maps (under the 64 MiB cap) to the control socket is
    refused MALFORMED by the decode budget before anything is built, and cut off by the status
    sockets' 64 KiB cap; neither process's peak memory grows by more than 64 MiB, and a bomb
    under the status cap (60,000 maps) is answered."""
    pids = {"runtime": live.runtime.popen.pid, "agent": live.agent.popen.pid}
    for pid in pids.values():
        _reset_peak_rss(pid)
    before = {name: _peak_rss(pid) for name, pid in pids.items()}
    bomb = _map_bomb(BOMB_MAPS, MessageType.STATE)
    with RawPeer(live.control) as peer:
        peer.send([bomb])
        (reply,) = peer.replies(timeout=30)
    assert reply[Fields.CODE] == ErrorCode.MALFORMED, reply
    assert "budget" in reply[Fields.MESSAGE], reply
    status_bomb = _map_bomb(BOMB_MAPS, MessageType.STATUS)
    for endpoint in (live.runtime_status, live.agent_status):
        with RawPeer(endpoint) as peer:
            peer.send([status_bomb])
            assert peer.replies(timeout=1.0) == []  # past the transport limit: cut off
        with RawPeer(endpoint) as peer:
            peer.send([_map_bomb(60_000, MessageType.STATUS)])
            (reply,) = peer.replies()
        assert reply[Fields.TYPE] == MessageType.STATUS_REPLY.value, reply
    growth = {name: _peak_rss(pid) - before[name] for name, pid in pids.items()}
    for name, grown in growth.items():
        assert grown < 64 << 20, f"the {name}'s peak memory grew by {grown >> 20} MiB"
    live.alive()
    note(
        request,
        "security",
        "decode bomb: 8 MiB frame of 8 million empty maps (under the 64 MiB cap) to every socket",
        tries=3,
        outcome="control: MALFORMED by the decode budget before any map is built; status "
        f"sockets: cut off at their 64 KiB cap; peak memory +{growth['runtime'] >> 20} MiB "
        f"runtime, +{growth['agent'] >> 20} MiB agent (was ~600 MB)",
    )


@pytest.mark.process
def test_a_plan_to_a_status_socket_is_refused_before_its_body_is_read(live: Live) -> None:
    """A ``plan`` to a status socket gets UNKNOWN_TYPE naming what the socket serves, even when
    its body could not be decoded (an ext value): the envelope was checked first."""
    frame = encode(make_message(MessageType.PLAN, pad=[])).replace(b"\x90", b"\x91\xd4\x01\x00")
    for endpoint in (live.runtime_status, live.agent_status):
        with RawPeer(endpoint) as peer:
            peer.send([frame])
            (reply,) = peer.replies()
        assert reply[Fields.CODE] == ErrorCode.UNKNOWN_TYPE, reply
        assert "status" in reply[Fields.MESSAGE], reply


@pytest.mark.process
def test_frame_far_over_the_cap_is_cut_off_and_process_keeps_serving(
    live: Live, request: pytest.FixtureRequest
) -> None:
    """A 96 MiB frame (past the transport limit) is dropped by libzmq; both still answer status."""
    frame = b"\x00" * (96 << 20)
    for endpoint in endpoints(live).values():
        with RawPeer(endpoint) as peer:
            peer.send([frame])
            assert peer.replies(timeout=1.0) == []  # the connection was cut, nothing buffered
        assert live.status(endpoint)
    live.alive()
    note(
        request,
        "security",
        "frame of 96 MiB (past the transport limit), to every socket",
        tries=3,
        outcome="connection dropped by libzmq; status still answered",
    )


@pytest.mark.process
def test_large_frame_under_the_cap_is_served(live: Live) -> None:
    """Paired with the cap tests: a 16 MiB status request (unknown padding field) is answered."""
    msg = message_from(MessageType.STATUS, {"padding": b"\x00" * (16 << 20)})
    with RawPeer(live.control) as peer:
        peer.send([encode(msg)])
        (reply,) = peer.replies(timeout=20)
    assert reply[Fields.TYPE] == MessageType.STATUS_REPLY.value


# --- flood past the high-water mark ---------------------------------------------------------

FLOOD = 20_000  # requests sent without reading a reply: 20 times the sockets' HWM of 1000


def flood(endpoint: str, stop: threading.Event, sent: list[int]) -> None:
    """Send ``state``/``status`` requests without ever reading the replies until ``stop``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # queue everything on our side: the server sees it all
    sock.setsockopt(zmq.RCVHWM, 10)  # and hold back almost nothing of its replies
    sock.connect(endpoint)
    frames = [
        encode(make_message(MessageType.STATE)),
        encode(make_message(MessageType.STATUS)),
    ]
    try:
        for i in range(FLOOD):
            sock.send(frames[i % 2])
            sent[0] += 1
        stop.wait(60)
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.process
def test_flood_past_hwm_keeps_the_control_path_working(
    live: Live, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """With 20,000 unread requests queued at the runtime, a plan still commits and status still
    answers within the reply timeout; replies the flooder never reads are dropped and logged."""
    stop = threading.Event()
    sent = [0]
    threads = [
        threading.Thread(target=flood, args=(ep, stop, sent), daemon=True)
        for ep in (live.control, live.agent_status)
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: sent[0] >= 2 * FLOOD, timeout=30, what="the flood to be queued")
        record = open_shard_set(live.first).tensors[TENSOR]
        before = live.weight_version()
        started = time.monotonic()
        requantize(Path(record.path), TENSOR, Q.Q4_0)
        outcome = plan_outcome(live.control, plan_message(current_jobs(live.first, [TENSOR])))
        assert outcome[Fields.TYPE] == MessageType.COMMITTED.value, outcome
        for endpoint in (live.control, live.runtime_status, live.agent_status):
            reply = ipc_request(
                endpoint, make_message(MessageType.STATUS), timeout_s=REPLY_TIMEOUT_S, retries=0
            )
            assert reply[Fields.TYPE] == MessageType.STATUS_REPLY.value
        took = time.monotonic() - started
        wait_for(
            lambda: "ipc.reply_dropped" in live.runtime.log(),
            timeout=30,
            what="the runtime to log dropped replies",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert live.weight_version() == before + 1
    live.alive()
    note(
        request,
        "security",
        f"flood: {FLOOD} unread state/status requests each to runtime control and agent status",
        tries=2 * FLOOD,
        outcome="plan committed and status answered meanwhile; dropped replies logged",
    )
    assert took < 60, took


# --- CURVE on tcp ---------------------------------------------------------------------------


@dataclasses.dataclass
class CurveRuntime:
    control: str
    good: CurveKeys
    proc: Proc
    keys: Path


@pytest.fixture(scope="module")
def curve_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CurveRuntime]:
    """A runtime process on tcp://127.0.0.1 with CURVE: one authorized client key."""
    from hostile import free_tcp_ports

    from ggufswap.shards import Layout, tiny_moe, write_model

    tmp = tmp_path_factory.mktemp("curve")
    keys = tmp / "keys"
    authorized = tmp / "authorized"
    keys.mkdir()
    authorized.mkdir()
    for name in ("server", "client", "intruder"):
        zmq.auth.create_certificates(str(keys), name)
    shutil.copy(keys / "client.key", authorized / "client.key")
    model_dir = tmp / "model"
    model_dir.mkdir()
    first = write_model(tiny_moe(), model_dir, layout=Layout.SINGLE)[0]
    ports = free_tcp_ports(3)
    control = f"tcp://127.0.0.1:{ports[0]}"
    config = tmp / "config.yaml"
    config.write_text(
        f"""
runtime:
  name: {MODEL}
  model: {first}
  control_endpoint: {control}
  status_endpoint: tcp://127.0.0.1:{ports[1]}
  events_endpoint: tcp://127.0.0.1:{ports[2]}
  pools: [{{name: host, device: cpu}}]
security:
  curve:
    server_secret_key: {keys}/server.key_secret
    server_public_key: {keys}/server.key
    client_secret_key: {keys}/client.key_secret
    authorized_keys_dir: {authorized}
"""
    )
    good = CurveKeys(
        server_public_key=keys / "server.key", client_secret_key=keys / "client.key_secret"
    )
    proc = Proc(["runtime", "--config", str(config), *PROBE], log=tmp / "runtime.log")
    try:
        wait_for(
            lambda: curve_status(control, good, timeout=1.0),
            timeout=60,
            what="the CURVE runtime to answer an authorized client",
        )
        yield CurveRuntime(control=control, good=good, proc=proc, keys=keys)
    finally:
        proc.stop()


def curve_status(
    endpoint: str, curve: CurveKeys | None, *, timeout: float
) -> dict[str, Any] | None:
    try:
        return ipc_request(
            endpoint,
            make_message(MessageType.STATUS),
            timeout_s=timeout,
            retries=0,
            options=SocketOptions(curve=curve, allow_insecure_tcp=curve is None),
        )
    except PeerTimeout:
        return None


@pytest.mark.process
def test_curve_refuses_unauthenticated_and_wrong_key_clients(
    curve_runtime: CurveRuntime, request: pytest.FixtureRequest
) -> None:
    """On tcp with CURVE, a plain client, an unlisted client key and a client expecting another
    server key all get no answer, while the authorized client is served."""
    keys = curve_runtime.keys
    attempts = {
        "no CURVE at all": None,
        "client key not in authorized_keys_dir": CurveKeys(
            server_public_key=keys / "server.key", client_secret_key=keys / "intruder.key_secret"
        ),
        "wrong server public key": CurveKeys(
            server_public_key=keys / "intruder.key", client_secret_key=keys / "client.key_secret"
        ),
    }
    proc = curve_runtime.proc
    for what, curve in attempts.items():
        logged = proc.log().count("ipc.handshake_refused")
        assert curve_status(curve_runtime.control, curve, timeout=1.5) is None, what
        wait_for(
            lambda logged=logged: proc.log().count("ipc.handshake_refused") > logged,
            timeout=10,
            what=f"a logged refusal of the client with {what}",
        )
        reply = curve_status(curve_runtime.control, curve_runtime.good, timeout=REPLY_TIMEOUT_S)
        assert reply is not None, f"the authorized client is not served after: {what}"
        assert reply[Fields.TYPE] == MessageType.STATUS_REPLY.value
    assert proc.popen.poll() is None
    note(
        request,
        "security",
        "tcp clients without CURVE, with an unlisted key, or expecting another server key",
        tries=len(attempts),
        outcome="no answer; ipc.handshake_refused logged; the authorized key is served",
    )


# --- plans naming files outside the allowed roots -------------------------------------------

_opened: list[str] = []
_armed = threading.Event()
_hook: list[bool] = []  # non-empty once the audit hook is installed


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _armed.is_set() and args and isinstance(args[0], str | bytes):
        _opened.append(os.fsdecode(args[0]))


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """Paths passed to open()/os.open() in this process while the test runs (audit hook)."""
    if not _hook:
        sys.addaudithook(_audit)  # hooks cannot be removed; this one only records when armed
        _hook.append(True)
    _opened.clear()
    _armed.set()
    try:
        yield _opened
    finally:
        _armed.clear()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ModelDir, HotSwapRuntime, Any]]:
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, model = open_runtime(model_dir.first, storage=Storage.DEQUANTIZED)
    try:
        yield model_dir, runtime, model
    finally:
        runtime.close()


def settle(runtime: HotSwapRuntime, plan: Plan) -> Any:
    ticket = runtime.submit(plan)
    deadline = time.monotonic() + WAIT_S
    while not ticket.state.final and time.monotonic() < deadline:
        runtime.wait_staged(timeout=1.0)
        runtime.at_batch_boundary()
    assert ticket.state.final, ticket.summary()
    return ticket


def test_plans_outside_the_roots_are_refused_and_nothing_there_is_opened(
    served: tuple[ModelDir, HotSwapRuntime, Any],
    tmp_path: Path,
    opened: list[str],
    request: pytest.FixtureRequest,
) -> None:
    """``..``, an absolute path, a file symlink, a directory symlink and a FIFO outside the root
    are each refused naming the resolved path; no file outside the root is ever opened."""
    model_dir, runtime, model = served
    baseline = logits(model)
    outside = tmp_path / "outside"
    variant = model_dir.variant(TENSOR, Q.Q4_0, outside)  # a valid shard, outside the root
    record = read_header(variant).tensor_map()[TENSOR]
    os.symlink(variant, model_dir.root / "escape.gguf")
    os.symlink(outside, model_dir.root / "escape-dir")
    fifo = outside / "blocks-if-opened.gguf"
    os.mkfifo(fifo)
    rel = os.path.relpath(variant, model_dir.root)
    attacks = {
        "'..' out of the root": f"{model_dir.root}/{rel}",
        "absolute path outside": str(variant),
        "file symlink escaping the root": str(model_dir.root / "escape.gguf"),
        "directory symlink escaping the root": str(model_dir.root / "escape-dir" / variant.name),
        "FIFO outside the root": str(fifo),
    }
    opened.clear()  # what the setup above wrote and read does not count
    for i, (what, path) in enumerate(attacks.items()):
        job = Job(dataclasses.replace(record, path=path))
        ticket = settle(runtime, Plan(f"escape-{i}", "", (job,)))
        assert ticket.state is PlanState.REJECTED, what
        (reason,) = ticket.reasons
        assert reason.tensor == TENSOR, (what, reason)
        assert OUTSIDE in reason.reason, (what, reason)
        assert str(outside) in reason.reason, (what, reason)
    escaped = [p for p in opened if os.path.realpath(p).startswith(str(outside))]
    assert escaped == [], escaped
    assert runtime.weight_version == 0
    assert torch.equal(logits(model), baseline)
    note(
        request,
        "security",
        "plans naming files outside allowed_roots: '..', absolute, file symlink, dir symlink, FIFO",
        tries=len(attacks),
        outcome="rejected naming the resolved path; nothing outside opened; model unchanged",
    )


def test_dotdot_that_stays_inside_the_root_is_accepted(
    served: tuple[ModelDir, HotSwapRuntime, Any], tmp_path: Path
) -> None:
    """Paired with the escapes: ``sub/../file`` inside the root, and a symlink to a file inside
    the root, are accepted and committed."""
    model_dir, runtime, _ = served
    variant = model_dir.variant(TENSOR, Q.Q4_0, model_dir.root / "variants")
    (model_dir.root / "sub").mkdir()
    os.symlink(variant, model_dir.root / "inside-link.gguf")
    record = read_header(variant).tensor_map()[TENSOR]
    paths = [
        f"{model_dir.root}/sub/../variants/{variant.name}",
        str(model_dir.root / "inside-link.gguf"),
    ]
    for i, path in enumerate(paths):
        job = Job(dataclasses.replace(record, path=path))
        # alternate with the original content so that each plan changes something
        original = Job(model_dir.record(TENSOR))
        for j, plan_job in enumerate((job, original)):
            ticket = settle(runtime, Plan(f"inside-{i}-{j}", "", (plan_job,)))
            assert ticket.state is PlanState.COMMITTED, (path, ticket.summary())
    assert runtime.weight_version == 4


# --- YAML with Python object tags -----------------------------------------------------------

PYTHON_TAGS = [
    "!!python/object/apply:os.system ['mkdir {marker}']",
    "!!python/object/apply:os.mkdir ['{marker}']",
    "!!python/object/new:os.mkdir ['{marker}']",
    "!!python/name:os.system ''",
    "!!python/module:os ''",
    "!!python/object:pathlib.Path {{}}",
    "!<tag:yaml.org,2002:python/object/apply:os.mkdir> ['{marker}']",
]


def test_yaml_python_tags_are_refused_with_their_line_and_never_run(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Every Python object tag, in any position, is a ConfigError naming its line; nothing runs."""
    marker = tmp_path / "pwned"
    for i, tag in enumerate(PYTHON_TAGS):
        value = tag.format(marker=marker)
        text = (
            "models:\n"
            "  - name: m\n"
            "    watch: [{path: /d}]\n"
            f"    settle_ms: {value}\n"
            f"    ignore: [{value}]\n"
        )
        path = tmp_path / f"c{i}.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(path, environ={"RUNTIME_DIRECTORY": str(tmp_path / "run")})
        lines = sorted(p.line for p in info.value.problems if "tag" in p.message)
        assert lines == [4, 5], (tag, [str(p) for p in info.value.problems])
        assert all(str(path) in str(p) for p in info.value.problems)
        assert not marker.exists(), f"{tag} was executed"
    note(
        request,
        "security",
        f"YAML with Python object tags ({len(PYTHON_TAGS)} forms, as scalar and in a list)",
        tries=2 * len(PYTHON_TAGS),
        outcome="ConfigError naming file and line; nothing constructed or run",
    )


@pytest.mark.process
def test_config_check_cli_refuses_python_tag(tmp_path: Path) -> None:
    """``ggufswap check-config`` on a file with an os.system tag exits 1, names the line, runs
    nothing."""
    marker = tmp_path / "pwned"
    path = tmp_path / "c.yaml"
    path.write_text(f"runtime:\n  model: !!python/object/apply:os.system ['mkdir {marker}']\n")
    done = subprocess.run(
        [GGUFSWAP, "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done
    assert f"{path}:2" in done.stdout + done.stderr
    assert not marker.exists()


# --- plans whose records disagree with the file (found by test_fuzz_live) -------------------

Q_ATTN = "blk.0.attn_q.weight"  # F16 in runtime_helpers.mixed_moe


def test_plan_records_must_match_the_files_own_header(
    served: tuple[ModelDir, HotSwapRuntime, Any], request: pytest.FixtureRequest
) -> None:
    """A plan naming bytes the file's header does not describe (an offset into the header,
    another tensor's name, F16 bytes read as BF16) is refused naming both; nothing changes.

    Regression: the runtime used to trust the plan's offset, name and type once the file identity
    matched, so a mutated plan could load header bytes or reinterpret a tensor (fuzz found it).
    """
    model_dir, runtime, model = served
    baseline = logits(model)
    down = model_dir.record(TENSOR)
    attn = model_dir.record(Q_ATTN)
    assert attn.ggml_type == Q.F16
    forged = {
        "offset into the header": dataclasses.replace(down, offset=down.offset - 32),
        "another tensor's name": dataclasses.replace(down, name="blk.0.ffn_down_exps.weight"),
        "same bytes read as another type": dataclasses.replace(attn, ggml_type=Q.BF16),
    }
    for i, (what, record) in enumerate(forged.items()):
        ticket = settle(runtime, Plan(f"forged-{i}", "", (Job(record),)))
        assert ticket.state is PlanState.REJECTED, what
        (reason,) = ticket.reasons
        assert record.path in reason.reason, (what, reason)
        assert "header" in reason.reason, (what, reason)
        assert not reason.stale, what
    assert runtime.weight_version == 0
    assert torch.equal(logits(model), baseline)
    ticket = settle(runtime, Plan("genuine", "", (Job(down), Job(attn))))
    assert ticket.state is PlanState.COMMITTED  # paired: the header's own records are accepted
    note(
        request,
        "bad input",
        "plan records disagreeing with the file's header: offset, tensor name, type (F16→BF16)",
        tries=len(forged),
        outcome="rejected naming the file and both descriptions; model unchanged",
    )
