"""Wire records and the frame codec: roundtrips, strict validation, hostile bytes."""

from __future__ import annotations

import dataclasses
import pickle
import re
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fuzz_budget
import msgpack
import pytest
from gguf import GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufswap.ipc import (
    PROTOCOL_VERSION,
    Accepted,
    Committed,
    ErrorCode,
    ErrorReply,
    Fields,
    Incoming,
    IpcError,
    Job,
    MalformedMessage,
    MessageTooLarge,
    MessageType,
    Plan,
    Pong,
    Process,
    Reason,
    Rejected,
    RuntimeState,
    SlotState,
    Staged,
    StatusReply,
    TensorEntry,
    UnknownMessageType,
    UnsupportedVersion,
    codec,
    committed_from_wire,
    committed_to_wire,
    decode,
    encode,
    error_from_wire,
    make_error,
    make_message,
    make_reply,
    message_from,
    parse_reply,
    plan_from_wire,
    plan_to_wire,
    record_from_wire,
    record_to_wire,
    rejected_from_wire,
    rejected_to_wire,
    state_from_wire,
    state_to_wire,
    validate_message,
)
from ggufswap.ipc.bodies import StateRequest, state_request_from_wire, state_request_to_wire
from ggufswap.ipc.messages import MAX_ID_LENGTH
from ggufswap.ipc.plan import MAX_PLAN_JOBS
from ggufswap.ipc.schema import REPLY_TYPES
from ggufswap.shards import FileIdentity, TensorRecord

FUZZ_EXAMPLES = fuzz_budget.examples(300)


@pytest.fixture
def record(tmp_path: Path) -> TensorRecord:
    shard = tmp_path / "m-00001-of-00002.gguf"
    shard.write_bytes(b"\0" * 4096)
    return TensorRecord(
        name="blk.0.ffn_up_exps.weight",
        ggml_type=GGMLQuantizationType.Q4_0,
        ne=(64, 32, 8),
        offset=1024,
        nbytes=64 * 32 * 8 // 32 * 18,
        path=str(shard),
        identity=FileIdentity.of_path(shard),
    )


def _through_codec(body: dict[str, Any], msg_type: MessageType) -> dict[str, Any]:
    return decode(encode(make_message(msg_type, **body)))


def test_record_roundtrip(record: TensorRecord) -> None:
    """A TensorRecord survives record_to_wire → msgpack → record_from_wire unchanged."""
    msg = _through_codec({"record": record_to_wire(record)}, MessageType.STATUS)
    assert record_from_wire(msg["record"]) == record


def test_plan_roundtrip(record: TensorRecord) -> None:
    """A Plan with and without fingerprints survives the wire unchanged and validates."""
    other = TensorRecord(
        "token_embd.weight", GGMLQuantizationType.F16, (16, 4), 0, 128, record.path, record.identity
    )
    plan = Plan("p1", "demo", (Job(record, "ab" * 16), Job(other, None)))
    msg = _through_codec(plan_to_wire(plan), MessageType.PLAN)
    assert validate_message(msg) is MessageType.PLAN
    assert plan_from_wire(msg) == plan


def test_a_plan_sent_again_is_the_same_plan_and_another_is_not(record: TensorRecord) -> None:
    """A plan read back from the wire, or with its jobs in another order, is the same plan; one
    with another model, a job more or less, or a job of other bytes or fingerprint is not."""
    other = TensorRecord(
        "token_embd.weight", GGMLQuantizationType.F16, (16, 4), 0, 128, record.path, record.identity
    )
    plan = Plan("p1", "demo", (Job(record, "ab" * 16), Job(other, None)))
    assert plan.same_as(plan_from_wire(_through_codec(plan_to_wire(plan), MessageType.PLAN)))
    assert plan.same_as(dataclasses.replace(plan, jobs=plan.jobs[::-1]))
    moved = dataclasses.replace(other, offset=256)
    for another in (
        dataclasses.replace(plan, model="other"),
        dataclasses.replace(plan, jobs=plan.jobs[:1]),
        dataclasses.replace(plan, jobs=(*plan.jobs, Job(dataclasses.replace(other, name="x")))),
        dataclasses.replace(plan, jobs=(plan.jobs[0], Job(moved, None))),
        dataclasses.replace(plan, jobs=(Job(record, "cd" * 16), plan.jobs[1])),
        dataclasses.replace(plan, jobs=(plan.jobs[0], Job(other, "ef" * 16))),
        dataclasses.replace(plan, jobs=(plan.jobs[0], plan.jobs[0])),
    ):
        assert not plan.same_as(another)
        assert not another.same_as(plan)


