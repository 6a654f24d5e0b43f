"""``ggufswap plan --dry-run`` and ``ggufswap agent`` as subprocesses; no torch in the agent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from agent_fakes import FakeRuntime, write_per_tensor_model, write_shard
from processes import GGUFSWAP, run_ggufswap, wait_for

from ggufswap.ipc import Fields, MessageType, make_message, request

pytestmark = pytest.mark.process

TIMEOUT_S = 60


def config(tmp_path: Path, directory: Path, sockets: Path) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(
        f"""
agent:
  status_endpoint: ipc://{sockets}/agent.sock
models:
  - name: m
    runtime: ipc://{sockets}/rt.sock
    watch: [{{path: {directory}}}]
    settle_ms: 50
    request_timeout_s: 1
"""
    )
    return path


def test_agent_modules_do_not_import_torch() -> None:
    """Importing the agent and its command pulls in no torch."""
    code = (
        "import sys, ggufswap.agent, ggufswap._cmd_agent, ggufswap.main; "
        "ggufswap.main.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert result.returncode == 0, result.stderr


def test_plan_dry_run_against_an_unreachable_runtime_lists_every_tensor(
    tmp_path: Path, sockdir: Path
) -> None:
    """Without a runtime the dry run says so and plans every desired tensor."""
    paths = write_per_tensor_model(tmp_path / "m", 3)
    cfg = config(tmp_path, paths[0].parent, sockdir)
    result = run_ggufswap("plan", "--dry-run", "--config", str(cfg), "--timeout", "0.3")
    assert result.returncode == 0, result.stderr
    assert "EMPTY state" in result.stdout
    assert "3 job(s)" in result.stdout
    as_json = run_ggufswap("plan", "--dry-run", "--json", "--config", str(cfg), "--timeout", "0.3")
    [model] = json.loads(as_json.stdout)["models"]
    assert model["compared_with"] == "empty"
    assert sorted(j["name"] for j in model["plan"]["jobs"]) == ["t.0", "t.1", "t.2"]


def test_plan_dry_run_against_a_runtime_lists_only_the_change(
    tmp_path: Path, sockdir: Path
) -> None:
    """With a runtime answering ``state``, the dry run plans only the tensor that differs and
    sends nothing."""
    paths = write_per_tensor_model(tmp_path / "m", 3)
    cfg = config(tmp_path, paths[0].parent, sockdir)
    with FakeRuntime(f"ipc://{sockdir}/rt.sock", paths[0]) as runtime:
        write_shard(paths[1], 1, 3, seed=42)
        result = run_ggufswap("plan", "--dry-run", "--config", str(cfg))
        assert result.returncode == 0, result.stderr
        assert "compared with the runtime's state (weight_version 0)" in result.stdout
        assert "1 job(s)" in result.stdout
        assert "    t.1  F32" in result.stdout
        assert runtime.plans == []


def test_agent_process_plans_reloads_and_stops_cleanly(tmp_path: Path, sockdir: Path) -> None:
    """``ggufswap agent`` answers status, keeps its config on an invalid SIGHUP reload, and
    exits 0 on SIGTERM."""
    paths = write_per_tensor_model(tmp_path / "m", 2)
    cfg = config(tmp_path, paths[0].parent, sockdir)
    status_endpoint = f"ipc://{sockdir}/agent.sock"
    with FakeRuntime(f"ipc://{sockdir}/rt.sock", paths[0]) as runtime:
        proc = subprocess.Popen(
            [GGUFSWAP, "agent", "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            runtime.wait_state_requests(1, timeout_s=30)
            write_shard(paths[1], 1, 2, seed=8)
            [plan] = runtime.wait_plans(1, timeout_s=30)
            assert plan.names() == ("t.1",)
            cfg.write_text("models: [{name: m, watch: []}]\n")  # invalid
            proc.send_signal(signal.SIGHUP)

            def reload_failed() -> bool:
                reply = request(status_endpoint, make_message(MessageType.STATUS), timeout_s=2)
                assert reply[Fields.TYPE] == MessageType.STATUS_REPLY.value
                return reply["status"]["reloads"]["failed"] == 1

            wait_for(reload_failed, timeout=20, what="the agent to report the failed reload")
            proc.send_signal(signal.SIGTERM)
            _out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err
        assert "agent.reload_failed" in err
        assert "agent.stopped" in err
        assert not (sockdir / "agent.sock").exists()
