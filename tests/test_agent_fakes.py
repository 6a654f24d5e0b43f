"""Test doubles for the agent tests: a fake runtime and a fast per-tensor model writer.

``FakeRuntime`` is a real ROUTER server (``ggufswap.ipc.RequestServer``) that answers ``state`` and
``plan`` the way the runtime does: ``state_reply`` with what it "loaded" (records with content
fingerprints), and for a plan ``accepted`` then ``committed`` (or ``rejected`` with ``stale`` when a
job's file identity no longer matches the disk). It records every plan it receives. The real
runtime process is built elsewhere; this keeps the agent's tests independent of torch.
"""

from __future__ import annotations

import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType

from ggufswap.ipc import (
    Fields,
    Job,
    MessageType,
    Plan,
    Request,
    RequestServer,
    RuntimeState,
    SlotState,
    TensorEntry,
    make_message,
    make_reply,
    plan_from_wire,
    plan_to_wire,
    request,
    state_from_wire,
    state_to_wire,
)
from ggufswap.shards import FileIdentity, fingerprint, open_shard_set
from ggufswap.shards.keys import Keys
from ggufswap.shards.writer import TypedValue, encode_metadata


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(0.01)


def socket_dir() -> str:
    """A short private directory for ipc:// sockets (sun_path is 107 bytes)."""
    return tempfile.mkdtemp(prefix="gsa-")


# --------------------------------------------------------------------------- fast model writer


def _pad(n: int, alignment: int = 32) -> int:
    return (n + alignment - 1) // alignment * alignment


