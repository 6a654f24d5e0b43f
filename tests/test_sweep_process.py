"""``ggufswap sweep --config``: the same sweep against a real runtime process and a real agent
watching the model's directory gives the in-process sweep's figures exactly, and leaves the
model's files as they were."""

from __future__ import annotations

import json
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from processes import Proc, run_ggufswap, wait_for
from runtime_helpers import ModelDir, one_thread

from ggufswap.config import load_config
from ggufswap.shards import GGMLType, Layout, Role, open_shard_set, tiny_dense, write_model
from ggufswap.shards.writer import F32_ROLES
from ggufswap.sweep import GgufSet, SweepOptions, run_sweep
from ggufswap.sweep.procs import AGENT_CONFIG, SWEEP_SETTLE_MS, ProcessTarget
from ggufswap.sweep.recipe import Recipe
from ggufswap.sweep.results import Journal

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

CTX, CHUNKS = 64, 6
RECIPE = {
    "quants": ["q4_0", "q5_1"],
    "tensors": [{"match": r"^blk\.0\.attn_q\.weight$"}],
    "groups": [{"name": "all_ffn_up", "match": [r"^blk\.\d+\.ffn_up\.weight$"]}],
}


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A private directory for the ipc:// sockets, short enough for their path limit."""
    path = Path(tempfile.mkdtemp(prefix="gs-sweep-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_config(path: Path, model: ModelDir, run: Path) -> None:
    name = "tiny-dense"
    doc = {
        "version": 1,
        "agent": {"status_endpoint": f"ipc://{run}/agent.sock", "rescan_interval_s": 300},
        "models": [
            {
                "name": name,
                "runtime": f"ipc://{run}/rt.sock",
                "watch": [{"path": str(model.root), "glob": "*.gguf", "backend": "watchdog"}],
                "settle_ms": 100,
                "verify": "checksum",
            }
        ],
        "runtime": {
            "name": name,
            "model": str(model.first),
            "control_endpoint": f"ipc://{run}/rt.sock",
            "status_endpoint": f"ipc://{run}/rt.status.sock",
            "events_endpoint": f"ipc://{run}/rt.events.sock",
            "allowed_roots": [str(model.root)],
            "pools": [{"name": "host", "device": "cpu"}],
            # the sweep's default numerics (llama.cpp's rounding) read the weights' blocks
            "storage": "native",
        },
    }
    path.write_text(yaml.safe_dump(doc))


@pytest.mark.process
def test_process_sweep_equals_the_in_process_sweep(tmp_path: Path, run_dir: Path) -> None:
    """Every round through the agent and the runtime process records the figures the in-process
    sweep records for it (==), q5_1 taken from a --source model on both paths; each swap and
    restore a commit of exactly its tensors, the restore checked on one chunk; the saved
    originals are gone at the end, the disk high-water mark is one round's shards, and the
    model's shards end as they began."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    every = {r.name: "q5_1" for r in Role if r not in F32_ROLES}
    (q5_1,) = write_model(tiny_dense().with_types(**every), tmp_path / "q5_1", layout=Layout.SINGLE)
    before = {p: Path(p).read_bytes() for p in open_shard_set(model.first).paths}
    text = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    if not text.exists():
        pytest.skip(f"no English text to evaluate on: {text} is missing")
    short = tmp_path / "english.txt"
    short.write_text(text.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    config, recipe = tmp_path / "ggufswap.yaml", tmp_path / "recipe.yaml"
    write_config(config, model, run_dir)
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "out"
    run = run_ggufswap(
        "sweep", "--config", str(config), "--text", str(short), "--recipe", str(recipe),
        "--out", str(out), "--ctx", str(CTX), "--chunks", str(CHUNKS), "--no-progress",
        "--source", f"Q5_1={q5_1}", timeout=300, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr + run.stdout
    assert "4 of 4 rounds recorded" in run.stdout
    assert not (out / "originals").exists(), "every saved shard was put back and dropped"
    shard_bytes = max(
        sum(Path(model.shard_of(n)).stat().st_size for n in r["tensors"])
        for r in Journal(out / "rounds.jsonl").records.values()
    )
    high = json.loads((out / "report.json").read_text())["disk"]["high_water_bytes"]
    assert 0 < high <= 2 * shard_bytes, "one round's saved shards and scratch tensors at most"
    # The agent ran with the sweep's short settle window (the group's renames still one round).
    assert load_config(out / AGENT_CONFIG).models[0].settle_ms == SWEEP_SETTLE_MS
    process = Journal(out / "rounds.jsonl").records
    in_process = run_sweep(
        model.first,
        text=short.read_text(encoding="utf-8"),
        recipe=Recipe.from_document(RECIPE),
        out_dir=tmp_path / "in-process",
        options=SweepOptions(n_ctx=CTX, max_chunks=CHUNKS),
        models={int(GGMLType.Q5_1): GgufSet(q5_1)},
    ).journal
    assert set(process) == set(in_process)
    for key, record in process.items():
        assert record["metrics"] == in_process[key]["metrics"], key
        assert record["tensors"] == in_process[key]["tensors"]
        assert record["restored_version"] > record["weight_version"] > 0
        assert record["verified_chunks"] == 1, "the restore check evaluates one chunk"
    after = {p: Path(p).read_bytes() for p in open_shard_set(model.first).paths}
    assert after == before


@pytest.mark.process
def test_process_sweep_needs_one_tensor_per_shard(tmp_path: Path, run_dir: Path) -> None:
    """A model whose shards hold several tensors is refused before any process starts, naming
    the command that splits it."""
    model = ModelDir.write(tmp_path / "model", tiny_dense(), layout=Layout.SINGLE)
    config, recipe = tmp_path / "ggufswap.yaml", tmp_path / "recipe.yaml"
    write_config(config, model, run_dir)
    recipe.write_text(yaml.safe_dump(RECIPE))
    text = tmp_path / "english.txt"
    text.write_text("Monday, Tuesday. " * 200, encoding="utf-8")
    run = run_ggufswap(
        "sweep", "--config", str(config), "--text", str(text), "--recipe", str(recipe),
        "--out", str(tmp_path / "out"), "--no-progress", timeout=120,
    )  # fmt: skip
    assert run.returncode == 1
    assert "ggufswap split --per-tensor" in run.stderr
    assert not (tmp_path / "out" / "logs" / "runtime.log").exists()


@pytest.mark.process
def test_process_sweep_resumes_after_a_kill(tmp_path: Path, run_dir: Path) -> None:
    """SIGKILL of the sweep mid-way leaves its runtime and agent running and maybe a swapped
    shard; the same command again stops them, puts the originals back, keeps every verified round
    and completes the rest; the model's shards end as they began."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    before = {p: Path(p).read_bytes() for p in open_shard_set(model.first).paths}
    text = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    if not text.exists():
        pytest.skip(f"no English text to evaluate on: {text} is missing")
    short = tmp_path / "english.txt"
    short.write_text(text.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    config, recipe = tmp_path / "ggufswap.yaml", tmp_path / "recipe.yaml"
    write_config(config, model, run_dir)
    recipe.write_text(
        yaml.safe_dump(
            {"quants": ["q4_0", "q5_1"], "tensors": [{"match": r"^blk\.\d+\.attn_[qkv]\.weight$"}]}
        )
    )
    out = tmp_path / "out"
    cmd = [
        "sweep", "--config", str(config), "--text", str(short), "--recipe", str(recipe),
        "--out", str(out), "--ctx", str(CTX), "--chunks", str(CHUNKS), "--no-progress",
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1"}
    journal = out / "rounds.jsonl"
    first = Proc(cmd, log=tmp_path / "first.log", env=env)
    try:
        wait_for(
            lambda: journal.exists() and journal.read_bytes().count(b"\n") >= 1,
            timeout=240,
            what="a verified round in the journal",
            interval=0.02,
        )
    finally:
        first.kill()
    kept = journal.read_bytes().splitlines(keepends=True)
    assert len(kept) < 12, "the kill came after the last round"
    rerun = run_ggufswap(*cmd, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr + rerun.stdout
    lines = journal.read_bytes().splitlines(keepends=True)
    assert lines[: len(kept)] == kept
    assert len({json.loads(line)["key"] for line in lines}) == len(lines) == 12, rerun.stdout
    after = {p: Path(p).read_bytes() for p in open_shard_set(model.first).paths}
    assert after == before


def _target(config: Path, out: Path) -> ProcessTarget:
    out.mkdir(parents=True, exist_ok=True)
    return ProcessTarget(
        config_path=config,
        config=load_config(config),
        text=config,
        out_dir=out,
        n_ctx=CTX,
        max_chunks=None,
    )


def test_agent_config_shortens_only_the_sweeps_model(tmp_path: Path, run_dir: Path) -> None:
    """The agent's config is the user's with the sweep's model settling for SWEEP_SETTLE_MS; a
    model served by another runtime keeps its window, and a window already shorter is kept."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    config = tmp_path / "ggufswap.yaml"
    write_config(config, model, run_dir)
    doc = yaml.safe_load(config.read_text())
    other = dict(doc["models"][0], name="other", runtime=f"ipc://{run_dir}/other.sock")
    doc["models"].append(dict(other, settle_ms=300))
    config.write_text(yaml.safe_dump(doc))
    written = _target(config, tmp_path / "out").write_agent_config()
    assert written == tmp_path / "out" / AGENT_CONFIG
    agent = load_config(written)
    assert [m.settle_ms for m in agent.models] == [SWEEP_SETTLE_MS, 300]
    assert agent.models[1:] == load_config(config).models[1:]
    doc["models"][0]["settle_ms"] = 5
    config.write_text(yaml.safe_dump(doc))
    agent = load_config(_target(config, tmp_path / "out2").write_agent_config())
    assert [m.settle_ms for m in agent.models] == [5, 300]


def test_agent_config_with_relative_paths_is_the_users(tmp_path: Path, run_dir: Path) -> None:
    """A config whose relative paths would resolve elsewhere from OUT is given to the agent
    as it is (its own settle window), and no agent.yaml is left behind."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    config = tmp_path / "ggufswap.yaml"
    write_config(config, model, run_dir)
    doc = yaml.safe_load(config.read_text())
    doc["models"][0]["watch"][0]["path"] = "model"
    config.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    assert _target(config, out).write_agent_config() == config
    assert not (out / AGENT_CONFIG).exists()
