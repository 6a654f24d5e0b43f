"""The agent end to end: real inotify, real sockets, a fake runtime (see agent_fakes)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_fakes import (
    FakeRuntime,
    replace_shard,
    shard_name,
    tensor_data,
    write_f32_gguf,
    write_per_tensor_model,
    write_shard,
)
from processes import wait_for

from ggufswap.agent import AgentDaemon
from ggufswap.config import WatchBackend, load_config
from ggufswap.ipc import (
    Fields,
    Job,
    MessageType,
    Plan,
    make_message,
    plan_to_wire,
    request,
    state_from_wire,
)
from ggufswap.shards import fingerprint, requantize
from ggufswap.shards.presets import tiny_dense
from ggufswap.shards.writer import write_model


@dataclass
class Agent:
    daemon: AgentDaemon
    runtime: FakeRuntime
    status_endpoint: str
    thread: threading.Thread

    def start_loop(self) -> None:
        if not self.thread.is_alive():
            self.thread.start()

    def status(self) -> dict[str, Any]:
        return self.daemon.status()

    def link(self) -> dict[str, Any]:
        return self.status()["models"]["m"]["link"]

    def scans(self) -> int:
        return int(self.status()["scans"]["count"])

    def wait_scan_after(self, scans: int, what: str) -> None:
        """Wait until the agent has scanned more than ``scans`` times."""
        wait_for(lambda: self.scans() > scans, timeout=10, what=what)

    def wait_in_sync(self, timeout_s: float = 10.0) -> None:
        """Wait until nothing is pending and the link is idle at the runtime's version."""

        def settled() -> bool:
            status = self.status()
            link = status["models"]["m"]["link"]
            return (
                status["pending_paths"] == 0
                and link["state"] == "idle"
                and link["weight_version"] == self.runtime.weight_version
                and link["reconciled_generation"] == status["models"]["m"]["generation"]
            )

        wait_for(settled, timeout=timeout_s, what="the agent to be idle and in sync")


def write_config(
    tmp_path: Path,
    watch: Path,
    sockets: str,
    *,
    backend: str,
    settle_ms: int,
    verify: str,
    poll_interval_s: float = 0.05,
) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(
        f"""
agent:
  status_endpoint: ipc://{sockets}/agent.sock
  rescan_interval_s: 300
models:
  - name: m
    runtime: ipc://{sockets}/rt.sock
    watch:
      - path: {watch}
        backend: {backend}
        poll_interval_s: {poll_interval_s}
    settle_ms: {settle_ms}
    verify: {verify}
    request_timeout_s: 2
    retries: 1
"""
    )
    return path


@contextmanager
def running_agent(
    tmp_path: Path,
    watch: Path,
    loaded: Path,
    *,
    backend: str = "watchdog",
    settle_ms: int = 80,
    verify: str = "checksum",
    poll_interval_s: float = 0.05,
    start_loop: bool = True,
) -> Iterator[Agent]:
    # A short directory: a socket path holds at most 107 bytes; tmp_path is named after the test.
    with tempfile.TemporaryDirectory(prefix="gsa-") as sockets:
        config = load_config(
            write_config(
                tmp_path,
                watch,
                sockets,
                backend=backend,
                settle_ms=settle_ms,
                verify=verify,
                poll_interval_s=poll_interval_s,
            )
        )
        with FakeRuntime(f"ipc://{sockets}/rt.sock", loaded) as runtime:
            daemon = AgentDaemon(config, heartbeat_interval_s=0.5)
            daemon.start()
            thread = threading.Thread(target=daemon.run, name="test-agent")
            agent = Agent(daemon, runtime, f"ipc://{sockets}/agent.sock", thread)
            if start_loop:
                agent.start_loop()
            try:
                agent.wait_in_sync()
                if start_loop:
                    # Files written just before the start are held until their identity has been
                    # stable for settle_ms (agent/stability.py): begin from a settled index.
                    wait_for(
                        lambda: agent.status()["models"]["m"]["shards"]["settling"] == 0,
                        timeout=30,
                        what="every shard settled",
                    )
                    agent.wait_in_sync()
                yield agent
            finally:
                daemon.request_stop()
                agent.start_loop()  # run() does the bounded shutdown
                thread.join(20)
                assert not thread.is_alive(), "the agent did not stop within 20 s"


def test_fake_runtime_answers_state_and_plan_like_the_runtime(
    tmp_path: Path, sockdir: Path
) -> None:
    """The fake runtime reports its tensors, commits a valid plan once and dedups its id."""
    paths = write_per_tensor_model(tmp_path / "m", 2)
    endpoint = f"ipc://{sockdir}/rt.sock"
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


