"""Wire records and the frame codec: roundtrips, strict validation, hostile bytes."""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from gguf import GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufswap.ipc import (
    PROTOCOL_VERSION,
    Committed,
    ErrorCode,
    Fields,
    Job,
    MalformedMessage,
    MessageTooLarge,
    MessageType,
    Plan,
    Reason,
    Rejected,
    RuntimeState,
    SlotState,
    TensorEntry,
    UnknownMessageType,
    UnsupportedVersion,
    committed_from_wire,
    committed_to_wire,
    decode,
    encode,
    error_from_wire,
    make_error,
    make_message,
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
from ggufswap.shards import FileIdentity, TensorRecord

FUZZ_EXAMPLES = int(os.environ.get("GGUFSWAP_FUZZ_EXAMPLES", "300"))


@pytest.fixture(autouse=True)
def no_thread_leaks() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before]
    for thread in leaked:
        thread.join(timeout=2.0)
    alive = [t.name for t in leaked if t.is_alive()]
    if alive:
        pytest.fail(f"test leaked threads: {alive}")


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
    """decode of arbitrary bytes returns a message or raises only the three protocol errors."""
    try:
        msg = decode(frame, max_size=256)
    except _ALLOWED:
        return
    assert isinstance(msg, dict), "decode returns a map"


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


@pytest.mark.reliability(
    "bad input",
    "structured but wrong messages to decode and validate (hypothesis)",
    tries=FUZZ_EXAMPLES,
    outcome="only protocol errors",
)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["v", "type", "id", "jobs", "plan_id", "model", "tensors", "x"]),
        _plain,
    ),
    st.sampled_from([t.value for t in MessageType]),
)
def test_fuzz_validate_structured(body: dict[str, Any], msg_type: str) -> None:
    """Structured but wrong messages only ever raise protocol errors through decode+validate."""
    body.setdefault("v", 1)
    body.setdefault("type", msg_type)
    body.setdefault("id", "x")
    frame = msgpack.packb(body, use_bin_type=True)
    try:
        validate_message(decode(frame))
    except (*_ALLOWED, UnknownMessageType):
        return