def test_state_committed_rejected_roundtrip(record: TensorRecord) -> None:
    """state_reply, committed and rejected bodies roundtrip through their typed records."""
    state = RuntimeState("demo", 7, (TensorEntry(record, None, SlotState.FALLBACK_CPU),))
    msg = _through_codec(state_to_wire(state), MessageType.STATE_REPLY)
    assert record.name in msg[Fields.TENSORS]
    assert Fields.Tensor.NAME not in msg[Fields.TENSORS][record.name]
    assert state_from_wire(msg) == state
    committed = Committed("p1", 8, 1.5)
    assert (
        committed_from_wire(_through_codec(committed_to_wire(committed), MessageType.COMMITTED))
        == committed
    )
    rejected = Rejected("p1", True, (Reason(record.name, "file changed", stale=True),))
    assert (
        rejected_from_wire(_through_codec(rejected_to_wire(rejected), MessageType.REJECTED))
        == rejected
    )


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("type", 9999, "jobs[0].type"),
        ("type", True, "jobs[0].type"),
        ("ne", [], "jobs[0].ne"),
        ("ne", [1, -2], "jobs[0].ne[1]"),
        ("offset", "12", "jobs[0].offset"),
        ("identity", [1, 2, 3], "jobs[0].identity"),
        ("fingerprint", 5, "jobs[0].fingerprint"),
        ("path", "", "jobs[0].path"),
        ("path", "/srv/m/model.gguf\x00", "jobs[0].path"),
    ],
)
def test_plan_bad_job_field_named(
    record: TensorRecord, field: str, value: object, named: str
) -> None:
    """A plan job with a wrongly typed field is MalformedMessage naming that field."""
    body = plan_to_wire(Plan("p1", "demo", (Job(record),)))
    body["jobs"][0][field] = value
    with pytest.raises(MalformedMessage, match=named.replace("[", r"\[").replace("]", r"\]")):
        plan_from_wire(body)


def test_plan_missing_field_and_duplicates(record: TensorRecord) -> None:
    """A job without nbytes, and a plan naming one tensor twice, are refused with the field."""
    body = plan_to_wire(Plan("p1", "demo", (Job(record),)))
    del body["jobs"][0]["nbytes"]
    with pytest.raises(MalformedMessage, match=r"jobs\[0\]\.nbytes.*missing"):
        plan_from_wire(body)
    body = plan_to_wire(Plan("p1", "demo", (Job(record), Job(record))))
    with pytest.raises(MalformedMessage, match="duplicate"):
        plan_from_wire(body)


def test_unknown_fields_are_ignored(record: TensorRecord) -> None:
    """Fields this version does not know are ignored at every level (forward compatibility)."""
    body = plan_to_wire(Plan("p1", "demo", (Job(record),)))
    body["priority"] = 3
    body["jobs"][0]["future"] = {"x": [1, 2]}
    msg = _through_codec(body, MessageType.PLAN)
    assert validate_message(msg) is MessageType.PLAN
    assert plan_from_wire(msg).jobs[0].source == record


def test_validate_unknown_type_and_missing_field() -> None:
    """An unknown type raises UnknownMessageType; a pong without uptime names the field."""
    with pytest.raises(UnknownMessageType, match="reboot"):
        validate_message({"v": 1, "type": "reboot", "id": "a"})
    with pytest.raises(MalformedMessage, match="uptime_s"):
        validate_message(make_message(MessageType.PONG, process="agent"))


_REQUEST = {Fields.ID: "req-1"}


