"""Incremental state: ``state`` with ``since`` answers only the slots a commit changed after that
weight version, the agent applies such deltas to the state it holds, and what it holds always
equals a fresh full state."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fuzz_budget
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import wait_for
from runtime_helpers import WAIT_S, ModelDir, Q, cpu_pools, one_thread, open_runtime

from ggufswap.agent import RuntimeLink
from ggufswap.agent._actual import ActualState
from ggufswap.agent.index import ModelSnapshot
from ggufswap.config import ModelConfig, VerifyMode
from ggufswap.ipc import (
    ErrorCode,
    Fields,
    MalformedMessage,
    MessageType,
    RuntimeState,
    SlotState,
    TensorEntry,
    error_from_wire,
    make_message,
    message_from,
    request,
    state_from_wire,
    state_to_wire,
)
from ggufswap.ipc.bodies import StateRequest
from ggufswap.ipc.plan import record_fast, record_from_wire
from ggufswap.runtime import HotSwapRuntime, Placement, Storage
from ggufswap.runtime.control import ControlServer
from ggufswap.shards import FileIdentity, TensorRecord

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

OUTPUT = "output.weight"
DOWN1 = "blk.1.ffn_down_exps.weight"
DOWN3 = "blk.3.ffn_down_exps.weight"
FAMILY3 = (DOWN3, "blk.3.ffn_gate_exps.weight", "blk.3.ffn_up_exps.weight")
MODEL = "m"


class RecordingControl(ControlServer):
    """The runtime's control server, noting the ``since`` of every ``state`` it answers."""

    def __init__(self, runtime: HotSwapRuntime, *, control_endpoint: str) -> None:
        super().__init__(runtime, control_endpoint=control_endpoint)
        self.asked: list[int | None] = []

    def state(self, *, since: int | None = None, instance: str | None = None) -> RuntimeState:
        self.asked.append(since)
        return super().state(since=since, instance=instance)


@contextmanager
def serving(runtime: HotSwapRuntime, sockdir: Path) -> Iterator[RecordingControl]:
    control = RecordingControl(runtime, control_endpoint=f"ipc://{sockdir}/control.sock").start()
    try:
        yield control
    finally:
        control.close()


def ask(control: ControlServer, **fields: Any) -> dict[str, Any]:
    """The reply to a ``state`` request with ``fields``, over the control socket."""
    msg = message_from(MessageType.STATE, fields)
    return request(control.control.endpoint, msg, timeout_s=WAIT_S, retries=0)


def ask_state(control: ControlServer, since: int | None = None) -> RuntimeState:
    fields = {} if since is None else {"since": since, "instance": control.instance}
    return state_from_wire(ask(control, **fields))


def assert_delta(before: RuntimeState, delta: RuntimeState, after: RuntimeState) -> None:
    """``delta`` lists every tensor whose entry differs between the two full states, each as it
    is now, and brings ``before`` to ``after``."""
    old, new, listed = before.by_name(), after.by_name(), delta.by_name()
    assert delta.since == before.weight_version
    assert delta.weight_version == after.weight_version
    assert {n for n in new if new[n] != old[n]} <= set(listed)
    assert all(listed[n] == new[n] for n in listed)
    held = ActualState()
    assert held.take(before, StateRequest()) is None
    assert held.take(delta, StateRequest(before.weight_version, before.instance)) is None
    assert held.state == after
    assert held.by_name == new


@pytest.fixture
def model_dir(tmp_path: Path) -> ModelDir:
    return ModelDir.write(tmp_path / "model")


@pytest.fixture
def runtime(model_dir: ModelDir) -> Iterator[tuple[ModelDir, HotSwapRuntime]]:
    runtime, _ = open_runtime(model_dir.first, model_name=MODEL)
    try:
        yield model_dir, runtime
    finally:
        runtime.close()


