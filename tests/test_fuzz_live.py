"""Fuzzing the live sockets of a runtime process and an agent process.

Random frames, random msgpack values and mutated valid ``plan``/``state``/``status``/``ping``
messages (fields replaced, deleted, added, neighbouring integers, other paths, bytes flipped or
cut) are sent to the runtime's control endpoint and to the agent's status endpoint. Every frame
must get an answer, neither process may die, and the served model must stay exactly as it was:
the base plan reloads the tensors' current contents, so no mutation of it may change the model.
``GGUFSWAP_FUZZ_EXAMPLES`` sets the number of cases (``make fuzz`` runs many more).
"""

from __future__ import annotations

import uuid
from typing import Any

import fuzz_budget
import msgpack
import pytest
import structlog
from gguf import GGMLQuantizationType
from hostile import MODEL, REPLY_TIMEOUT_S, Live, RawPeer, note
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufswap.ipc import (
    Fields,
    MessageType,
    job_to_wire,
    make_message,
    request,
)
from ggufswap.shards import open_shard_set

pytestmark = pytest.mark.process

log = structlog.get_logger(__name__)
EXAMPLES = fuzz_budget.examples(200)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,  # the processes are fresh each session: replaying old cases proves nothing
)
# About 15 ms per case on 2 cores; make fuzz (20,000 cases) needs far more than the default 120 s.
LONG = pytest.mark.timeout(max(120, int(EXAMPLES * 0.1)))
REPLIES = {t.value for t in MessageType}
PLAN_TENSORS = ("blk.1.ffn_down_exps.weight", "blk.0.attn_k.weight", "token_embd.weight")
MODEL_TENSORS = [
    f"blk.{i}.{t}.weight"
    for i in (0, 1)
    for t in ("ffn_down_exps", "ffn_up_exps", "attn_k", "attn_v", "attn_q", "ffn_gate_inp")
]

_counts: dict[str, int] = {}
_culprits: list[list[bytes]] = []  # frames that changed the model (reported at the end too)
_outcomes: dict[str, int] = {}  # the runtime's last reply type per fuzz case (for the log)


@pytest.fixture(scope="module")
def baseline(live: Live) -> tuple[int, str]:
    """The weight_version and probe digest before any fuzzing."""
    return live.weight_version(), live.digest()


@pytest.fixture(scope="module")
def base_jobs(live: Live) -> list[dict[str, Any]]:
    """Plan jobs that reload the loaded contents, with the fingerprints the runtime reports."""
    state = request(live.control, make_message(MessageType.STATE), timeout_s=REPLY_TIMEOUT_S)
    tensors = open_shard_set(live.first).tensors
    jobs = []
    for name in PLAN_TENSORS:
        job = job_to_wire_record(tensors[name])
        job[Fields.Tensor.FINGERPRINT] = state[Fields.TENSORS][name][Fields.Tensor.FINGERPRINT]
        jobs.append(job)
    return jobs


def job_to_wire_record(record: Any) -> dict[str, Any]:
    from ggufswap.ipc import Job

    return job_to_wire(Job(record))


# --- generators -----------------------------------------------------------------------------

