"""The agent and the runtime as real processes: real inotify, real sockets, real GGUF files. The
runtimes are forked by the module's zygote (fault_helpers.Zygote: ``import torch`` once for the
module, not once per runtime start); each runs the ``ggufswap`` entry point."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q
from processes import PROBE, Proc, status_of, wait_for, write_config
from runtime_helpers import fresh_digest, one_thread
from zygote import Child, Zygote

from ggufswap.shards import (
    Fingerprinter,
    Layout,
    atomic_copy,
    open_shard_set,
    requantize,
    tiny_moe,
    write_model,
)

# The zygote's runtimes run torch on one thread; the fresh loads they are compared with here too
# (logits are bit-exact only between equal thread counts).
pytestmark = [pytest.mark.process, pytest.mark.usefixtures(one_thread.__name__)]

MODEL = "tiny-moe"
TENSOR = "blk.1.ffn_down_exps.weight"
STOP_S = 60.0  # a runtime that logged runtime.stopped took over 15 s to exit on 2 busy cores


@dataclass
class Cluster:
    tmp: Path
    first: Path
    config: Path
    control: str
    agent_status: str
    zygote: Zygote
    runtime: Child | None = None
    agent: Proc | None = None

    def start_runtime(self) -> None:
        self.runtime = self.zygote.spawn(
            ["runtime", "--config", str(self.config), *PROBE], log=self._log("runtime")
        )
        wait_for(lambda: status_of(self.control), timeout=60, what="the runtime")

    def start_agent(self) -> None:
        self.agent = Proc(["agent", "--config", str(self.config)], log=self._log("agent"))
        wait_for(self.agent_synced, timeout=60, what="the agent to connect and settle")

    def _log(self, name: str) -> Path:
        n = len(list(self.tmp.glob(f"{name}*.log")))
        return self.tmp / f"{name}{n}.log"

    def runtime_status(self) -> dict[str, Any]:
        status = status_of(self.control, timeout=2)
        assert status is not None, "runtime does not answer"
        return status

    def agent_model(self) -> dict[str, Any] | None:
        status = status_of(self.agent_status)
        # A starting agent answers status before its first scan has listed its models.
        return None if status is None else status.get("models", {}).get(MODEL)

    def agent_synced(self) -> bool:
        model = self.agent_model()
        if model is None:
            return False
        link = model.get("link") or {}
        return (
            bool(link.get("connected"))
            and not link.get("pending_plan")
            and not model.get("pending_paths")
        )

    def committed_plans(self) -> list[dict[str, Any]]:
        return [p for p in self.runtime_status()["recent_plans"] if p["state"] == "COMMITTED"]

    def wait_version(self, version: int, timeout: float = 60) -> None:
        wait_for(
            lambda: self.runtime_status()["weight_version"] >= version,
            timeout=timeout,
            what=f"weight_version {version}",
        )

    def probe_digest(self, version: int) -> str:
        def at() -> str | None:
            result = self.runtime_status()["serve"]["results"].get(str(version))
            return result.get("digest") if result else None

        return wait_for(at, timeout=30, what=f"a batch on version {version}")

    def loaded_fingerprint(self, name: str) -> str:
        from ggufswap.ipc import MessageType, make_message, request

        reply = request(self.control, make_message(MessageType.STATE), timeout_s=5)
        return str(reply["tensors"][name]["fingerprint"])

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        if self.runtime is not None:
            self.runtime.stop(timeout=STOP_S)


@pytest.fixture
def cluster(tmp_path: Path, zygote: Zygote) -> Iterator[Cluster]:
    """A tiny MoE model, one tensor per shard, and a config for an agent and a runtime."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    paths = write_model(tiny_moe(), model_dir, layout=Layout.PER_TENSOR)
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path, model_dir=model_dir, first=paths[0], run_dir=run_dir, model=MODEL
    )
    c = Cluster(
        tmp_path,
        paths[0],
        config,
        f"ipc://{run_dir}/rt.sock",
        f"ipc://{run_dir}/agent.sock",
        zygote,
    )
    try:
        yield c
    finally:
        c.stop()


def shard_of(first: Path, name: str) -> Path:
    return Path(open_shard_set(first).tensors[name].path)