def test_runtime_answers_a_delta_with_what_changed_after_since(
    runtime: tuple[ModelDir, HotSwapRuntime], sockdir: Path, tmp_path: Path
) -> None:
    """After a commit, ``since`` = the old version lists only the changed tensor, as a full state
    now reports it; ``since`` = the current version is an empty delta; a ``since`` past the
    current version, from another instance, or none at all gets the full state, saying so."""
    model_dir, rt = runtime
    with serving(rt, sockdir) as control:
        before = ask_state(control)
        assert (before.since, before.instance, before.weight_version) == (None, control.instance, 0)
        assert len(before.tensors) == len(rt.store.slots)
        model_dir.put(OUTPUT, model_dir.variant(OUTPUT, Q.Q8_0, tmp_path / "variants"))
        rt.apply(model_dir.plan("q8", [OUTPUT]))
        after = ask_state(control)
        delta = ask_state(control, since=0)
        assert [e.record.name for e in delta.tensors] == [OUTPUT]
        assert_delta(before, delta, after)
        empty = ask_state(control, since=1)
        assert (empty.since, empty.weight_version, empty.tensors) == (1, 1, ())
        assert ask_state(control, since=2) == after  # past the current version: full
        foreign = state_from_wire(ask(control, since=0, instance="another-runtime"))
        assert foreign == after
        raw = ask(control)
        assert raw[Fields.SINCE] is None
        assert raw[Fields.INSTANCE] == control.instance


def test_a_byte_identical_move_is_in_the_next_delta(
    runtime: tuple[ModelDir, HotSwapRuntime], sockdir: Path, tmp_path: Path
) -> None:
    """A commit that only moves a tensor to a byte-identical file keeps the weight version, yet a
    delta from that version lists the tensor with its new source."""
    model_dir, rt = runtime
    with serving(rt, sockdir) as control:
        before = ask_state(control)
        model_dir.put(DOWN1, model_dir.save(DOWN1, tmp_path / "saved"))
        ticket = rt.apply(model_dir.plan("same", [DOWN1]))
        assert (ticket.changed, rt.weight_version) == ((), 0)
        delta = ask_state(control, since=0)
        assert [e.record for e in delta.tensors] == [model_dir.records()[DOWN1]]
        assert_delta(before, delta, ask_state(control))


def test_split_family_commits_are_in_the_delta(
    tmp_path: Path, sockdir: Path, model_dir: ModelDir
) -> None:
    """Commits of an MoE family split over pools (split_staging) stamp their slots too: a delta
    lists the changed member and brings the old state to the new one."""
    records = list(model_dir.records().values())
    first = min(i for i, r in enumerate(records) if r.name in FAMILY3)
    family = sum(r.n_elements * 4 for r in records if r.name in FAMILY3)
    budget = sum(r.n_elements * 4 for r in records[:first]) + family // 2 + 9000
    rt, _ = open_runtime(
        model_dir.first,
        model_name=MODEL,
        pools=cpu_pools(budget),
        placement=Placement(split_experts=True),
    )
    try:
        assert all(rt.store.slots[n].is_split for n in FAMILY3)
        with serving(rt, sockdir) as control:
            before = ask_state(control)
            model_dir.put(DOWN3, model_dir.variant(DOWN3, Q.Q4_0, tmp_path / "variants"))
            rt.apply(model_dir.plan("q4", [DOWN3]))
            delta = ask_state(control, since=0)
            assert DOWN3 in delta.by_name()
            assert set(delta.by_name()) <= set(FAMILY3)
            assert_delta(before, delta, ask_state(control))
    finally:
        rt.close()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"since": "3", "instance": "x"}, "since"),
        ({"since": -1, "instance": "x"}, "since"),
        ({"since": True, "instance": "x"}, "since"),
        ({"since": 0}, "instance"),
        ({"since": 0, "instance": ""}, "instance"),
    ],
    ids=["string", "negative", "bool", "no-instance", "empty-instance"],
)
def test_a_malformed_since_gets_an_error_naming_the_field(
    runtime: tuple[ModelDir, HotSwapRuntime], sockdir: Path, fields: dict[str, Any], named: str
) -> None:
    """A ``state`` whose ``since`` is not an integer >= 0, or that names no runtime instance, is
    answered with a MALFORMED error naming that field."""
    _, rt = runtime
    with serving(rt, sockdir) as control:
        reply = ask(control, **fields)
    assert reply[Fields.TYPE] == MessageType.ERROR.value
    error = error_from_wire(reply)
    assert error.code is ErrorCode.MALFORMED
    assert f"field {named!r}" in error.message


def test_a_nil_since_is_a_request_for_the_full_state(
    runtime: tuple[ModelDir, HotSwapRuntime], sockdir: Path
) -> None:
    """``since: nil`` is not refused: it asks for the full state."""
    _, rt = runtime
    with serving(rt, sockdir) as control:
        state = state_from_wire(ask(control, since=None))
    assert state.since is None
    assert len(state.tensors) == len(rt.store.slots)


# --------------------------------------------------------------------------- the agent