def test_atomic_rename_of_one_changed_tensor_gives_one_plan_with_that_tensor(
    tmp_path: Path,
) -> None:
    """Re-quantizing one tensor (temp file + rename) yields exactly one plan with only it."""
    [model] = write_model(tiny_dense(), tmp_path / "models")
    with running_agent(tmp_path, model.parent, model) as agent:
        assert agent.runtime.plans == [], "an agent in sync with the runtime sends nothing"
        requantize(model, "blk.0.attn_q.weight", "q4_0")
        [plan] = agent.runtime.wait_plans(1)
        agent.wait_in_sync()
        assert len(agent.runtime.plans) == 1
        assert plan.names() == ("blk.0.attn_q.weight",)
        job = plan.jobs[0]
        assert job.source.ggml_type.name == "Q4_0"
        assert job.fingerprint == fingerprint(job.source)
        assert agent.link()["last_plans"][-1]["outcome"] == "committed"


def test_shard_copied_in_place_in_slow_chunks_is_planned_only_once_complete(
    tmp_path: Path,
) -> None:
    """A shard rewritten in place chunk by chunk is held as being written while the writer has
    it open, never planned until the copy is complete and settled; then exactly its tensor is
    planned."""
    paths = write_per_tensor_model(tmp_path / "m", 3)
    target = paths[1]
    new = write_shard(tmp_path / "staged" / target.name, 1, 3, seed=1000).read_bytes()
    chunks = [new[:40], new[40 : len(new) - 64], new[len(new) - 64 :]]
    with running_agent(tmp_path, target.parent, paths[0]) as agent:
        with open(target, "wb") as f:  # truncates: the shard is now incomplete
            for chunk in chunks[:-1]:
                scans = agent.scans()
                f.write(chunk)
                f.flush()
                agent.wait_scan_after(scans, "a scan of the partial file")
                held = wait_for(
                    lambda: agent.status()["models"]["m"]["writing_shards"],
                    timeout=10,
                    what="the shard held as being written",
                )
                assert [s["path"] for s in held] == [str(target)]
                assert agent.runtime.plans == [], "a partial shard must never be planned"
            f.write(chunks[-1])
        [plan] = agent.runtime.wait_plans(1)
        agent.wait_in_sync()
        assert plan.names() == ("t.1",)
        assert len(agent.runtime.plans) == 1
        assert agent.status()["models"]["m"]["invalid_shards"] == []


def test_truncated_shard_is_reported_invalid_and_never_planned_until_fixed(
    tmp_path: Path,
) -> None:
    """A truncated replacement shows as invalid on the status endpoint and sends nothing; a valid
    file at the same path then leads to a plan."""
    paths = write_per_tensor_model(tmp_path / "m", 3)
    new = write_shard(tmp_path / "staged" / paths[2].name, 2, 3, seed=77).read_bytes()
    with running_agent(tmp_path, paths[0].parent, paths[0]) as agent:
        scans = agent.scans()
        replace_shard(paths[2], new[: len(new) - 20])
        agent.wait_scan_after(scans, "a scan of the truncated shard")
        agent.wait_in_sync()
        reply = request(agent.status_endpoint, make_message(MessageType.STATUS), timeout_s=5)
        assert reply[Fields.TYPE] == MessageType.STATUS_REPLY.value
        model = reply["status"]["models"]["m"]
        [invalid] = model["invalid_shards"]
        assert invalid["path"] == str(paths[2])
        assert "end" in invalid["reason"] or "trunc" in invalid["reason"].lower()
        assert model["shards"]["invalid"] == 1
        assert agent.runtime.plans == []
        replace_shard(paths[2], new)
        [plan] = agent.runtime.wait_plans(1)
        assert plan.names() == ("t.2",)
        agent.wait_in_sync()
        assert agent.status()["models"]["m"]["shards"]["invalid"] == 0


def test_burst_of_ten_thousand_events_is_coalesced_into_at_most_two_plans(
    tmp_path: Path,
) -> None:
    """Thousands of writes, renames and ignored temp files within one settle window become
    <= 2 plans, and the runtime ends with exactly what is on disk.

    The main loop starts after the burst, so that on a loaded machine the burst still falls
    within one settle window: the backends report into the queue meanwhile, as they would while
    the loop is busy."""
    count = 40
    paths = write_per_tensor_model(tmp_path / "m", count)
    directory = paths[0].parent
    with running_agent(tmp_path, directory, paths[0], settle_ms=250, start_loop=False) as agent:
        events_before = agent.daemon.queue.events
        for i in range(1500):
            no = 1 + i % (count - 1)
            (directory / f"junk-{i % 7}.incomplete").write_bytes(b"x")  # ignored
            write_shard(paths[no], no, count, seed=i)
        wait_for(
            lambda: agent.daemon.queue.events - events_before >= 10_000, timeout=10, what="events"
        )
        agent.start_loop()
        wait_for(lambda: len(agent.runtime.plans) >= 1, timeout=10, what="a plan after the burst")
        agent.wait_in_sync(timeout_s=20)
        assert agent.daemon.queue.events - events_before >= 10_000
        assert 1 <= len(agent.runtime.plans) <= 2
        for no in range(1, count):
            entry = agent.runtime.tensors[f"t.{no}"]
            assert entry.record.path == str(paths[no])
            assert entry.record.identity.ino == os.stat(paths[no]).st_ino


