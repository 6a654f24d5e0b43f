"""One agent keeps two runtime processes of one model in sync (``models[].replicas``): real
processes, real sockets, real GGUF files. The runtimes are forked by the module's zygote
(fault_helpers.Zygote: one ``import torch`` for their three starts); each runs the ``ggufswap``
entry point."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q
from processes import PROBE, Proc, status_of, wait_for
from zygote import Child, Zygote

from ggufswap.ipc import MessageType, make_message, request
from ggufswap.shards import Layout, open_shard_set, requantize, tiny_moe, write_model

pytestmark = pytest.mark.process

MODEL = "tiny-moe"
TENSORS = ("blk.1.ffn_down_exps.weight", "blk.0.attn_q.weight")


def runtime_config(tmp: Path, name: str, first: Path, run_dir: Path) -> Path:
    config = tmp / f"{name}.yaml"
    config.write_text(
        f"""
runtime:
  name: {MODEL}
  model: {first}
  control_endpoint: ipc://{run_dir}/{name}.sock
  status_endpoint: ipc://{run_dir}/{name}.status.sock
  events_endpoint: ipc://{run_dir}/{name}.events.sock
"""
    )
    return config


@dataclass
class Replicas:
    tmp: Path
    first: Path
    endpoints: dict[str, str]  # runtime name -> control endpoint
    configs: dict[str, Path]
    agent_config: Path
    agent_status: str
    zygote: Zygote
    procs: dict[str, Proc | Child]

    def start(self, name: str) -> None:
        log = self.tmp / f"{name}-{len(list(self.tmp.glob(f'{name}-*.log')))}.log"
        if name == "agent":
            self.procs[name] = Proc(["agent", "--config", str(self.agent_config)], log=log)
            return
        args = ["runtime", "--config", str(self.configs[name]), *PROBE]
        self.procs[name] = self.zygote.spawn(args, log=log)
        wait_for(lambda: status_of(self.endpoints[name]), timeout=60, what=f"runtime {name}")

    def model(self) -> dict[str, Any]:
        status = status_of(self.agent_status, timeout=2)
        return {} if status is None else status.get("models", {}).get(MODEL, {})

    def in_sync(self) -> bool:
        model = self.model()
        return bool(model.get("in_sync")) and all(r["connected"] for r in model["runtimes"])

    def version(self, name: str) -> int:
        status = status_of(self.endpoints[name], timeout=2)
        assert status is not None, f"runtime {name} does not answer"
        return int(status["weight_version"])

    def fingerprint(self, name: str, tensor: str) -> str:
        reply = request(self.endpoints[name], make_message(MessageType.STATE), timeout_s=5)
        return str(reply["tensors"][tensor]["fingerprint"])


@pytest.fixture
def replicas(tmp_path: Path, zygote: Zygote) -> Iterator[Replicas]:
    """A tiny MoE model, two runtimes serving it, and an agent naming both."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    first = write_model(tiny_moe(), model_dir, layout=Layout.PER_TENSOR)[0]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    endpoints = {n: f"ipc://{run_dir}/{n}.sock" for n in ("rt-a", "rt-b")}
    agent_config = tmp_path / "agent.yaml"
    agent_config.write_text(
        f"""
agent:
  status_endpoint: ipc://{run_dir}/agent.sock
  rescan_interval_s: 300
models:
  - name: {MODEL}
    runtime: {endpoints["rt-a"]}
    replicas: [{endpoints["rt-b"]}]
    watch:
      - path: {model_dir}
    settle_ms: 100
    verify: checksum
"""
    )
    r = Replicas(
        tmp=tmp_path,
        first=Path(first),
        endpoints=endpoints,
        configs={n: runtime_config(tmp_path, n, Path(first), run_dir) for n in endpoints},
        agent_config=agent_config,
        agent_status=f"ipc://{run_dir}/agent.sock",
        zygote=zygote,
        procs={},
    )
    try:
        yield r
    finally:
        for proc in r.procs.values():
            proc.stop(timeout=60)


@pytest.mark.timeout(300)
def test_agent_sends_each_plan_to_every_runtime_of_the_model(replicas: Replicas) -> None:
    """A changed shard is planned to both runtimes; status shows each runtime's state and the
    model-level view of the versions they serve, out of sync while one is down and in sync again
    once it is back."""
    replicas.start("rt-a")
    replicas.start("rt-b")
    replicas.start("agent")
    wait_for(replicas.in_sync, timeout=60, what="the agent to reach both runtimes")
    before = replicas.fingerprint("rt-b", TENSORS[0])

    shard = open_shard_set(replicas.first).tensors[TENSORS[0]].path
    requantize(shard, TENSORS[0], Q.Q4_0)  # temp file + fsync + rename
    for name in ("rt-a", "rt-b"):
        wait_for(lambda n=name: replicas.version(n) == 1, timeout=60, what=f"{name} at v1")
    assert replicas.fingerprint("rt-a", TENSORS[0]) == replicas.fingerprint("rt-b", TENSORS[0])
    assert replicas.fingerprint("rt-b", TENSORS[0]) != before
    wait_for(replicas.in_sync, timeout=30, what="the agent to settle")
    model = replicas.model()
    assert model["weight_versions"] == {
        replicas.endpoints["rt-a"]: 1,
        replicas.endpoints["rt-b"]: 1,
    }
    assert [r["endpoint"] for r in model["runtimes"]] == list(replicas.endpoints.values())
    assert all(r["plans_by_outcome"] == {"committed": 1} for r in model["runtimes"])
    # One scrub for the model (on its first link), hashing each tensor once for both runtimes.
    assert [r["scrub"] is not None for r in model["runtimes"]] == [True, False]

    # One runtime down: the model is out of sync; back (a fresh load of the files), in sync.
    replicas.procs["rt-b"].stop(timeout=60)  # a busy shared machine can be slow to exit
    shard = open_shard_set(replicas.first).tensors[TENSORS[1]].path
    requantize(shard, TENSORS[1], Q.Q4_0)
    wait_for(lambda: replicas.version("rt-a") == 2, timeout=60, what="rt-a at v2")
    wait_for(lambda: not replicas.in_sync(), timeout=30, what="the model out of sync")
    replicas.start("rt-b")
    wait_for(replicas.in_sync, timeout=60, what="the model back in sync")
    assert replicas.model()["weight_versions"] == {
        replicas.endpoints["rt-a"]: 2,
        replicas.endpoints["rt-b"]: 0,  # it loaded the changed files: nothing to apply
    }
    for tensor in TENSORS:
        assert replicas.fingerprint("rt-a", tensor) == replicas.fingerprint("rt-b", tensor)
