"""Servers, clients and endpoints over real ZeroMQ sockets (ipc:// in a tmp dir, tcp://127.0.0.1)."""

from __future__ import annotations

import os
import pickle
import random
import socket
import stat
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.auth
from gguf import GGMLQuantizationType

from ggufswap.ipc import (
    CurveKeys,
    DealerClient,
    EndpointInUse,
    ErrorCode,
    Fields,
    InsecureEndpoint,
    Job,
    MessageType,
    PeerTimeout,
    Plan,
    PlanCommittedEvent,
    Process,
    Publisher,
    Request,
    RequestServer,
    RuntimeState,
    SlotState,
    SocketOptions,
    Subscriber,
    TensorEntry,
    TensorFallbackEvent,
    committed_from_wire,
    decode,
    encode,
    event_from_wire,
    make_message,
    make_reply,
    plan_to_wire,
    request,
    state_from_wire,
    state_to_wire,
)
from ggufswap.ipc.sockets import TRANSPORT_SLACK_BYTES, bind_endpoint, make_socket
from ggufswap.shards import FileIdentity, TensorRecord

CAP = 64 * 1024  # a small protocol cap keeps the oversized-frame tests fast
WAIT_S = 5.0
INSECURE = SocketOptions(allow_insecure_tcp=True)


@pytest.fixture
def state(tmp_path: Path) -> RuntimeState:
    shard = tmp_path / "m.gguf"
    shard.write_bytes(b"\0" * 256)
    record = TensorRecord(
        "output.weight",
        GGMLQuantizationType.F32,
        (4, 2),
        32,
        32,
        str(shard),
        FileIdentity.of_path(shard),
    )
    return RuntimeState("demo", 3, (TensorEntry(record, "f" * 32, SlotState.ON_ORIGINAL),))


class FakeRuntime:
    """A handler speaking the runtime's side, answering plans later from another thread."""

    def __init__(self, state: RuntimeState):
        self.state = state
        self.server: RequestServer | None = None
        self.workers: list[threading.Thread] = []

    def __call__(self, request: Request) -> dict[str, Any] | None:
        msg, msg_type = request.msg, request.type
        if msg_type is MessageType.STATUS:
            return make_reply(
                msg,
                MessageType.STATUS_REPLY,
                process="runtime",
                status={"pools": {"cpu": [1, 2.5]}},
            )
        if msg_type is MessageType.STATE:
            return make_reply(msg, MessageType.STATE_REPLY, **state_to_wire(self.state))
        if msg_type is MessageType.PLAN:
            plan = request.body
            assert isinstance(plan, Plan), "the server hands the handler the parsed plan"
            if plan.model != self.state.model:
                return make_reply(
                    msg,
                    MessageType.REJECTED,
                    plan_id=plan.plan_id,
                    stale=False,
                    reasons=[{"tensor": j.name, "reason": "unknown model"} for j in plan.jobs],
                )
            worker = threading.Thread(target=self._apply, args=(request.peer, msg, plan))
            self.workers.append(worker)
            worker.start()
            return make_reply(msg, MessageType.ACCEPTED, plan_id=plan.plan_id)
        if msg_type is MessageType.STAGED:
            raise RuntimeError("handler bug")
        raise ValueError(f"not served: {msg_type}")

    def _apply(self, peer: bytes, msg: Mapping[str, Any], plan: Plan) -> None:
        assert self.server is not None
        self.server.send_to(peer, make_reply(msg, MessageType.STAGED, plan_id=plan.plan_id))
        self.server.send_to(
            peer,
            make_reply(
                msg, MessageType.COMMITTED, plan_id=plan.plan_id, weight_version=4, stall_ms=0.5
            ),
        )

    def join(self) -> None:
        for worker in self.workers:
            worker.join(WAIT_S)


@pytest.fixture
def runtime(sockdir: Path, state: RuntimeState) -> Iterator[tuple[RequestServer, FakeRuntime]]:
    handler = FakeRuntime(state)
    server = RequestServer(
        f"ipc://{sockdir}/rt.sock", handler, name="runtime", options=SocketOptions(max_msg_size=CAP)
    )
    handler.server = server
    with server:
        yield server, handler
    handler.join()


def _raw_exchange(
    endpoint: str, frames: list[bytes], *, timeout_s: float = WAIT_S
) -> dict[str, Any] | None:
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER, SocketOptions(max_msg_size=4 * CAP, linger_ms=0))
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return decode(sock.recv())
    finally:
        sock.close(linger=0)