MSGPACK_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
ODD_STRINGS = st.sampled_from(
    [
        "",
        "../../../etc/passwd",
        "/etc/passwd",
        "/dev/zero",
        "/proc/self/mem",
        "\x00",
        "plan",
        "state",
        "status",
        "ping",
        "pong",
        "error",
        "committed",
        "token_embd.weight",
        "output.weight",
        "blk.0.ffn_down_exps.weight",
        "x" * 200,
        MODEL,
    ]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    MSGPACK_INT,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.binary(max_size=24),
    ODD_STRINGS,
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
KEYS = st.sampled_from(
    [Fields.V, Fields.TYPE, Fields.ID, Fields.PLAN_ID, Fields.MODEL, Fields.JOBS, "x", ""]
    + [v for k, v in vars(Fields.Tensor).items() if k.isupper()]
)


def node_paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indices) to a node inside ``obj``, the root excluded."""
    found: list[tuple[Any, ...]] = []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for key, value in items:
        found.append((*prefix, key))
        found.extend(node_paths(value, (*prefix, key)))
    return found


def get_at(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


@st.composite
def replacement_for(draw: st.DrawFn, old: Any) -> Any:
    """A value near ``old`` (so that checks past the first are reached) or anything at all."""
    if isinstance(old, int) and not isinstance(old, bool):
        near = [old + d for d in (-4096, -32, -1, 1, 32, 4096)] + [0, -old, old * 2, 2**63]
        near += [int(t) for t in GGMLQuantizationType]
        near = [v for v in near if -(2**63) <= v < 2**64]
        return draw(st.sampled_from(near)) if draw(st.integers(0, 3)) else draw(VALUES)
    if isinstance(old, str):
        variants = [old + "/..", "../" + old, old.upper(), old[:-1], old + "\x00", old * 2]
        if draw(st.integers(0, 3)):
            return draw(st.sampled_from(variants + MODEL_TENSORS))
        return draw(VALUES)
    return draw(VALUES)


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with one to four structural mutations."""
    msg = msgpack.unpackb(msgpack.packb(base))  # a deep copy
    jobs = msg.get(Fields.JOBS)
    if jobs and draw(st.booleans()):  # a plausible plan: one job field moved to a near value
        job = draw(st.sampled_from(jobs))
        key = draw(st.sampled_from(sorted(job)))
        value = job[key]
        if isinstance(value, list) and value:
            i = draw(st.integers(0, len(value) - 1))
            value[i] = draw(replacement_for(value[i]))
        else:
            job[key] = draw(replacement_for(value))
        return msg
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3, 4]))):  # mostly one: nearer to valid
        paths = node_paths(msg)
        job_fields = [p for p in paths if len(p) == 3 and p[0] == Fields.JOBS]
        if job_fields and draw(st.booleans()):  # half the time: a field of a job, the deep end
            paths = job_fields
        kind = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "dup"]))
        path = draw(st.sampled_from(paths)) if paths else ()
        if not path:
            continue
        parent = get_at(msg, path[:-1])
        key = path[-1]
        if kind == "replace":
            parent[key] = draw(replacement_for(parent[key]))
        elif kind == "delete":
            del parent[key]
        elif kind == "add" and isinstance(parent, dict):
            parent[draw(KEYS)] = draw(VALUES)
        elif kind == "dup" and isinstance(parent, list):
            parent.append(msgpack.unpackb(msgpack.packb(parent[key])))
    return msg


@st.composite
def byte_mutated(draw: st.DrawFn, frame: bytes) -> bytes:
    """``frame`` with bytes flipped, cut or inserted."""
    data = bytearray(frame)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def base_message(kind: str, jobs: list[dict[str, Any]], plan_id: str) -> dict[str, Any]:
    if kind == MessageType.PLAN.value:
        return make_message(MessageType.PLAN, plan_id=plan_id, model=MODEL, jobs=jobs)
    return make_message(MessageType(kind))


def pack(value: Any) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None


# --- the exchange and its invariants --------------------------------------------------------


def exchange(endpoint: str, frames: list[bytes]) -> list[dict[str, Any]]:
    """Send ``frames`` as one message; return the replies up to a final one (or the first
    non-plan reply). Fails when no reply comes within the timeout."""
    with RawPeer(endpoint) as peer:
        peer.send(frames)
        replies = peer.replies(timeout=REPLY_TIMEOUT_S)
        assert replies, f"no reply from {endpoint} to {[f[:64] for f in frames]!r}"
        while replies[-1][Fields.TYPE] in (MessageType.ACCEPTED.value, MessageType.STAGED.value):
            more = peer.replies(timeout=30.0)
            assert more, f"plan accepted by {endpoint} but never finished"
            replies.extend(more)
    for reply in replies:
        assert reply[Fields.TYPE] in REPLIES, reply
    return replies


