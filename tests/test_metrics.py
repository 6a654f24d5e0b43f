"""Prometheus metrics of the runtime: fed by real plans, served over real HTTP."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

pytest.importorskip("prometheus_client")

from ggufswap.ipc import Job, Plan
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.serving.metrics import RuntimeMetrics
from ggufswap.shards import Layout, open_shard_set, requantize, tiny_moe, write_model

TENSOR = "blk.0.ffn_down_exps.weight"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_committed_plan_updates_metrics_and_http_serves_them(tmp_path: Path) -> None:
    """A committed plan counts once, records its stall and version, and /metrics shows it."""
    paths = write_model(tiny_moe(), tmp_path, layout=Layout.PER_TENSOR)
    with HotSwapRuntime.open(paths[0]) as runtime:
        metrics = RuntimeMetrics(runtime)
        record = open_shard_set(paths[0]).tensors[TENSOR]
        requantize(Path(record.path), TENSOR, Q.Q4_0)
        runtime.apply(Plan("p1", "", (Job(open_shard_set(paths[0]).tensors[TENSOR]),)))
        reg = metrics.registry
        assert reg.get_sample_value("ggufswap_runtime_plans_total", {"outcome": "committed"}) == 1
        assert reg.get_sample_value("ggufswap_runtime_commit_stall_seconds_count") == 1
        assert reg.get_sample_value("ggufswap_runtime_weight_version") == 1
        assert reg.get_sample_value("ggufswap_runtime_tensors", {"state": "ON_ORIGINAL"}) == 51
        port = free_port()
        metrics.serve(port)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                body = response.read().decode()
        finally:
            metrics.close()
        assert "ggufswap_runtime_weight_version 1.0" in body


def test_rejected_plan_counts_as_rejected(tmp_path: Path) -> None:
    """A refused plan counts under its outcome and leaves the weight version alone."""
    paths = write_model(tiny_moe(), tmp_path / "m", layout=Layout.SINGLE)
    outside = write_model(tiny_moe(), tmp_path / "elsewhere", layout=Layout.SINGLE)
    with HotSwapRuntime.open(paths[0]) as runtime:
        metrics = RuntimeMetrics(runtime)
        foreign = open_shard_set(outside[0]).tensors[TENSOR]
        ticket = runtime.submit(Plan("p2", "", (Job(foreign),)))
        assert ticket.state.value == "REJECTED"
        reg = metrics.registry
        assert reg.get_sample_value("ggufswap_runtime_plans_total", {"outcome": "rejected"}) == 1
        assert reg.get_sample_value("ggufswap_runtime_weight_version") == 0


def test_agent_metrics_reflect_its_status_over_http(tmp_path: Path) -> None:
    """The agent's /metrics shows its scans and shard states, read from its status at scrape."""
    from ggufswap.agent import AgentDaemon
    from ggufswap.config import load_config

    model = tmp_path / "model"
    model.mkdir()
    write_model(tiny_moe(), model, layout=Layout.PER_TENSOR)
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
agent:
  status_endpoint: ipc://{tmp_path}/run/agent.sock
  metrics_port: {port}
models:
  - name: m
    runtime: ipc://{tmp_path}/run/none.sock
    watch: [{{path: {model}}}]
    settle_ms: 0
"""
    )
    # settle_ms 0: the shards were just written, and a shard younger than the settle window is
    # held (settling) at the first scan rather than counted valid.
    agent = AgentDaemon(load_config(config), connect=False)
    agent.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body = response.read().decode()
    finally:
        agent.close()
    assert 'ggufswap_agent_shards{model="m",state="valid"} 51.0' in body
    assert "ggufswap_agent_scans_total 1.0" in body
    assert 'ggufswap_agent_runtime_connected{model="m"} 0.0' in body
