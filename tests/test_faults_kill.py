"""SIGKILL of the agent, and separately of the runtime, at many points of an update's life, in
loops of 50 iterations: every served version equals a fresh load of its files, the runtime
converges to the disk after each restart, and every update is applied exactly once."""

from __future__ import annotations

import enum
import os
import socket
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fault_helpers import WAIT_S, CommitLog, Rig
from processes import wait_for
from reliability import record
from runtime_helpers import Q, one_thread

from ggufswap.ipc import (
    DealerClient,
    MessageType,
    Request,
    RequestServer,
    make_message,
    make_reply,
)

# make test: every kill point 5-6 times; the slow tier (make soak) 25 times.
ITERATIONS = int(os.environ.get("GGUFSWAP_KILL_ITERATIONS", "30"))
SOAK_ITERATIONS = 150
KILL_RUNS = pytest.mark.parametrize(
    "iterations", [ITERATIONS, pytest.param(SOAK_ITERATIONS, marks=pytest.mark.slow)]
)
BATCH_INTERVAL_S = 0.15  # a staged plan waits up to this long for its commit: observable
# Tensors the loops update, and the types each cycles through (consecutive ones always differ,
# so every update changes content; F16 experts fall back to host memory with their family).
TENSORS = (
    "blk.0.ffn_down_exps.weight",
    "blk.1.attn_q.weight",
    "blk.2.ffn_gate_exps.weight",
    "blk.3.attn_v.weight",
)
CYCLE = (Q.Q4_0, Q.F16, None, Q.Q5_1)  # None: the original file

pytestmark = [
    pytest.mark.usefixtures(one_thread.__name__),
    pytest.mark.rig(dev_headroom=4096, batch_interval_s=BATCH_INTERVAL_S),
]


class KillPoint(enum.Enum):
    MID_WRITE_TEMP = "while the replacement's temp file is half written"
    MID_WRITE_IN_PLACE = "while the shard itself is half rewritten in place"
    AFTER_RENAME = "right after the rename, before the agent reacts"
    PLAN_IN_FLIGHT = "while a plan is in flight (the agent shows pending_plan)"
    STAGED = "right before the commit (the runtime shows the plan STAGED)"
    AFTER_COMMIT = "right after the commit (weight_version advanced)"