def check_both(live: Live, frames: list[bytes], tag: str) -> None:
    """Send to both processes; both answer; the model's weight_version does not move."""
    version = live.weight_version()
    for endpoint in (live.control, live.agent_status):
        replies = exchange(endpoint, frames)
        kinds = [r[Fields.TYPE] for r in replies]
        if endpoint == live.control:
            _outcomes[kinds[-1]] = _outcomes.get(kinds[-1], 0) + 1
        if endpoint == live.agent_status:
            assert kinds[0] in (
                MessageType.ERROR.value,
                MessageType.STATUS_REPLY.value,
                MessageType.PONG.value,
            ), kinds
    after = live.weight_version()
    if after != version:
        _culprits.append(frames)
    assert after == version, f"a fuzzed message changed the model ({version} → {after}): {frames!r}"
    _counts[tag] = _counts.get(tag, 0) + 1


# --- the fuzzers ----------------------------------------------------------------------------


@LONG
@FUZZ
@given(
    frames=st.lists(st.binary(max_size=256), min_size=1, max_size=3)
    | st.builds(lambda v: [pack(v) or b"\xc1"], VALUES)
)
def test_fuzz_random_frames_to_both_processes(
    live: Live, baseline: tuple[int, str], frames: list[bytes]
) -> None:
    """Random bytes, random frame counts and random msgpack values are all answered."""
    check_both(live, frames, "random")


@LONG
@FUZZ
@given(
    kind=st.sampled_from(["plan", "plan", "plan", "state", "status", "ping"]),
    plan_id=st.uuids().map(lambda u: u.hex),
    data=st.data(),
    as_bytes=st.integers(0, 3),
)
def test_fuzz_mutated_valid_messages_to_both_processes(
    live: Live,
    baseline: tuple[int, str],
    base_jobs: list[dict[str, Any]],
    kind: str,
    plan_id: str,
    data: st.DataObject,
    as_bytes: int,
) -> None:
    """Valid messages with fields mutated (or bytes flipped) get an answer and change nothing."""
    jobs = [
        {**job, Fields.Tensor.FINGERPRINT: None} if data.draw(st.booleans()) else dict(job)
        for job in base_jobs[: data.draw(st.integers(1, len(base_jobs)))]
    ]  # the agent sends no fingerprint with ``verify: stat``: nothing then checks the bytes
    msg = data.draw(mutated(base_message(kind, jobs, plan_id)))
    frame = pack(msg)
    if frame is None:
        return
    if as_bytes == 0:
        frame = data.draw(byte_mutated(frame))
    check_both(live, [frame], "mutated")


def test_valid_base_plan_commits_without_changing_the_model(
    live: Live, baseline: tuple[int, str], base_jobs: list[dict[str, Any]]
) -> None:
    """Paired with the fuzzers: the unmutated base plan is accepted and committed, no change."""
    frame = pack(base_message(MessageType.PLAN.value, base_jobs, uuid.uuid4().hex))
    assert frame is not None
    replies = exchange(live.control, [frame])
    assert replies[-1][Fields.TYPE] == MessageType.COMMITTED.value, replies
    assert live.weight_version() == baseline[0]


def test_after_fuzzing_both_answer_and_the_model_is_unchanged(
    live: Live, baseline: tuple[int, str], request: pytest.FixtureRequest
) -> None:
    """After every fuzz case, both processes answer status and the probe digest is the same."""
    live.alive()
    log.info("fuzz.outcomes", runtime_replies=dict(sorted(_outcomes.items())), cases=_counts)
    assert live.status(live.agent_status)
    assert live.status(live.runtime_status)
    version, digest = baseline
    assert _culprits == [], f"fuzzed frames changed the model: {_culprits!r}"
    assert live.weight_version() == version
    assert live.digest() == digest
    outcome = "every frame answered; both processes up; weight_version and probe digest unchanged"
    if _counts.get("random"):
        note(
            request,
            "bad input",
            "random frames / msgpack values to runtime control and agent status sockets",
            tries=2 * _counts["random"],
            outcome=outcome,
        )
    if _counts.get("mutated"):
        note(
            request,
            "bad input",
            "mutated valid plan/state/status/ping messages to runtime control and agent status",
            tries=2 * _counts["mutated"],
            outcome=outcome,
        )