def _replies(record: TensorRecord) -> list[tuple[dict[str, Any], object]]:
    """One reply of each type a client reads, as the runtime builds it, and its record."""
    state = RuntimeState("m", 4, (TensorEntry(record, "ab" * 16, SlotState.DETACHED),))
    reasons = (Reason("blk.0.attn_q.weight", "changed", stale=True),)
    return [
        (
            make_reply(_REQUEST, MessageType.PONG, process="runtime", uptime_s=2.5),
            Pong("runtime", 2.5),
        ),
        (
            make_reply(_REQUEST, MessageType.STATUS_REPLY, process="agent", status={"a": 1}),
            StatusReply(Process.AGENT, {"a": 1}),
        ),
        (make_reply(_REQUEST, MessageType.STATE_REPLY, **state_to_wire(state)), state),
        (make_reply(_REQUEST, MessageType.ACCEPTED, plan_id="p1"), Accepted("p1")),
        (make_reply(_REQUEST, MessageType.STAGED, plan_id="p1"), Staged("p1")),
        (
            make_reply(
                _REQUEST, MessageType.COMMITTED, **committed_to_wire(Committed("p1", 5, 1.25))
            ),
            Committed("p1", 5, 1.25),
        ),
        (
            make_reply(
                _REQUEST, MessageType.REJECTED, **rejected_to_wire(Rejected("p1", True, reasons))
            ),
            Rejected("p1", True, reasons),
        ),
        (
            make_error("req-1", ErrorCode.MALFORMED, "bad"),
            ErrorReply("req-1", ErrorCode.MALFORMED, "bad"),
        ),
    ]


def test_each_reply_type_reads_into_its_record(record: TensorRecord) -> None:
    """A client reads every reply type (through the codec) into its frozen record, with the id
    of the request it answers: one row per reply type of the schema."""
    replies = _replies(record)
    assert {MessageType(msg[Fields.TYPE]) for msg, _ in replies} == REPLY_TYPES
    for msg, expected in replies:
        incoming = parse_reply(decode(encode(msg)))
        assert incoming == Incoming(in_reply_to="req-1", body=expected), msg[Fields.TYPE]


@pytest.mark.parametrize(
    ("msg_type", "fields", "named"),
    [
        (MessageType.ACCEPTED, {"in_reply_to": "r"}, "plan_id"),
        (MessageType.STAGED, {"in_reply_to": "r", "plan_id": ""}, "plan_id"),
        (MessageType.ACCEPTED, {"in_reply_to": 7, "plan_id": "p"}, "in_reply_to"),
        (
            MessageType.COMMITTED,
            {"in_reply_to": "r", "plan_id": "p", "weight_version": -1, "stall_ms": 0},
            "weight_version",
        ),
        (
            MessageType.REJECTED,
            {
                "in_reply_to": "r",
                "plan_id": "p",
                "stale": False,
                "reasons": [{"tensor": 3, "reason": "x"}],
            },
            "reasons[0].tensor",
        ),
        (MessageType.STATE_REPLY, {"model": "m", "weight_version": 0, "tensors": []}, "tensors"),
        (MessageType.PONG, {"process": "runtime", "uptime_s": "long"}, "uptime_s"),
        (MessageType.STATUS_REPLY, {"process": "sidecar", "status": {}}, "process"),
        (MessageType.ERROR, {"in_reply_to": "r", "code": "E1", "message": "m"}, "code"),
    ],
    ids=lambda v: v.value if isinstance(v, MessageType) else None,
)
def test_a_malformed_reply_is_refused_naming_its_field(
    msg_type: MessageType, fields: dict[str, Any], named: str
) -> None:
    """A reply whose body does not match its schema is MalformedMessage naming the field, as a
    malformed request is on the runtime side."""
    with pytest.raises(MalformedMessage, match=f"field '{re.escape(named)}'"):
        parse_reply(_through_codec(fields, msg_type))


def test_a_request_type_is_not_a_reply() -> None:
    """A client refuses a request type (a peer that sends it a ``plan``) with
    UnknownMessageType naming the reply types it reads."""
    with pytest.raises(UnknownMessageType, match=r"plan.*accepted"):
        parse_reply(_through_codec(plan_to_wire(Plan("p", "m", ())), MessageType.PLAN))