def gguf_bytes(kv: list[tuple[str, TypedValue]], tensors: list[tuple[str, bytes]]) -> bytes:
    """A GGUF v3 file of F32 1-D tensors (name, raw float32 bytes)."""
    infos, offset = b"", 0
    for name, data in tensors:
        raw = name.encode()
        infos += struct.pack("<Q", len(raw)) + raw
        infos += struct.pack("<IQIQ", 1, len(data) // 4, int(GGMLQuantizationType.F32), offset)
        offset = _pad(offset + len(data))
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + encode_metadata(kv) + infos
    out = bytearray(head + bytes(_pad(len(head)) - len(head)))
    for _name, data in tensors:
        out += data + bytes(_pad(len(data)) - len(data))
    return bytes(out)


def tensor_data(seed: int, n: int = 32) -> bytes:
    return struct.pack(f"<{n}f", *[(seed * 31 + i) % 97 / 7.0 for i in range(n)])


def shard_bytes(prefix: str, no: int, count: int, name: str, data: bytes) -> bytes:
    kv = [
        (Keys.Split.NO, TypedValue(GGUFValueType.UINT16, no)),
        (Keys.Split.COUNT, TypedValue(GGUFValueType.UINT16, count)),
        (Keys.Split.TENSORS_COUNT, TypedValue(GGUFValueType.INT32, count)),
    ]
    if no == 0:
        kv.insert(0, (Keys.General.ARCHITECTURE, TypedValue(GGUFValueType.STRING, "llama")))
    return gguf_bytes(kv, [(name, data)])


def shard_name(prefix: str, no: int, count: int) -> str:
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def write_per_tensor_model(directory: Path, count: int, *, prefix: str = "m") -> list[Path]:
    """``count`` one-tensor shards (``t.0`` ... ``t.N``), plain writes (no fsync: test setup)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for no in range(count):
        path = directory / shard_name(prefix, no, count)
        path.write_bytes(shard_bytes(prefix, no, count, f"t.{no}", tensor_data(no)))
        paths.append(path)
    return paths


def replace_shard(path: Path, data: bytes) -> None:
    """Write ``data`` to a hidden temp file beside ``path`` and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-test")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- fake runtime


class FakeRuntime:
    """A ROUTER that answers ``state`` and ``plan`` like the runtime; records plans."""

    def __init__(self, endpoint: str, model_path: Path, *, model: str = "m") -> None:
        shard_set = open_shard_set(model_path)
        self.model = model
        self.weight_version = 0
        self.tensors: dict[str, TensorEntry] = {
            name: TensorEntry(rec, fingerprint(rec), SlotState.ON_ORIGINAL)
            for name, rec in shard_set.tensors.items()
        }
        self.plans: list[Plan] = []
        self.outcomes: dict[str, str] = {}
        self.state_requests = 0
        self.commit = True  # False: accept plans but never commit (a plan stays in flight)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.server = RequestServer(endpoint, self._handle, name="fake-runtime")

    def __enter__(self) -> FakeRuntime:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def _handle(self, request: Request) -> dict[str, Any] | None:
        peer, msg = request.peer, dict(request.msg)
        kind = msg[Fields.TYPE]
        if kind == MessageType.STATE.value:
            with self._cond:
                self.state_requests += 1
                state = RuntimeState(self.model, self.weight_version, tuple(self.tensors.values()))
                self._cond.notify_all()
            return make_reply(msg, MessageType.STATE_REPLY, **state_to_wire(state))
        if kind == MessageType.PLAN.value:
            return self._plan(peer, msg)
        raise ValueError(f"fake runtime: unexpected {kind}")

    def _plan(self, peer: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        plan = plan_from_wire(msg)
        with self._cond:
            known = self.outcomes.get(plan.plan_id)
            if known is not None:  # a re-sent plan: answer its outcome, apply nothing
                return make_reply(
                    msg,
                    MessageType(known),
                    plan_id=plan.plan_id,
                    weight_version=self.weight_version,
                    stall_ms=0.0,
                )
            self.plans.append(plan)
            stale = [
                j.name
                for j in plan.jobs
                if not os.path.exists(j.source.path)
                or FileIdentity.of_path(j.source.path) != j.source.identity
            ]
            if stale:
                self.outcomes[plan.plan_id] = MessageType.REJECTED.value
                self._cond.notify_all()
                reasons = [{"tensor": n, "reason": "stale: file changed"} for n in stale]
                return make_reply(
                    msg, MessageType.REJECTED, plan_id=plan.plan_id, stale=True, reasons=reasons
                )
            accepted = make_reply(msg, MessageType.ACCEPTED, plan_id=plan.plan_id)
            if self.commit:
                for job in plan.jobs:
                    fp = job.fingerprint or fingerprint(job.source)
                    self.tensors[job.name] = TensorEntry(job.source, fp, SlotState.ON_ORIGINAL)
                self.weight_version += 1
                self.outcomes[plan.plan_id] = MessageType.COMMITTED.value
                committed = make_reply(
                    msg,
                    MessageType.COMMITTED,
                    plan_id=plan.plan_id,
                    weight_version=self.weight_version,
                    stall_ms=0.1,
                )
                self.server.send_to(peer, committed)  # sent after the accepted reply
            self._cond.notify_all()
        return accepted

    def wait_plans(self, n: int, timeout_s: float = 10.0) -> list[Plan]:
        """Block until at least ``n`` plans arrived; return them all."""
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.plans) >= n, timeout_s)
            plans = list(self.plans)
        assert ok, f"expected {n} plan(s) within {timeout_s}s, received {len(plans)}"
        return plans

    def wait_state_requests(self, n: int, timeout_s: float = 10.0) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.state_requests >= n, timeout_s)
        assert ok, f"expected {n} state request(s) within {timeout_s}s"


def test_fake_runtime_answers_state_and_plan_like_the_runtime(tmp_path: Path) -> None:
    """The fake runtime reports its tensors, commits a valid plan once and dedups its id."""
    paths = write_per_tensor_model(tmp_path / "m", 2)
    endpoint = f"ipc://{socket_dir()}/rt.sock"
    with FakeRuntime(endpoint, paths[0]) as rt:
        reply = request(endpoint, make_message(MessageType.STATE), timeout_s=5)
        state = state_from_wire(reply)
        assert sorted(state.by_name()) == ["t.0", "t.1"]
        entry = state.by_name()["t.1"]
        plan = Plan("p1", "m", (Job(entry.record, None),))
        msg = make_message(MessageType.PLAN, **plan_to_wire(plan))
        assert request(endpoint, msg, timeout_s=5)[Fields.TYPE] == "accepted"
        assert request(endpoint, dict(msg, id="again"), timeout_s=5)[Fields.TYPE] == "committed"
        assert len(rt.plans) == 1
        assert rt.weight_version == 1