class Updates:
    """The sequence of updates: update k writes tensor k % 4 in the next type of its cycle."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.variants = rig.tmp / "variants"
        self.saved = {n: rig.model.save(n, rig.tmp / "saved") for n in TENSORS}
        self.step = dict.fromkeys(TENSORS, 0)
        self.count = 0

    def next_source(self) -> tuple[str, Path]:
        name = TENSORS[self.count % len(TENSORS)]
        self.count += 1
        kind = CYCLE[self.step[name] % len(CYCLE)]
        self.step[name] += 1
        source = (
            self.saved[name] if kind is None else self.rig.model.variant(name, kind, self.variants)
        )
        return name, source


def write_half_then(rig: Rig, name: str, source: Path, *, in_place: bool) -> tuple[object, Path]:
    """Start writing ``source`` over the shard of ``name``; return the open file and its path."""
    data = source.read_bytes()
    dest = rig.model.shard_of(name)
    path = dest if in_place else dest.with_name(f".{dest.name}.tmp")
    f = path.open("r+b" if in_place else "wb")
    if in_place:
        f.truncate(0)
    f.write(data[: len(data) // 2])
    f.flush()
    return f, path


def finish_write(f: object, path: Path, source: Path, rig: Rig, name: str) -> None:
    data = source.read_bytes()
    f.write(data[len(data) // 2 :])  # type: ignore[attr-defined]
    f.close()  # type: ignore[attr-defined]
    dest = rig.model.shard_of(name)
    if path != dest:
        os.replace(path, dest)


def wait_agent_plan(rig: Rig, version: int) -> str:
    """Wait until the agent shows a plan in flight (returns "IN_FLIGHT") or the runtime has
    committed past ``version`` (returns "COMMITTED": on a fast run the plan can be sent and
    committed between two polls, and that iteration is then a kill after the commit)."""

    def seen() -> str | None:
        model = rig.agent_model()
        if model and (model.get("link") or {}).get("pending_plan"):
            return "IN_FLIGHT"
        if rig.runtime_status()["weight_version"] > version:
            return "COMMITTED"
        return None

    return str(wait_for(seen, timeout=WAIT_S, what="a plan in flight", interval=0.003))


def wait_runtime_plan(rig: Rig, version: int) -> str:
    """Wait until the newest plan is STAGED (returns "STAGED") or committed past ``version``."""

    def seen() -> str | None:
        status = rig.runtime_status()
        if status["weight_version"] > version:
            return "COMMITTED"
        recent = status["recent_plans"]
        if recent and recent[-1]["state"] == "STAGED":
            return "STAGED"
        return None

    return str(wait_for(seen, timeout=WAIT_S, what="a staged plan", interval=0.003))


@pytest.mark.process
@KILL_RUNS
def test_agent_sigkill_at_every_point_loses_nothing_and_applies_nothing_twice(
    rig: Rig, iterations: int
) -> None:
    """30 times (150 in the slow tier): an update, the agent SIGKILLed at one of six points, a
    new agent: the runtime converges to the disk, each update is committed exactly once
    (weight_version = updates), and the batch served on every version equals a fresh load of
    that version's files."""
    rig.start_runtime()
    rig.start_agent()
    commits = CommitLog(rig.events)
    updates = Updates(rig)
    points = list(KillPoint)
    hit: Counter[str] = Counter()
    try:
        for i in range(iterations):
            point = points[i % len(points)]
            name, source = updates.next_source()
            if point in (KillPoint.MID_WRITE_TEMP, KillPoint.MID_WRITE_IN_PLACE):
                f, path = write_half_then(
                    rig, name, source, in_place=point is KillPoint.MID_WRITE_IN_PLACE
                )
                rig.kill_agent()
                finish_write(f, path, source, rig, name)
                hit[point.name] += 1
            else:
                rig.model.put(name, source)
                if point is KillPoint.PLAN_IN_FLIGHT:
                    seen = wait_agent_plan(rig, i)
                    hit[point.name if seen == "IN_FLIGHT" else KillPoint.AFTER_COMMIT.name] += 1
                elif point is KillPoint.STAGED:
                    seen = wait_runtime_plan(rig, i)
                    hit[point.name if seen == "STAGED" else KillPoint.AFTER_COMMIT.name] += 1
                elif point is KillPoint.AFTER_COMMIT:
                    rig.wait_version_above(i)
                    hit[point.name] += 1
                else:
                    hit[point.name] += 1
                rig.kill_agent()
            rig.start_agent(synced=False)
            rig.wait_converged(f"convergence after kill {i} ({point.name})")
            version = rig.runtime_status()["weight_version"]
            assert version == i + 1, f"iteration {i} ({point.name}): weight_version {version}"
            assert rig.probe_digest(version) == rig.fresh_digest(), f"version {version}"
            commits.drain(timeout_s=WAIT_S)
            assert len(commits.events) == i + 1, commits.events[-3:]
            assert commits.events[-1]["changed"] == [name], commits.events[-1]
    finally:
        commits.close()
    status = rig.runtime_status()
    assert status["plans"].get("committed") == iterations, status["plans"]
    assert status["serve"]["failed_batches"] == 0
    assert all(hit[p.name] > 0 for p in points), hit
    for p in points:
        record(
            "faults",
            f"agent SIGKILL {p.value}",
            tries=hit[p.name],
            outcome="converged after restart; update committed exactly once; "
            "served batches equal a fresh load of their version",
            test="test_faults_kill::test_agent_sigkill_at_every_point",
        )


class RuntimeKill(enum.Enum):
    MID_WRITE_TEMP = "while a replacement shard is being written"
    AFTER_RENAME = "right after the rename"
    PLAN_IN_FLIGHT = "while a plan is in flight (the agent shows pending_plan)"
    STAGED = "right before the commit (the plan STAGED)"
    AFTER_COMMIT = "right after the commit (weight_version advanced)"