@contextmanager
def inference_loop(rt: HotSwapRuntime) -> Iterator[None]:
    """Commit staged plans between "batches" on a thread of its own, as a serving loop does."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            rt.at_batch_boundary()
            stop.wait(0.005)

    thread = threading.Thread(target=run, name="test-inference-loop")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(WAIT_S)


@dataclass
class Desired:
    link: RuntimeLink
    model_dir: ModelDir
    generation: int = 0

    def push(self) -> None:
        """Hand the link the files as they are now, as a scan does."""
        self.generation += 1
        self.link.set_desired(
            ModelSnapshot(
                model=MODEL,
                generation=self.generation,
                desired=self.model_dir.records(),
                held=frozenset(),
                shards=(),
                problems=(),
                scanned_at=time.time(),
                scan_s=0.0,
            )
        )

    def wait_applied(self) -> None:
        """Wait until the link holds the files' records, idle, with this generation reconciled."""
        records = self.model_dir.records()

        def applied() -> bool:
            status = self.link.status()
            held = self.link._actual.by_name
            return (
                status["state"] == "idle"
                and status["reconciled_generation"] == self.generation
                and status["pending_plan"] is None
                and all(held[n].record == r for n, r in records.items())
            )

        wait_for(applied, timeout=WAIT_S, what=f"generation {self.generation} to be applied")


def test_agent_state_after_committed_plans_equals_a_fresh_full_state(
    runtime: tuple[ModelDir, HotSwapRuntime], sockdir: Path, tmp_path: Path
) -> None:
    """Across committed plans (type changes, a return to the original, a byte-identical move that
    keeps the weight version) the link syncs with deltas after the first full state, and what it
    holds equals the full state the runtime reports."""
    model_dir, rt = runtime
    variants, saved = tmp_path / "variants", tmp_path / "saved"
    original = model_dir.save(OUTPUT, saved)
    steps = [
        (OUTPUT, model_dir.variant(OUTPUT, Q.Q8_0, variants)),
        (DOWN1, model_dir.variant(DOWN1, Q.Q4_0, variants)),
        (OUTPUT, original),
        (DOWN1, model_dir.save(DOWN1, saved)),
        (OUTPUT, original),  # the same bytes again, in a new file: the weight version stays
    ]
    config = ModelConfig(
        name=MODEL,
        runtime=f"ipc://{sockdir}/control.sock",
        watch=(),
        verify=VerifyMode.STAT,
        request_timeout_s=WAIT_S,
        retries=0,
    )
    with serving(rt, sockdir) as control, inference_loop(rt):
        link = RuntimeLink(config).start()
        try:
            desired = Desired(link, model_dir)
            desired.push()
            desired.wait_applied()
            for name, source in steps:
                model_dir.put(name, source)
                desired.push()
                desired.wait_applied()
            syncs = list(control.asked)  # the link's requests: the first full, then deltas
            full = ask_state(control)
            held = link._actual.state
            assert held is not None
            assert link._actual.by_name == full.by_name()
            assert held == full
        finally:
            link.stop()
    assert syncs[0] is None
    assert len(syncs) == 1 + len(steps)
    assert all(since is not None for since in syncs[1:])


# --------------------------------------------------------------------------- held state


def _entry(name: str, fingerprint: str) -> TensorEntry:
    identity = FileIdentity(1, 2, 3, 4, 5)
    record = TensorRecord(name, Q.F32, (8,), 0, 32, "/m.gguf", identity)
    return TensorEntry(record, fingerprint, SlotState.ON_ORIGINAL)


def test_a_delta_that_does_not_start_from_the_held_state_is_refused() -> None:
    """A delta of another instance, model or version, one that answers a full request, or one
    naming a tensor never reported, is refused with a reason and changes nothing held."""
    full = RuntimeState(MODEL, 3, (_entry("a", "1"), _entry("b", "2")), instance="i")
    asked = StateRequest(since=3, instance="i")
    good = RuntimeState(MODEL, 4, (_entry("b", "3"),), instance="i", since=3)
    bad = [
        (RuntimeState(MODEL, 4, good.tensors, instance="j", since=3), asked),
        (RuntimeState("other", 4, good.tensors, instance="i", since=3), asked),
        (RuntimeState(MODEL, 4, good.tensors, instance="i", since=2), asked),
        (RuntimeState(MODEL, 2, good.tensors, instance="i", since=3), asked),
        (RuntimeState(MODEL, 4, (_entry("c", "3"),), instance="i", since=3), asked),
        (good, StateRequest()),
    ]
    held = ActualState()
    assert held.take(full, StateRequest()) is None
    for delta, request_ in bad:
        assert held.take(delta, request_) is not None
        assert (held.state, held.by_name) == (full, full.by_name())
    assert held.take(good, asked) is None
    assert held.by_name == {"a": _entry("a", "1"), "b": _entry("b", "3")}
    assert held.state == RuntimeState(MODEL, 4, (_entry("a", "1"), _entry("b", "3")), "i")