def test_error_reply_fields() -> None:
    """make_error builds a valid error message that error_from_wire reads back."""
    msg = decode(encode(make_error("abc", ErrorCode.TOO_LARGE, "too big")))
    assert validate_message(msg) is MessageType.ERROR
    reply = error_from_wire(msg)
    assert (reply.in_reply_to, reply.code, reply.message) == ("abc", ErrorCode.TOO_LARGE, "too big")


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (pickle.dumps({"v": 1, "type": "ping", "id": "x"}), MalformedMessage),
        (msgpack.packb([1, "ping", "x"]), MalformedMessage),
        (msgpack.packb({"type": "ping", "id": "x"}), MalformedMessage),
        (msgpack.packb({"v": 1, "type": "ping"}), MalformedMessage),
        (msgpack.packb({"v": True, "type": "ping", "id": "x"}), MalformedMessage),
        (msgpack.packb({"v": 2, "type": "ping", "id": "x"}), UnsupportedVersion),
        (
            msgpack.packb({"v": 1, "type": "ping", "id": "x", "e": msgpack.ExtType(5, b"z")}),
            MalformedMessage,
        ),
        (
            msgpack.packb({"v": 1, "type": "ping", "id": "x", "t": msgpack.Timestamp(1, 0)}),
            MalformedMessage,
        ),
        (msgpack.packb({"v": 1, "type": "ping", "id": "x", "m": {b"k": 1}}), MalformedMessage),
        (msgpack.packb({"v": 1, "type": "ping", "id": "x"}) + b"\x00", MalformedMessage),
        (b"", MalformedMessage),
        (b"\x91" * 5000, MalformedMessage),
        (b"\xdd\xff\xff\xff\xff", MalformedMessage),  # array of 2**32-1 items in 5 bytes
    ],
)
def test_decode_rejects(frame: bytes, error: type[Exception]) -> None:
    """Each hostile or ill-shaped frame is refused with the matching protocol error."""
    with pytest.raises(error):
        decode(frame)


def test_decode_keeps_id_for_error_replies() -> None:
    """A wrongly versioned message's id is kept on the error so the reply can name it."""
    with pytest.raises(UnsupportedVersion) as info:
        decode(msgpack.packb({"v": 99, "type": "ping", "id": "req-1"}))
    assert info.value.msg_id == "req-1"


def test_decode_size_cap() -> None:
    """A frame over max_size is MessageTooLarge; one at exactly max_size is accepted."""
    frame = encode(make_message(MessageType.STATUS, pad="x" * 100))
    assert decode(frame, max_size=len(frame))[Fields.V] == PROTOCOL_VERSION
    with pytest.raises(MessageTooLarge):
        decode(frame, max_size=len(frame) - 1)


EMPTY_MAPS = 20_000  # 20 KB on the wire, ~1.4 MB decoded: past the (lowered) decode budget