@pytest.mark.process
@KILL_RUNS
def test_runtime_sigkill_at_every_point_converges_and_applies_each_update_once(
    rig: Rig, iterations: int
) -> None:
    """30 times (150 in the slow tier): an update that the running runtime must commit exactly
    once, then another with the runtime SIGKILLed at one of five points and restarted: the new
    runtime converges to the disk and never re-applies what it loaded; every served version
    equals a fresh load."""
    rig.start_runtime()
    rig.start_agent()
    updates = Updates(rig)
    points = list(RuntimeKill)
    hit: Counter[str] = Counter()
    restarts = 0
    for i in range(iterations):
        point = points[i % len(points)]
        # An update on the current runtime (a fresh one after the first iteration): once.
        base = rig.runtime_status()["weight_version"]
        name, source = updates.next_source()
        rig.model.put(name, source)
        rig.wait_converged(f"update A of iteration {i}")
        status = rig.runtime_status()
        assert status["weight_version"] == base + 1, (i, status["recent_plans"])
        assert rig.probe_digest(base + 1) == rig.fresh_digest(), f"iteration {i}"
        # Then the fault.
        name, source = updates.next_source()
        pending_write = None
        if point is RuntimeKill.MID_WRITE_TEMP:
            pending_write = write_half_then(rig, name, source, in_place=False)
        else:
            rig.model.put(name, source)
            if point is RuntimeKill.PLAN_IN_FLIGHT:
                seen = wait_agent_plan(rig, base + 1)
                point = point if seen == "IN_FLIGHT" else RuntimeKill.AFTER_COMMIT
            elif point is RuntimeKill.STAGED:
                seen = wait_runtime_plan(rig, base + 1)
                point = point if seen == "STAGED" else RuntimeKill.AFTER_COMMIT
            elif point is RuntimeKill.AFTER_COMMIT:
                rig.wait_version_above(base + 1)
        assert rig.runtime is not None
        rig.runtime.kill()
        hit[point.name] += 1
        rig.start_runtime()
        restarts += 1
        if pending_write is not None:
            finish_write(*pending_write, source, rig, name)
        rig.wait_converged(f"convergence after runtime kill {i} ({point.name})")
        status = rig.runtime_status()
        # The new runtime loaded what was on disk; only an update written after it started
        # (the half-written one) is a plan for it, exactly once.
        expected = 1 if pending_write is not None else 0
        assert status["weight_version"] == expected, (i, point.name, status["recent_plans"])
        assert rig.probe_digest(expected) == rig.fresh_digest(), f"iteration {i}"
        assert status["serve"]["failed_batches"] == 0
    assert all(hit[p.name] > 0 for p in points), hit
    for p in points:
        record(
            "faults",
            f"runtime SIGKILL {p.value}",
            tries=hit[p.name],
            outcome="restarted runtime converged to the disk; no update lost or re-applied; "
            "served batches equal a fresh load of their version",
            test="test_faults_kill::test_runtime_sigkill_at_every_point",
        )


def test_dealer_client_notices_a_peer_restarted_between_heartbeats(tmp_path: Path) -> None:
    """A peer that dies and is replaced at the same endpoint between two heartbeats counts as a
    reconnect at once (regression: the new process answered the next ping, so the agent never
    learnt that its plan in flight died with the old runtime, and waited 30 s to re-send it)."""
    endpoint = f"ipc://{tmp_path}/peer.sock"

    def echo(request: Request) -> dict[str, Any]:
        return make_reply(request.msg, MessageType.STATUS_REPLY, process="runtime", status={})

    server = RequestServer(endpoint, echo, name="first").start()
    client = DealerClient(endpoint, heartbeat_interval_s=3600.0)  # heartbeats cannot tell
    try:
        client.send(make_message(MessageType.STATUS))
        assert wait_for(lambda: client.poll(0.05), timeout=WAIT_S, what="a first reply")
        assert client.reconnects == 0
        server.stop()
        server = RequestServer(endpoint, echo, name="second").start()
        wait_for(
            lambda: client.poll(0.05) or client.reconnects, timeout=10, what="the drop reported"
        )
        assert client.reconnects == 1
        client.send(make_message(MessageType.STATUS))
        assert wait_for(lambda: client.poll(0.05), timeout=WAIT_S, what="the new peer's reply")
    finally:
        client.close()
        server.stop()
    record(
        "faults",
        "runtime replaced between two heartbeats (agent's connection)",
        tries=1,
        outcome="reported as a reconnect at once; the link re-syncs instead of waiting 30 s",
        test="test_faults_kill::test_dealer_client_notices_a_peer_restarted_between_heartbeats",
    )


def test_dealer_client_does_not_spin_on_a_peer_that_drops_every_handshake(tmp_path: Path) -> None:
    """A listener that accepts and closes every connection (a failing handshake) is not counted
    as a stream of reconnects: only a connection that carried a message counts as dropped."""
    path = tmp_path / "mute.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    listener.settimeout(0.05)
    accepted = 0
    stop = threading.Event()

    def drop_all() -> None:
        nonlocal accepted
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted += 1
            conn.close()

    thread = threading.Thread(target=drop_all, name="mute-peer")
    thread.start()
    client = DealerClient(f"ipc://{path}", heartbeat_interval_s=3600.0)
    try:
        client.send(make_message(MessageType.STATUS))
        wait_for(lambda: accepted >= 3, timeout=WAIT_S, what="repeated connection attempts")
        assert client.poll(0.3) is None
        assert client.reconnects == 0
        assert not client.connected
    finally:
        client.close()
        stop.set()
        thread.join(WAIT_S)
        listener.close()