def _ping_ok(endpoint: str, **kwargs: Any) -> None:
    reply = request(endpoint, make_message(MessageType.PING), timeout_s=WAIT_S, retries=0, **kwargs)
    assert reply[Fields.TYPE] == "pong", reply


def test_ping_status_state_roundtrip(
    runtime: tuple[RequestServer, FakeRuntime], state: RuntimeState
) -> None:
    """ping, status and state get pong, status_reply and state_reply naming the request id."""
    server, _ = runtime
    ping = make_message(MessageType.PING)
    pong = request(server.endpoint, ping, timeout_s=WAIT_S)
    assert (pong[Fields.TYPE], pong[Fields.IN_REPLY_TO], pong[Fields.PROCESS]) == (
        "pong",
        ping["id"],
        "runtime",
    )
    assert pong[Fields.UPTIME_S] >= 0
    status = request(server.endpoint, make_message(MessageType.STATUS), timeout_s=WAIT_S)
    assert status[Fields.PROCESS] == Process.RUNTIME.value
    assert status[Fields.STATUS] == {"pools": {"cpu": [1, 2.5]}}
    reply = request(server.endpoint, make_message(MessageType.STATE), timeout_s=WAIT_S)
    assert state_from_wire(reply) == state


def test_plan_sequence_and_rejection(
    runtime: tuple[RequestServer, FakeRuntime], state: RuntimeState
) -> None:
    """A plan gets accepted, then staged and committed pushed later; a wrong model is rejected."""
    server, handler = runtime
    plan = Plan("plan-1", "demo", (Job(state.tensors[0].record, None),))
    with DealerClient(server.endpoint, heartbeat_interval_s=0.2) as client:
        msg = make_message(MessageType.PLAN, **plan_to_wire(plan))
        client.send(msg)
        replies = [client.poll(WAIT_S) for _ in range(3)]
        assert [r and r[Fields.TYPE] for r in replies] == ["accepted", "staged", "committed"]
        assert all(
            r and r[Fields.IN_REPLY_TO] == msg["id"] and r[Fields.PLAN_ID] == "plan-1"
            for r in replies
        )
        assert committed_from_wire(replies[2]).weight_version == 4
        client.send(
            make_message(MessageType.PLAN, **plan_to_wire(Plan("plan-2", "other", plan.jobs)))
        )
        rejected = client.poll(WAIT_S)
        assert rejected is not None
        assert rejected[Fields.TYPE] == "rejected"
        assert rejected[Fields.REASONS] == [{"tensor": "output.weight", "reason": "unknown model"}]
        assert client.connected
    handler.join()


def _frames_that_fail(state: RuntimeState) -> list[tuple[str, list[bytes], ErrorCode]]:
    bad_plan = plan_to_wire(Plan("p", "demo", (Job(state.tensors[0].record),)))
    del bad_plan["jobs"][0]["ne"]
    rng = random.Random(1234)
    return [
        ("pickle", [pickle.dumps({"v": 1, "type": "ping", "id": "x"})], ErrorCode.MALFORMED),
        ("random", [rng.randbytes(200)], ErrorCode.MALFORMED),
        (
            "version",
            [msgpack.packb({"v": 7, "type": "ping", "id": "x"})],
            ErrorCode.UNSUPPORTED_VERSION,
        ),
        ("no-id", [msgpack.packb({"v": 1, "type": "ping"})], ErrorCode.MALFORMED),
        (
            "missing-field",
            [encode(make_message(MessageType.PLAN, **bad_plan))],
            ErrorCode.MALFORMED,
        ),
        (
            "ext",
            [msgpack.packb({"v": 1, "type": "ping", "id": "x", "e": msgpack.ExtType(1, b"a")})],
            ErrorCode.MALFORMED,
        ),
        ("unknown-type", [encode({"v": 1, "type": "reboot", "id": "x"})], ErrorCode.UNKNOWN_TYPE),
        (
            "not-served",
            [encode(make_message(MessageType.ACCEPTED, plan_id="p", in_reply_to="q"))],
            ErrorCode.INTERNAL,
        ),
        (
            "handler-bug",
            [encode(make_message(MessageType.STAGED, plan_id="p", in_reply_to="q"))],
            ErrorCode.INTERNAL,
        ),
        ("two-frames", [b"a", b"b", b"c"], ErrorCode.MALFORMED),
        (
            "over-cap",
            [encode(make_message(MessageType.STATUS, pad="x" * CAP))],
            ErrorCode.TOO_LARGE,
        ),
    ]