@pytest.mark.reliability(
    "security",
    "decode bomb: a frame of empty maps (one byte each) worth twice the decode budget",
    tries=1,
    outcome="MalformedMessage naming the decode budget; under 64 KiB allocated while refusing it",
)
def test_a_frame_of_empty_maps_is_refused_before_anything_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frame far under the size cap that would decode to more objects than the budget is
    refused by the walk before any of them is built (Python allocates almost nothing). The
    budget is lowered here to keep the test small; the live test sends the real-sized bomb."""
    monkeypatch.setattr(codec, "MAX_DECODED_OBJECTS", EMPTY_MAPS * codec.CONTAINER_COST // 2)
    monkeypatch.setattr(codec, "SCAN_ABOVE_BYTES", 0)
    head = encode(make_message(MessageType.STATUS, pad=[]))[:-1]
    frame = head + b"\xdd" + EMPTY_MAPS.to_bytes(4, "big") + b"\x80" * EMPTY_MAPS
    tracemalloc.start()
    try:
        with pytest.raises(MalformedMessage, match="decode budget"):
            decode(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, f"{peak} bytes allocated while refusing the frame"


def test_a_plan_of_the_most_jobs_allowed_fits_the_decode_budget(record: TensorRecord) -> None:
    """Paired with the bomb: a plan's cost grows by a fixed amount per job (each with a
    fingerprint and a long path), and MAX_PLAN_JOBS of them fit the budget."""

    def cost(n: int) -> int:
        jobs = tuple(
            Job(dataclasses.replace(record, name=f"blk.{i}.ffn_up_exps.weight"), "f" * 32)
            for i in range(n)
        )
        frame = encode(message_from(MessageType.PLAN, plan_to_wire(Plan("p", "m", jobs))))
        return codec._count_objects(frame, codec.MAX_DECODED_OBJECTS)

    per_job = cost(2) - cost(1)
    assert cost(1) + (MAX_PLAN_JOBS - 1) * per_job <= codec.MAX_DECODED_OBJECTS
    assert len(decode(encode(make_message(MessageType.STATUS, pad=["x"] * 250_000)))) == 4


def test_the_envelope_is_checked_before_the_body() -> None:
    """A type the caller does not serve is refused (keeping the id) before the body is read:
    a body that could not be decoded (an ext value) raises nothing of its own."""
    msg = make_message(MessageType.PLAN, jobs=[])
    frame = encode(msg).replace(b"\x90", b"\x91\xd4\x01\x00")  # jobs: [ext 1]
    with pytest.raises(MalformedMessage, match="ext"):
        decode(frame)
    with pytest.raises(UnknownMessageType, match="serves ping, status") as refused:
        decode(frame, types=(MessageType.STATUS, MessageType.PING))
    assert refused.value.msg_id == msg[Fields.ID]


def test_encode_refuses_non_plain_values() -> None:
    """encode refuses a message without envelope and values msgpack cannot carry plainly."""
    with pytest.raises(MalformedMessage):
        encode({"type": "ping"})
    with pytest.raises(MalformedMessage):
        encode(make_message(MessageType.STATUS, when=object()))


_ALLOWED = (MalformedMessage, UnsupportedVersion, MessageTooLarge)


@pytest.mark.reliability(
    "bad input",
    "arbitrary bytes to the frame decoder (hypothesis)",
    tries=FUZZ_EXAMPLES,
    outcome="a message or a protocol error; nothing else",
)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_decode_arbitrary_bytes(frame: bytes) -> None:
    """decode of arbitrary bytes returns a message or raises only the three protocol errors
    (with the budget's walk run on every frame, not only on large ones)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "SCAN_ABOVE_BYTES", 0)
        try:
            msg = decode(frame, max_size=256)
        except _ALLOWED:
            return
    assert isinstance(msg, dict), "decode returns a map"


def _objects(value: object) -> int:
    """The decode budget's cost of ``value``: a container CONTAINER_COST, a scalar 1."""
    if isinstance(value, dict):
        inner = sum(_objects(k) + _objects(v) for k, v in value.items())
        return codec.CONTAINER_COST + inner
    if isinstance(value, list):
        return codec.CONTAINER_COST + sum(_objects(v) for v in value)
    return 1


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plain)
def test_fuzz_the_budget_walk_counts_what_msgpack_builds(value: object) -> None:
    """The walk's cost of a packed value equals the cost of the value msgpack decodes from it;
    a cut-off frame is MalformedMessage."""
    frame = msgpack.packb(value, use_bin_type=True)
    assert codec._count_objects(frame, 1 << 30) == _objects(value)
    if len(frame) > 1:
        with pytest.raises(MalformedMessage):
            codec._count_objects(frame[:-1], 1 << 30)


