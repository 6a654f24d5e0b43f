"""The documented production layout: one agent file naming its models, one runtime file per model.

``/etc/ggufswap/config.yaml`` holds ``models: [{name: m, ...}]`` and ``/etc/ggufswap/m.yaml`` only
``runtime:``; under systemd both processes share ``$RUNTIME_DIRECTORY``. The runtime is named
after its file, so it binds the socket the agent dials, and two instances never collide.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from processes import PROBE, Proc, status_of, wait_for

from ggufswap.config import load_config
from ggufswap.shards import Layout, open_shard_set, requantize, tiny_moe, write_model

TENSOR = "blk.1.ffn_down_exps.weight"


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short socket directory (``tmp_path`` can exceed the 107 bytes of a Unix socket path)."""
    path = Path(tempfile.mkdtemp(prefix="gs-split-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_split_layout(etc: Path, models: dict[str, Path]) -> None:
    """An agent ``config.yaml`` for every model and a runtime-only ``NAME.yaml`` per model, as
    docs/operations.md writes them (no endpoint is named anywhere)."""
    entries = "".join(
        f"  - name: {name}\n    watch: [{{path: {first.parent}}}]\n    settle_ms: 100\n"
        for name, first in models.items()
    )
    (etc / "config.yaml").write_text(f"models:\n{entries}")
    for name, first in models.items():
        (etc / f"{name}.yaml").write_text(f"runtime:\n  model: {first}\n")


def test_split_files_resolve_to_one_socket_per_instance(tmp_path: Path, run_dir: Path) -> None:
    """Runtime file m.yaml binds the socket agent model m dials; two instances differ."""
    firsts = {}
    for name in ("alpha", "beta"):
        (tmp_path / name).mkdir()
        firsts[name] = tmp_path / name / f"{name}.gguf"
        firsts[name].touch()
    write_split_layout(tmp_path, firsts)
    environ = {"RUNTIME_DIRECTORY": str(run_dir)}
    agent = load_config(tmp_path / "config.yaml", environ=environ)
    bound = set()
    for name in firsts:
        runtime = load_config(tmp_path / f"{name}.yaml", environ=environ).require_runtime()
        assert runtime.name == name
        assert runtime.control_endpoint == agent.model(name).runtime
        bound |= {runtime.control_endpoint, runtime.status_endpoint, runtime.events_endpoint}
    assert len(bound) == 6, bound


@pytest.mark.process
def test_split_layout_connects_and_swaps_with_real_processes(tmp_path: Path, run_dir: Path) -> None:
    """An agent and a runtime started from the split files, sharing only $RUNTIME_DIRECTORY as
    under systemd, connect, and a re-quantized shard is committed by the runtime."""
    model_dir = tmp_path / "models" / "m"
    model_dir.mkdir(parents=True)
    paths = write_model(tiny_moe(), model_dir, layout=Layout.PER_TENSOR)
    etc = tmp_path / "etc"
    etc.mkdir()
    write_split_layout(etc, {"m": paths[0]})
    env = {"RUNTIME_DIRECTORY": str(run_dir)}
    runtime = Proc(
        ["runtime", "--config", str(etc / "m.yaml"), *PROBE],
        log=tmp_path / "runtime.log",
        env=env,
    )
    agent_config = str(etc / "config.yaml")
    agent = Proc(["agent", "--config", agent_config], log=tmp_path / "agent.log", env=env)
    control = f"ipc://{run_dir}/m.sock"
    try:
        wait_for(lambda: status_of(control), timeout=60, what=f"the runtime on {control}")

        def connected() -> bool:
            status = status_of(f"ipc://{run_dir}/agent.sock")
            model = (status or {}).get("models", {}).get("m") or {}
            return bool((model.get("link") or {}).get("connected"))

        wait_for(connected, timeout=60, what="the agent to connect to runtime m")
        shard = Path(open_shard_set(paths[0]).tensors[TENSOR].path)
        requantize(shard, TENSOR, Q.Q4_0)

        def version() -> int:
            status = status_of(control, timeout=2) or {}
            return int(status.get("weight_version", 0))

        wait_for(lambda: version() >= 1, timeout=60, what="the swap to be committed")
        plans = (status_of(control, timeout=2) or {})["recent_plans"]
        assert [p["changed"] for p in plans if p["state"] == "COMMITTED"] == [[TENSOR]]
    finally:
        agent.stop()
        runtime.stop()
