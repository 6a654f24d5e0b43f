"""Test doubles for the agent tests: a fake runtime, and per-tensor models written with the
project's own GGUF writer (``ggufswap.shards.writer``).

``FakeRuntime`` is a real ROUTER server (``ggufswap.ipc.RequestServer``) that answers ``state`` and
``plan`` the way the runtime does: ``state_reply`` with what it "loaded" (records with content
fingerprints), and for a plan ``accepted`` then ``committed`` (or ``rejected`` with ``stale`` when a
job's file identity no longer matches the disk). It records every plan it receives. The real
runtime process is built elsewhere; this keeps the agent's tests independent of torch.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType

from ggufswap.ipc import (
    Fields,
    MessageType,
    Plan,
    Request,
    RequestServer,
    RuntimeState,
    SlotState,
    TensorEntry,
    make_reply,
    plan_from_wire,
    state_to_wire,
)
from ggufswap.shards import FileIdentity, fingerprint, open_shard_set
from ggufswap.shards.keys import Keys
from ggufswap.shards.writer import (
    SHARD_NAME_FORMAT,
    RawTensor,
    TypedValue,
    encode_metadata,
    write_gguf,
)

# --------------------------------------------------------------------------- per-tensor model


def tensor_data(seed: int, n: int = 32) -> bytes:
    """``n`` float32 values (raw bytes) that differ for each ``seed``."""
    return struct.pack(f"<{n}f", *[(seed * 31 + i) % 97 / 7.0 for i in range(n)])


def write_f32_gguf(
    path: Path,
    tensors: Sequence[tuple[str, bytes]],
    kv: Sequence[tuple[str, TypedValue]] = (),
) -> Path:
    """Write a GGUF file of 1-D F32 tensors (name, raw float32 bytes) with the project's writer
    (atomically: temp file and rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f32 = GGMLQuantizationType.F32
    raws = [RawTensor(name, f32, (len(data) // 4,), data) for name, data in tensors]
    return write_gguf(path, n_kv=len(kv), kv_bytes=encode_metadata(kv), tensors=raws)


def shard_name(prefix: str, no: int, count: int) -> str:
    return SHARD_NAME_FORMAT.format(prefix, no + 1, count)


def write_shard(path: Path, no: int, count: int, *, seed: int, n: int = 32) -> Path:
    """Write shard ``no`` of a ``count``-shard per-tensor model: its one tensor ``t.<no>`` holds
    ``tensor_data(seed, n)``; the first shard also names the architecture."""
    kv = [
        (Keys.Split.NO, TypedValue(GGUFValueType.UINT16, no)),
        (Keys.Split.COUNT, TypedValue(GGUFValueType.UINT16, count)),
        (Keys.Split.TENSORS_COUNT, TypedValue(GGUFValueType.INT32, count)),
    ]
    if no == 0:
        kv.insert(0, (Keys.General.ARCHITECTURE, TypedValue(GGUFValueType.STRING, "llama")))
    return write_f32_gguf(path, [(f"t.{no}", tensor_data(seed, n))], kv)


def write_per_tensor_model(directory: Path, count: int, *, prefix: str = "m") -> list[Path]:
    """``count`` one-tensor shards (``t.0`` ... ``t.N``, tensor ``t.k`` seeded with ``k``)."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        write_shard(directory / shard_name(prefix, no, count), no, count, seed=no)
        for no in range(count)
    ]


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