# Fields each type must carry besides the envelope (docs/protocol.md): without one, a message is
# refused with MalformedMessage.
REQUIRED: dict[MessageType, tuple[str, ...]] = {
    MessageType.PING: (),
    MessageType.PONG: ("process", "uptime_s"),
    MessageType.STATUS: (),
    MessageType.STATUS_REPLY: ("process", "status"),
    MessageType.STATE: (),
    MessageType.STATE_REPLY: ("model", "weight_version", "tensors"),
    MessageType.PLAN: ("plan_id", "model", "jobs"),
    MessageType.ACCEPTED: ("plan_id", "in_reply_to"),
    MessageType.STAGED: ("plan_id", "in_reply_to"),
    MessageType.COMMITTED: ("plan_id", "in_reply_to", "weight_version", "stall_ms"),
    MessageType.REJECTED: ("plan_id", "in_reply_to", "stale", "reasons"),
    MessageType.ERROR: ("in_reply_to", "code", "message"),
    MessageType.EVENT: ("topic",),
}
# Fields a type may carry (generated below; never added as unknown ones).
OPTIONAL: dict[MessageType, tuple[str, ...]] = {
    MessageType.STATE: ("since", "instance"),
    MessageType.STATE_REPLY: ("since", "instance"),
}
# The typed reading of a body and its writer: a message that validates reads back the same.
READERS: dict[MessageType, tuple[Callable[[Any], Any], Callable[[Any], dict[str, Any]]]] = {
    MessageType.PLAN: (plan_from_wire, plan_to_wire),
    MessageType.STATE: (state_request_from_wire, state_request_to_wire),
    MessageType.STATE_REPLY: (state_from_wire, state_to_wire),
    MessageType.COMMITTED: (committed_from_wire, committed_to_wire),
    MessageType.REJECTED: (rejected_from_wire, rejected_to_wire),
}


def refusal_expected(body: dict[str, Any]) -> type[IpcError] | None:
    """The error the protocol's rules give ``body`` before its fields are read: the envelope
    (``v`` an integer this side speaks, ``type`` and ``id`` non-empty strings, ``id`` at most
    MAX_ID_LENGTH long, ``type`` a known one), then the fields its type requires."""
    version = body.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        return MalformedMessage
    if version != PROTOCOL_VERSION:
        return UnsupportedVersion
    for key in ("type", "id"):
        value = body.get(key)
        if not isinstance(value, str) or not value:
            return MalformedMessage
    if len(body["id"]) > MAX_ID_LENGTH:
        return MalformedMessage
    if body["type"] not in {t.value for t in MessageType}:
        return UnknownMessageType
    if any(key not in body for key in REQUIRED[MessageType(body["type"])]):
        return MalformedMessage
    return None


def validated(body: dict[str, Any]) -> MessageType | None:
    """Pack ``body`` as a frame, decode and validate it: a message the rules above refuse is
    refused with exactly that error; any other is either refused with MalformedMessage (a field
    of the wrong kind) or validates as its own type, re-encodes to a frame that validates the
    same, and its typed body reads back equal. Returns the type, or None when refused."""
    frame = msgpack.packb(body, use_bin_type=True)
    expected = refusal_expected(body)
    if expected is not None:
        with pytest.raises(expected):
            validate_message(decode(frame))
        return None
    msg = decode(frame)
    try:
        kind = validate_message(msg)
    except MalformedMessage:
        return None
    assert kind.value == body["type"]
    assert validate_message(decode(encode(msg))) is kind
    if kind in READERS:
        read, write = READERS[kind]
        typed = read(msg)
        assert read(write(typed)) == typed
    return kind


_count = st.integers(0, 2**63 - 1)
_name = st.text(min_size=1, max_size=12)
# A path is any non-empty UTF-8 text but NUL, which no file system accepts (the wire refuses
# it); lone surrogates are not text the wire can carry at all.
_path = st.text(st.characters(codec="utf-8", blacklist_characters="\x00"), min_size=1, max_size=12)
_records = st.builds(
    TensorRecord,
    name=_name,
    ggml_type=st.sampled_from(list(GGMLQuantizationType)),
    ne=st.lists(st.integers(0, 2**40), min_size=1, max_size=4).map(tuple),
    offset=_count,
    nbytes=_count,
    path=_path,
    identity=st.builds(FileIdentity, _count, _count, _count, _count, _count),
)
_fingerprints = st.none() | st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
_reply_to = st.none() | _name