def test_bad_frames_get_error_replies(
    runtime: tuple[RequestServer, FakeRuntime], state: RuntimeState
) -> None:
    """Every malformed, unknown, oversized or failing request gets an error; the server goes on."""
    server, _ = runtime
    for label, frames, code in _frames_that_fail(state):
        reply = _raw_exchange(server.endpoint, frames)
        assert reply is not None, f"{label}: no reply"
        assert (reply[Fields.TYPE], reply[Fields.CODE]) == ("error", code), f"{label}: {reply}"
        _ping_ok(server.endpoint)


def test_error_reply_names_request_id(runtime: tuple[RequestServer, FakeRuntime]) -> None:
    """An error about a readable message carries its id in in_reply_to."""
    server, _ = runtime
    reply = _raw_exchange(server.endpoint, [msgpack.packb({"v": 9, "type": "ping", "id": "req-9"})])
    assert reply is not None
    assert reply[Fields.IN_REPLY_TO] == "req-9"


def test_frame_over_transport_limit_is_cut_off(runtime: tuple[RequestServer, FakeRuntime]) -> None:
    """A frame over MAXMSGSIZE gets no reply (libzmq drops it) and the server keeps answering."""
    server, _ = runtime
    huge = encode(make_message(MessageType.STATUS, pad="x" * (CAP + TRANSPORT_SLACK_BYTES + 1)))
    assert _raw_exchange(server.endpoint, [huge], timeout_s=0.5) is None
    _ping_ok(server.endpoint)


def test_req_peer_is_answered(runtime: tuple[RequestServer, FakeRuntime]) -> None:
    """A plain REQ client (empty delimiter frame) gets its reply through the same envelope."""
    server, _ = runtime
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        sock.connect(server.endpoint)
        sock.send(encode(make_message(MessageType.PING)))
        assert sock.poll(int(WAIT_S * 1000))
        assert decode(sock.recv())[Fields.TYPE] == "pong"
    finally:
        sock.close(linger=0)


def test_lazy_pirate_timeout_then_recovery(sockdir: Path) -> None:
    """request retries on fresh sockets, raises PeerTimeout naming the endpoint, then recovers."""
    endpoint = f"ipc://{sockdir}/lp.sock"
    silent = RequestServer(endpoint, lambda request: None, name="silent")
    with silent, pytest.raises(PeerTimeout, match=str(sockdir)):
        request(endpoint, make_message(MessageType.STATUS), timeout_s=0.2, retries=1)
    # A dead server that swallows the first attempt, then a live one: the retry gets through.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dead = make_socket(ctx, zmq.ROUTER, SocketOptions(linger_ms=0))
    bind_endpoint(dead, endpoint)
    result: dict[str, Any] = {}
    msg = make_message(MessageType.PING)
    caller = threading.Thread(
        target=lambda: result.update(request(endpoint, msg, timeout_s=0.3, retries=20))
    )
    caller.start()
    try:
        assert dead.poll(int(WAIT_S * 1000)), "first attempt never arrived"
        dead.close(linger=0)
        ctx.term()  # waits until libzmq has torn the listener down
        with RequestServer(endpoint, lambda request: None, name="back"):
            caller.join(WAIT_S)
    finally:
        caller.join(WAIT_S)
    assert result.get(Fields.TYPE) == "pong"
    assert result[Fields.IN_REPLY_TO] == msg["id"]


def test_dealer_heartbeat_loss_and_reconnect(sockdir: Path) -> None:
    """connected turns False after missed heartbeats, the socket is re-created, then True again."""
    endpoint = f"ipc://{sockdir}/hb.sock"
    with DealerClient(endpoint, heartbeat_interval_s=0.05, heartbeat_liveness=2) as client:
        with RequestServer(endpoint, lambda request: None, name="hb"):
            for _ in range(100):
                if client.connected:
                    break
                client.poll(0.05)
            assert client.connected
        for _ in range(100):
            if not client.connected:
                break
            client.poll(0.05)
        assert not client.connected
        assert client.reconnects >= 1
        with RequestServer(endpoint, lambda request: None, name="hb2"):
            for _ in range(100):
                if client.connected:
                    break
                client.poll(0.05)
            assert client.connected