def test_the_held_state_asks_for_a_delta_only_when_it_can_be_the_base() -> None:
    """A delta is asked only after an outcome, from a full state of the configured model that
    names its runtime instance; otherwise the full state."""
    held = ActualState()
    assert held.request(model=MODEL, delta=True) == StateRequest()
    held.take(RuntimeState(MODEL, 3, (), instance=None), StateRequest())
    assert held.request(model=MODEL, delta=True) == StateRequest()  # an older runtime
    held.take(RuntimeState(MODEL, 3, (), instance="i"), StateRequest())
    assert held.request(model=MODEL, delta=True) == StateRequest(since=3, instance="i")
    assert held.request(model=MODEL, delta=False) == StateRequest()
    assert held.request(model="other", delta=True) == StateRequest()  # a model mismatch


# --------------------------------------------------------------------------- the fast reader

_GOOD = {
    "path": "/srv/m.gguf",
    "offset": 64,
    "nbytes": 128,
    "type": 8,
    "ne": [32, 4],
    "identity": [1, 2, 3, -4, 5],
    "fingerprint": None,
    "slot": "DETACHED",
}
_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(),
    st.text(max_size=4),
    st.just("a\x00b"),
    st.just("ON_ORIGINAL"),
    st.lists(st.integers(-2, 2**63) | st.booleans() | st.none(), max_size=6),
    st.lists(st.integers(0, 9), max_size=6).map(tuple),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@settings(
    max_examples=fuzz_budget.examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    key=st.sampled_from([*_GOOD, "name"]),
    value=_values,
    drop=st.booleans(),
    name=st.sampled_from(["t", "", None]),
)
def test_fast_record_reader_accepts_only_what_the_strict_one_does(
    key: str, value: object, drop: bool, name: str | None
) -> None:
    """The record reader's fast path returns a record only where the strict reader returns the
    same one; anything else goes to the strict reader, which names the field."""
    raw: dict[str, Any] = dict(_GOOD)
    if drop:
        raw.pop(key, None)
    else:
        raw[key] = value
    fast = record_fast(raw, raw.get("name") if name is None else name)
    try:
        strict: TensorRecord | str = record_from_wire(raw, where="r", name=name)
    except MalformedMessage as exc:
        strict = str(exc)
    if isinstance(strict, str):
        assert fast is None
        assert strict.startswith("field 'r")
    else:
        assert fast is None or fast == strict


def test_state_reply_reads_back_equal_full_and_delta() -> None:
    """A full state and a delta survive the wire; a delta that names no instance is refused."""
    full = RuntimeState(MODEL, 3, (_entry("a", "1"), _entry("b", "2")), instance="i")
    delta = RuntimeState(MODEL, 4, (_entry("b", "3"),), instance="i", since=3)
    for state in (full, delta):
        msg = make_message(MessageType.STATE_REPLY, **state_to_wire(state))
        assert state_from_wire(msg) == state
    body = state_to_wire(RuntimeState(MODEL, 4, (), since=3))
    with pytest.raises(MalformedMessage, match="'instance'"):
        state_from_wire(body)


def test_a_commit_stamps_only_the_slots_it_touches(tmp_path: Path, model_dir: ModelDir) -> None:
    """A commit stamps the slot it moves (native storage: a type change detaches it) with the
    weight version it moves to, and no other slot."""
    rt, _ = open_runtime(model_dir.first, storage=Storage.NATIVE)
    try:
        model_dir.put(OUTPUT, model_dir.variant(OUTPUT, Q.F32, tmp_path / "variants"))
        rt.apply(model_dir.plan("f32", [OUTPUT]))
        slot = rt.store.slots[OUTPUT]
        assert (slot.state, slot.changed_at, rt.weight_version) == (SlotState.DETACHED, 1, 1)
        assert {s.changed_at for n, s in rt.store.slots.items() if n != OUTPUT} == {0}
    finally:
        rt.close()
