"""The runtime as a real process: control socket, plans, status, hostile frames, shutdown. The
runtimes are forked by the worker's zygote (tests/zygote.py: ``import torch`` once for the
worker), each running the ``ggufswap`` entry point; the shutdown test's is a fresh interpreter
(the installed command from its start)."""

from __future__ import annotations

import pickle
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from gguf import GGMLQuantizationType as Q
from processes import PROBE, Proc, status_of, wait_for
from runtime_helpers import fresh_digest, one_thread
from zygote import Child, Zygote

from ggufswap.ipc import (
    DealerClient,
    Fields,
    Job,
    MessageType,
    Plan,
    make_message,
    plan_to_wire,
    request,
)
from ggufswap.shards import Layout, open_shard_set, requantize, tiny_moe, write_model

pytestmark = pytest.mark.process

TENSOR = "blk.1.ffn_down_exps.weight"
STOP_S = 60.0  # a runtime that logged runtime.stopped took over 15 s to exit on 2 busy cores


def write_served(tmp_path: Path) -> tuple[list[Path], Path, str]:
    """A tiny MoE model on disk and a runtime config serving it; its control endpoint."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    paths = write_model(tiny_moe(), model_dir, layout=Layout.PER_TENSOR)
    run_dir = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
runtime:
  name: tiny-moe
  model: {paths[0]}
  control_endpoint: ipc://{run_dir}/rt.sock
  status_endpoint: ipc://{run_dir}/rt.status.sock
  events_endpoint: ipc://{run_dir}/rt.events.sock
  pools:
    - {{name: dev, device: cpu, budget: 1MiB}}
    - {{name: host, device: cpu}}
"""
    )
    return paths, config, f"ipc://{run_dir}/rt.sock"


RUNTIME_ARGS = ("runtime", "--config", "{config}", *PROBE)


@pytest.fixture
def served(tmp_path: Path, zygote: Zygote) -> Iterator[tuple[list[Path], str, Child]]:
    """A tiny MoE model on disk and a runtime process (forked by the zygote) serving it."""
    paths, config, control = write_served(tmp_path)
    args = [a.format(config=config) for a in RUNTIME_ARGS]
    child = zygote.spawn(args, log=tmp_path / "runtime.log")
    try:
        wait_for(lambda: status_of(control), timeout=60, what="the runtime to answer status")
        yield paths, control, child
    finally:
        child.stop(timeout=STOP_S)


@pytest.fixture
def served_fresh(tmp_path: Path) -> Iterator[tuple[list[Path], str, Proc]]:
    """``served`` with the runtime a fresh ``ggufswap`` interpreter."""
    paths, config, control = write_served(tmp_path)
    args = [a.format(config=config) for a in RUNTIME_ARGS]
    proc = Proc(args, log=tmp_path / "runtime.log", fresh=True)
    try:
        wait_for(lambda: status_of(control), timeout=60, what="the runtime to answer status")
        yield paths, control, proc
    finally:
        proc.stop()


def probe_digest_at(control: str, version: int) -> str | None:
    status = status_of(control)
    if status is None:
        return None
    result = status["serve"]["results"].get(str(version))
    return result.get("digest") if result else None


@pytest.mark.usefixtures(one_thread.__name__)  # the zygote's runtimes run on one torch thread
def test_plan_over_socket_commits_and_matches_fresh_load(served) -> None:
    """A plan over the control socket is accepted, staged, committed; output equals a fresh load."""
    paths, control, _ = served
    record = open_shard_set(paths[0]).tensors[TENSOR]
    requantize(Path(record.path), TENSOR, Q.Q4_0)
    new = open_shard_set(paths[0]).tensors[TENSOR]
    plan = Plan(plan_id=uuid.uuid4().hex, model="tiny-moe", jobs=(Job(new),))
    replies = []
    with DealerClient(control) as client:
        client.send(make_message(MessageType.PLAN, **plan_to_wire(plan)))
        wait_for(
            lambda: (
                (r := client.poll(0.2)) is not None
                and replies.append(r) is None
                and r[Fields.TYPE] == MessageType.COMMITTED.value
            ),
            timeout=30,
            what="the committed reply",
        )
    kinds = [r[Fields.TYPE] for r in replies]
    assert kinds[0] == MessageType.ACCEPTED.value, kinds
    assert MessageType.STAGED.value in kinds, kinds
    committed = replies[-1]
    assert committed[Fields.PLAN_ID] == plan.plan_id
    version = committed[Fields.WEIGHT_VERSION]
    assert version == 1
    served_digest = wait_for(
        lambda: probe_digest_at(control, version), timeout=30, what="a batch on the new version"
    )
    assert served_digest == fresh_digest(paths[0])


def test_state_reports_loaded_table(served) -> None:
    """``state`` lists every loaded tensor with its source record, fingerprint and slot state."""
    paths, control, _ = served
    reply = request(control, make_message(MessageType.STATE), timeout_s=5)
    assert reply[Fields.TYPE] == MessageType.STATE_REPLY.value
    tensors = reply[Fields.TENSORS]
    on_disk = open_shard_set(paths[0]).tensors
    assert set(tensors) == set(on_disk)
    entry = tensors[TENSOR]
    assert entry["path"] == on_disk[TENSOR].path
    assert entry["slot"] == "ON_ORIGINAL"
    assert len(entry["fingerprint"]) == 32


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(pickle.dumps({"v": 1, "type": "status", "id": "x"}), id="pickle"),
        pytest.param(b"\xff\x00garbage", id="garbage"),
        pytest.param(b"\x80", id="empty-map"),
    ],
)
def test_hostile_frames_get_errors_and_runtime_keeps_working(served, frame: bytes) -> None:
    """A pickled, garbage or envelope-less frame gets an error reply; the runtime keeps going."""
    _, control, proc = served
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control)
        sock.send(frame)
        assert sock.poll(5000), "no reply to a hostile frame"
        from ggufswap.ipc import decode

        reply = decode(sock.recv(), max_size=1 << 20)
        assert reply[Fields.TYPE] == MessageType.ERROR.value
    finally:
        sock.close()
    assert status_of(control) is not None
    assert proc.alive()


def test_oversized_frame_is_refused_and_runtime_keeps_working(served) -> None:
    """A frame over the size cap never reaches the handler and the runtime keeps answering."""
    _, control, proc = served
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control)
        sock.send(b"\x00" * (80 << 20))
    finally:
        sock.close()
    assert wait_for(lambda: status_of(control), timeout=10, what="status after an oversized frame")
    assert proc.alive()


def test_sigterm_stops_cleanly(served_fresh) -> None:
    """SIGTERM makes the runtime exit 0 within the shutdown bound."""
    _, _, proc = served_fresh
    proc.signal(signal.SIGTERM)
    assert proc.stop(timeout=15) == 0, proc.log()


def test_tcp_without_curve_is_refused_at_startup(tmp_path: Path) -> None:
    """A tcp endpoint without CURVE keys or an explicit opt-out is refused at startup."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    paths = write_model(tiny_moe(), model_dir, layout=Layout.SINGLE)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"runtime:\n  name: m\n  model: {paths[0]}\n  control_endpoint: tcp://127.0.0.1:45999\n"
    )
    proc = Proc(["runtime", "--config", str(config), *PROBE], log=tmp_path / "runtime.log")
    code = proc.popen.wait(30)
    proc.stop()
    assert code == 2
    assert "curve" in proc.log().lower()