def test_publisher_events_reach_subscriber(sockdir: Path) -> None:
    """An event is two frames [topic, map]; a subscriber filtering on 'plan.' gets only those."""
    with (
        Publisher(f"ipc://{sockdir}/ev.sock") as pub,
        Subscriber(pub.endpoint, topics=["plan."]) as sub,
    ):
        got = None
        for _ in range(100):  # PUB drops until the subscription has propagated
            pub.publish(TensorFallbackEvent(tensor="x", pool="cpu"))
            pub.publish(PlanCommittedEvent(plan_id="p", weight_version=2, stall_ms=1.0))
            got = sub.recv(0.05)
            if got is not None:
                break
        assert got is not None
        topic, event = got
        assert topic == "plan.committed"
        assert (event[Fields.TYPE], event[Fields.TOPIC], event[Fields.PLAN_ID]) == (
            "event",
            topic,
            "p",
        )
        assert event_from_wire(event) == PlanCommittedEvent("p", 2, 1.0)


def test_tcp_requires_curve_unless_opted_out() -> None:
    """A tcp endpoint without CURVE is refused on both sides unless allow_insecure_tcp is set."""
    with pytest.raises(InsecureEndpoint, match="CURVE"):
        RequestServer("tcp://127.0.0.1:*", lambda request: None, name="t").start()
    with pytest.raises(InsecureEndpoint):
        request("tcp://127.0.0.1:9", make_message(MessageType.PING), timeout_s=0.1)
    with RequestServer(
        "tcp://127.0.0.1:*", lambda request: None, name="t", options=INSECURE
    ) as server:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        assert not server.endpoint.endswith("*")
        _ping_ok(server.endpoint, options=INSECURE)


def _certs(tmp_path: Path) -> tuple[CurveKeys, CurveKeys, CurveKeys]:
    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    keys.mkdir()
    authorized.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(keys, "server")
    client_pub, client_sec = zmq.auth.create_certificates(keys, "client")
    _, intruder_sec = zmq.auth.create_certificates(keys, "intruder")
    (authorized / "client.key").write_bytes(Path(client_pub).read_bytes())
    server = CurveKeys(server_secret_key=Path(server_sec), authorized_keys_dir=authorized)
    good = CurveKeys(client_secret_key=Path(client_sec), server_public_key=Path(server_pub))
    bad = CurveKeys(client_secret_key=Path(intruder_sec), server_public_key=Path(server_pub))
    return server, good, bad


def test_curve_authorized_key_works_unknown_key_ignored(tmp_path: Path) -> None:
    """With CURVE an authorized client key is answered; an unknown key gets no answer at all."""
    server_keys, good, bad = _certs(tmp_path)
    with RequestServer(
        "tcp://127.0.0.1:*", lambda request: None, name="c", options=SocketOptions(server_keys)
    ) as server:
        _ping_ok(server.endpoint, options=SocketOptions(good))
        with pytest.raises(PeerTimeout):
            request(
                server.endpoint,
                make_message(MessageType.PING),
                timeout_s=0.3,
                retries=0,
                options=SocketOptions(bad),
            )
        with pytest.raises(PeerTimeout):  # and plain text is not answered either
            request(
                server.endpoint,
                make_message(MessageType.PING),
                timeout_s=0.3,
                retries=0,
                options=INSECURE,
            )


def test_ipc_dir_private_and_socket_0600(sockdir: Path) -> None:
    """bind creates the socket directory 0700 and the socket file 0600."""
    path = sockdir / "run" / "ggufswap" / "a.sock"
    with RequestServer(f"ipc://{path}", lambda request: None, name="perm") as server:
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        _ping_ok(server.endpoint)
    assert not path.exists()


def test_ipc_open_dir_refused(sockdir: Path) -> None:
    """A socket directory writable by others is refused; a private one is accepted (paired)."""
    shared = sockdir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(InsecureEndpoint, match="0777"):
        RequestServer(f"ipc://{shared}/x.sock", lambda request: None, name="open").start()
    shared.chmod(0o700)
    with RequestServer(f"ipc://{shared}/x.sock", lambda request: None, name="ok") as server:
        _ping_ok(server.endpoint)


def test_ipc_stale_socket_removed_live_one_refused(sockdir: Path) -> None:
    """A stale socket file from a dead process is replaced; one held by a live server is not."""
    path = sockdir / "st.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    with RequestServer(f"ipc://{path}", lambda request: None, name="new") as server:
        _ping_ok(server.endpoint)
        with pytest.raises(EndpointInUse):
            RequestServer(f"ipc://{path}", lambda request: None, name="twin").start()