@st.composite
def valid_messages(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed message of any type but ``event`` (whose payload depends on its topic), with
    unknown fields added (which a reader ignores)."""
    kind = draw(st.sampled_from([t for t in MessageType if t is not MessageType.EVENT]))
    fields: dict[str, Any] = {}
    if kind is MessageType.PONG:
        fields = {"process": draw(_name), "uptime_s": draw(st.floats(0, 1e9))}
    elif kind is MessageType.STATUS_REPLY:
        process = draw(st.sampled_from([p.value for p in Process]))
        fields = {"process": process, "status": draw(st.dictionaries(_name, _plain, max_size=3))}
    elif kind is MessageType.STATE_REPLY:
        entries = draw(
            st.lists(
                st.builds(TensorEntry, _records, _fingerprints, st.sampled_from(list(SlotState))),
                max_size=3,
            )
        )
        instance, since = draw(st.none() | _name), draw(st.none() | _count)
        state = RuntimeState(
            draw(st.text(max_size=8)),
            draw(_count),
            tuple(entries),
            instance=instance,
            since=None if instance is None else since,  # a delta names its instance
        )
        fields = state_to_wire(state)
    elif kind is MessageType.STATE:
        since = draw(st.none() | _count)
        fields = state_request_to_wire(StateRequest(since, None if since is None else draw(_name)))
    elif kind is MessageType.PLAN:
        records = draw(st.lists(_records, max_size=3, unique_by=lambda r: r.name))
        jobs = tuple(Job(r, draw(_fingerprints)) for r in records)
        fields = plan_to_wire(Plan(draw(_name), draw(st.text(max_size=8)), jobs))
    elif kind in (MessageType.ACCEPTED, MessageType.STAGED):
        fields = {"plan_id": draw(_name), "in_reply_to": draw(_reply_to)}
    elif kind is MessageType.COMMITTED:
        fields = {
            "plan_id": draw(_name),
            "in_reply_to": draw(_reply_to),
            "weight_version": draw(_count),
            "stall_ms": draw(st.floats(0, 1e6)),
        }
    elif kind is MessageType.REJECTED:
        reasons = st.fixed_dictionaries({"tensor": _name, "reason": st.text(max_size=12)})
        fields = {
            "plan_id": draw(_name),
            "in_reply_to": draw(_reply_to),
            "stale": draw(st.booleans()),
            "reasons": draw(st.lists(reasons, max_size=3)),
        }
    elif kind is MessageType.ERROR:
        fields = {
            "in_reply_to": draw(_reply_to),
            "code": draw(st.integers(-(2**31), 2**31)),
            "message": draw(st.text(max_size=12)),
        }
    named = (f for table in (REQUIRED, OPTIONAL) for names in table.values() for f in names)
    known = {"v", "type", "id", *fields, *named}
    extra = draw(st.dictionaries(_name.filter(lambda k: k not in known), _plain, max_size=2))
    return {"v": PROTOCOL_VERSION, "type": kind.value, "id": draw(_name), **fields, **extra}


@st.composite
def mutated_messages(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed message with one field (its envelope included) deleted or set to anything."""
    body = draw(valid_messages())
    key = draw(st.sampled_from(sorted(body)))
    if draw(st.booleans()):
        del body[key]
    else:
        body[key] = draw(_plain)
    return body


_STRUCTURED_KEYS = [
    "v",
    "type",
    "id",
    "jobs",
    "plan_id",
    "model",
    "tensors",
    "since",
    "instance",
    "x",
]


@st.composite
def structured_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A map of a few of the protocol's field names to anything, the envelope mostly sound."""
    body = draw(st.dictionaries(st.sampled_from(_STRUCTURED_KEYS), _plain))
    body.setdefault("v", PROTOCOL_VERSION)
    body.setdefault("type", draw(st.sampled_from([t.value for t in MessageType])))
    body.setdefault("id", "x")
    return body


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_messages())
def test_fuzz_valid_messages_validate(body: dict[str, Any]) -> None:
    """A well-formed message of each type, unknown fields included, validates as its type and
    reads back the same (validation does not over-reject)."""
    assert validated(body) is MessageType(body["type"])


@pytest.mark.reliability(
    "bad input",
    "structured but wrong messages to decode and validate (hypothesis)",
    tries=FUZZ_EXAMPLES,
    outcome="only protocol errors",
)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structured_bodies() | mutated_messages())
def test_fuzz_validate_structured(body: dict[str, Any]) -> None:
    """A structured message with a bad envelope or a missing required field is refused with its
    protocol error, any other is refused with MalformedMessage or validates and reads back the
    same: never another exception."""
    validated(body)