def test_symlinked_model_directory_and_snapshot_links_into_blobs(tmp_path: Path) -> None:
    """A model directory reached through a symlink, whose shard is a symlink into a blobs/
    directory (Hugging Face layout), is planned when the link is re-pointed to a new blob."""
    blobs = tmp_path / "hub" / "blobs"
    snapshot = tmp_path / "hub" / "snapshots" / "rev1"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)

    def blob(name: str, seed: int) -> Path:
        return write_f32_gguf(blobs / name, [("t.0", tensor_data(0)), ("t.1", tensor_data(seed))])

    (snapshot / "m.gguf").symlink_to(os.path.relpath(blob("blob-a", 1), snapshot))
    link_dir = tmp_path / "model-link"
    link_dir.symlink_to(snapshot)
    with running_agent(tmp_path, link_dir, link_dir / "m.gguf") as agent:
        watched = {w["directory"]: w for w in agent.status()["watched"]}
        assert str(snapshot) in watched
        assert watched[str(blobs)]["link_target"] is True
        new_blob = blob("blob-b", 55)
        tmp_link = snapshot / ".relink"
        tmp_link.symlink_to(os.path.relpath(new_blob, snapshot))
        os.replace(tmp_link, snapshot / "m.gguf")
        [plan] = agent.runtime.wait_plans(1)
        assert plan.names() == ("t.1",)
        assert plan.jobs[0].source.path == str(new_blob)


def test_deleted_and_recreated_directory_is_watched_again(tmp_path: Path) -> None:
    """After the model directory is deleted and recreated, its new files and later changes to
    them are planned."""
    paths = write_per_tensor_model(tmp_path / "m", 2)
    directory = paths[0].parent
    with running_agent(tmp_path, directory, paths[0]) as agent:
        shutil.rmtree(directory)
        directory.mkdir()
        write_per_tensor_model(directory, 2)
        write_shard(directory / shard_name("m", 1, 2), 1, 2, seed=5)
        first = agent.runtime.wait_plans(1)[-1]
        assert "t.1" in first.names()
        agent.wait_in_sync()
        n = len(agent.runtime.plans)
        write_shard(paths[1], 1, 2, seed=6)
        plan = agent.runtime.wait_plans(n + 1)[-1]
        assert plan.names() == ("t.1",)


def test_overflow_triggers_a_full_rescan_that_finds_unreported_changes(tmp_path: Path) -> None:
    """With a backend that has not reported a change, an overflow report makes the agent rescan
    and plan it."""
    paths = write_per_tensor_model(tmp_path / "m", 2)
    with running_agent(
        tmp_path, paths[0].parent, paths[0], backend="polling", poll_interval_s=3600
    ) as agent:
        write_shard(paths[1], 1, 2, seed=9)
        watcher = agent.daemon.watchers()[WatchBackend.POLLING]
        watcher.on_overflow()
        [plan] = agent.runtime.wait_plans(1)
        assert plan.names() == ("t.1",)
        assert agent.status()["scans"]["rescans"]["overflow"] == 1
        assert agent.status()["backends"]["polling"]["overflows"] == 1


def test_verify_stat_plans_every_tensor_of_a_rewritten_file(tmp_path: Path) -> None:
    """With verify: stat, a rewritten shard plans its tensors without fingerprints."""
    [model] = write_model(tiny_dense(n_layers=1), tmp_path / "models")
    with running_agent(tmp_path, model.parent, model, verify="stat") as agent:
        requantize(model, "blk.0.attn_q.weight", "q4_0")
        [plan] = agent.runtime.wait_plans(1)
        assert "blk.0.attn_q.weight" in plan.names()
        assert len(plan.jobs) == len(agent.runtime.tensors)
        assert all(job.fingerprint is None for job in plan.jobs)


def test_runtime_restart_converges_without_losing_the_update(tmp_path: Path) -> None:
    """A change made while the runtime is down is planned once a runtime answers again."""
    paths = write_per_tensor_model(tmp_path / "m", 2)
    with running_agent(tmp_path, paths[0].parent, paths[0], settle_ms=0) as agent:
        endpoint = agent.runtime.endpoint
        agent.runtime.server.stop()
        write_shard(paths[1], 1, 2, seed=31)
        wait_for(
            lambda: agent.link()["state"] in ("unreachable", "syncing", "plan_sent"),
            timeout=10,
            what="the agent to notice the runtime is gone",
        )
        with FakeRuntime(endpoint, paths[0]) as second:
            # The second runtime loaded the old t.0 record; t.1 is the old version too.
            second.tensors["t.1"] = agent.runtime.tensors["t.1"]
            [plan] = second.wait_plans(1, timeout_s=20)
            assert plan.names() == ("t.1",)