def test_renamed_shard_gives_exactly_one_plan_with_that_tensor(cluster: Cluster) -> None:
    """A renamed shard with one changed tensor gives one plan of exactly it; output = fresh load."""
    cluster.start_runtime()
    cluster.start_agent()
    assert cluster.runtime_status()["weight_version"] == 0, "nothing to do on a synced start"
    requantize(shard_of(cluster.first, TENSOR), TENSOR, Q.Q4_0)  # temp file + fsync + rename
    cluster.wait_version(1)
    wait_for(cluster.agent_synced, timeout=30, what="the agent to settle")
    plans = cluster.committed_plans()
    assert len(plans) == 1, plans
    assert plans[0]["changed"] == [TENSOR]
    assert cluster.runtime_status()["weight_version"] == 1
    assert cluster.probe_digest(1) == fresh_digest(cluster.first)


def test_truncated_shard_is_never_planned_until_fixed(cluster: Cluster) -> None:
    """A truncated shard is invalid in the agent's status and never planned; a fixed one is."""
    cluster.start_runtime()
    cluster.start_agent()
    shard = shard_of(cluster.first, TENSOR)
    good = cluster.tmp / "good.gguf"
    requantize(shard, TENSOR, Q.Q4_0, out=good)
    broken = cluster.tmp / ".broken"
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    os.replace(broken, shard)
    wait_for(
        lambda: (m := cluster.agent_model()) is not None and m["shards"]["invalid"] >= 1,
        timeout=30,
        what="the shard to show as invalid",
    )
    assert cluster.runtime_status()["weight_version"] == 0
    assert cluster.committed_plans() == []
    shutil.copy(good, cluster.tmp / ".fixed")
    os.replace(cluster.tmp / ".fixed", shard)
    cluster.wait_version(1)
    assert cluster.probe_digest(1) == fresh_digest(cluster.first)


def test_agent_killed_mid_plan_loses_no_update_and_applies_none_twice(cluster: Cluster) -> None:
    """SIGKILL of the agent right after a change, then a restart: the update lands exactly once."""
    cluster.start_runtime()
    cluster.start_agent()
    shard = shard_of(cluster.first, TENSOR)
    requantize(shard, TENSOR, Q.Q5_0)
    assert cluster.agent is not None
    cluster.agent.kill()  # SIGKILL, and its log file closed
    cluster.start_agent()
    cluster.wait_version(1)
    wait_for(cluster.agent_synced, timeout=30, what="the restarted agent to settle")
    on_disk = Fingerprinter()(open_shard_set(cluster.first).tensors[TENSOR])
    assert cluster.loaded_fingerprint(TENSOR) == on_disk
    changed = [p for p in cluster.committed_plans() if TENSOR in p["changed"]]
    assert len(changed) == 1, cluster.committed_plans()
    assert cluster.runtime_status()["weight_version"] == 1


def test_restarted_runtime_is_resynced_by_the_running_agent(cluster: Cluster) -> None:
    """After a runtime restart, the agent reconnects, and later changes reach the new runtime."""
    cluster.start_runtime()
    cluster.start_agent()
    assert cluster.runtime is not None
    assert cluster.runtime.stop(timeout=STOP_S) == 0
    saved = cluster.tmp / "saved.gguf"
    shard = shard_of(cluster.first, TENSOR)
    atomic_copy(shard, saved)
    requantize(shard, TENSOR, Q.Q4_0)
    cluster.start_runtime()  # loads the changed file: already in sync
    wait_for(cluster.agent_synced, timeout=60, what="the agent to reconnect")
    assert cluster.runtime_status()["weight_version"] == 0
    atomic_copy(saved, shard)  # back to the original: the new runtime must get it
    cluster.wait_version(1)
    assert cluster.probe_digest(1) == fresh_digest(cluster.first)


def test_status_command_reports_both_processes(cluster: Cluster) -> None:
    """``ggufswap status --config`` asks the agent and the runtime; --json for scripts, a table
    for people; an unreachable endpoint exits 1 naming it."""
    import json
    import subprocess

    from processes import GGUFSWAP

    cluster.start_runtime()
    cluster.start_agent()
    out = subprocess.run(
        [GGUFSWAP, "status", "--config", str(cluster.config), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    replies = json.loads(out.stdout)
    processes = {reply["process"]: reply["status"] for reply in replies.values()}
    assert processes["runtime"]["weight_version"] == 0
    assert processes["agent"]["models"][MODEL]["shards"]["valid"] == 51
    table = subprocess.run(
        [GGUFSWAP, "status", cluster.control],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"== runtime at {cluster.control}" in table
    assert "weight_version: 0" in table
    gone = f"ipc://{cluster.tmp}/run/nobody.sock"
    down = subprocess.run(
        [GGUFSWAP, "status", gone, "--timeout", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert down.returncode == 1
    assert gone in down.stdout
