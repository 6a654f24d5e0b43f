"""The shard index and the reconciler: scans, validation, held tensors, plans by content."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from agent_fakes import replace_shard, shard_name, write_per_tensor_model, write_shard

from ggufswap.agent import Health, ModelIndex, plan_id_for, reconcile
from ggufswap.config import ModelConfig, TensorFilter, VerifyMode, WatchConfig
from ggufswap.ipc import SlotState, TensorEntry
from ggufswap.shards import Fingerprinter, HeaderCache, fingerprint, requantize
from ggufswap.shards.presets import tiny_dense
from ggufswap.shards.writer import write_model


def model_config(directory: Path, **overrides: object) -> ModelConfig:
    base: dict[str, object] = {
        "name": "m",
        "runtime": "ipc:///nonexistent/rt.sock",
        "watch": (WatchConfig(path=directory),),
        # These scans run right after the writes, without the daemon's debouncer: no settle
        # window (tests/test_writers.py covers the stability window).
        "settle_ms": 0,
    }
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def loaded(index: ModelIndex) -> dict[str, TensorEntry]:
    """What a runtime that loaded the current desired state would report."""
    assert index.snapshot is not None
    return {
        n: TensorEntry(r, fingerprint(r), SlotState.ON_ORIGINAL)
        for n, r in index.snapshot.desired.items()
    }


def test_thousand_shard_per_tensor_model_is_scanned_completely(tmp_path: Path) -> None:
    """A one-tensor-per-shard model of 1,000 shards scans to 1,000 valid shards and tensors,
    and a rescan re-reads only the file that changed."""
    paths = write_per_tensor_model(tmp_path / "m", 1000)
    cache = HeaderCache()
    index = ModelIndex(model_config(paths[0].parent), cache=cache)
    started = time.perf_counter()
    snap = index.scan()
    elapsed = time.perf_counter() - started
    print(f"\ncold scan of 1000 per-tensor shards: {elapsed:.3f} s")  # timing lives in bench/
    assert len(snap.desired) == 1000
    assert all(s.health is Health.VALID for s in snap.shards)
    assert snap.problems == ()
    unchanged = cache.get(paths[10])
    write_shard(paths[500], 500, 1000, seed=9)
    again = index.scan()
    assert again.generation == snap.generation + 1
    assert cache.get(paths[10]) is unchanged, "an unchanged shard is not parsed again"
    assert again.desired["t.500"].identity != snap.desired["t.500"].identity
    assert index.scan().generation == again.generation, "nothing changed: same generation"


def test_truncated_shard_is_invalid_and_its_last_good_tensors_are_held(tmp_path: Path) -> None:
    """A shard that stops parsing is invalid with a reason; its tensors are held, the others
    stay plannable, and a valid file releases them."""
    paths = write_per_tensor_model(tmp_path / "m", 3)
    index = ModelIndex(model_config(paths[0].parent))
    index.scan()
    good = paths[1].read_bytes()
    replace_shard(paths[1], good[:50])
    snap = index.scan()
    [bad] = snap.invalid
    assert bad.path == str(paths[1])
    assert bad.held_by_last_good
    assert bad.reason
    assert snap.held == frozenset({"t.1"})
    assert sorted(snap.desired) == ["t.0", "t.2"]
    replace_shard(paths[1], good)
    snap = index.scan()
    assert snap.invalid == ()
    assert snap.held == frozenset()
    assert sorted(snap.desired) == ["t.0", "t.1", "t.2"]


def test_settling_and_missing_shards_hold_their_set(tmp_path: Path) -> None:
    """A shard still settling is not read and its tensors are held; a missing member makes the
    set inconsistent and holds all of it."""
    paths = write_per_tensor_model(tmp_path / "m", 3)
    index = ModelIndex(model_config(paths[0].parent))
    index.scan()
    snap = index.scan(skip=frozenset({str(paths[2])}))
    assert snap.held == frozenset({"t.2"})
    assert {s.path: s.health for s in snap.shards}[str(paths[2])] is Health.SETTLING
    os.unlink(paths[2])
    snap = index.scan()
    assert snap.desired == {}
    assert snap.held == frozenset({"t.0", "t.1"})
    assert any("missing" in p for p in snap.problems)


def test_ignored_names_and_tensor_filters_are_applied(tmp_path: Path) -> None:
    """Temp files never count, and include/exclude decide which tensors may be planned."""
    paths = write_per_tensor_model(tmp_path / "m", 3)
    directory = paths[0].parent
    (directory / "x.gguf.incomplete").write_bytes(b"partial")
    (directory / ".m-00002-of-00003.gguf.tmp-1").write_bytes(b"partial")
    filt = TensorFilter(include=(re.compile(r"^t\.[01]$"),), exclude=(re.compile(r"^t\.0$"),))
    snap = ModelIndex(model_config(directory, tensors=filt)).scan()
    assert len(snap.shards) == 3
    assert sorted(snap.desired) == ["t.1"]


def test_checksum_reconcile_plans_only_tensors_whose_content_changed(tmp_path: Path) -> None:
    """After re-quantizing one tensor of a single-file model (moving later offsets), checksum
    mode plans only that tensor with its fingerprint; stat mode plans every moved tensor."""
    [model] = write_model(tiny_dense(n_layers=1), tmp_path / "models")
    index = ModelIndex(model_config(model.parent))
    index.scan()
    actual = loaded(index)
    requantize(model, "blk.0.attn_k.weight", "q4_0")
    snap = index.scan()
    fp = Fingerprinter()
    result = reconcile(
        snap.desired, actual, model="m", base_version=4, verify=VerifyMode.CHECKSUM, fingerprint=fp
    )
    assert result.plan is not None
    assert result.plan.names() == ("blk.0.attn_k.weight",)
    assert result.plan.jobs[0].fingerprint == fingerprint(snap.desired["blk.0.attn_k.weight"])
    again = reconcile(
        snap.desired, actual, model="m", base_version=4, verify=VerifyMode.CHECKSUM, fingerprint=fp
    )
    assert again.plan == result.plan, "the same states give the same plan and id"
    other = reconcile(
        snap.desired, actual, model="m", base_version=5, verify=VerifyMode.CHECKSUM, fingerprint=fp
    )
    assert other.plan is not None
    assert other.plan.plan_id != result.plan.plan_id
    stat = reconcile(
        snap.desired, actual, model="m", base_version=4, verify=VerifyMode.STAT, fingerprint=fp
    )
    assert stat.plan is not None
    assert len(stat.plan.jobs) == len(actual)
    assert all(j.fingerprint is None for j in stat.plan.jobs)
    in_sync = reconcile(
        snap.desired,
        loaded(index),
        model="m",
        base_version=4,
        verify=VerifyMode.STAT,
        fingerprint=fp,
    )
    assert in_sync.plan is None
    assert in_sync.unchanged == len(actual)


def test_reconcile_blocks_shape_changes_and_unloaded_tensors(tmp_path: Path) -> None:
    """A logical shape change and a tensor the runtime never loaded are reported, not planned;
    detached tensors go first."""
    paths = write_per_tensor_model(tmp_path / "m", 3)
    index = ModelIndex(model_config(paths[0].parent))
    index.scan()
    actual = loaded(index)
    del actual["t.2"]
    actual["t.0"] = TensorEntry(actual["t.0"].record, actual["t.0"].fingerprint, SlotState.DETACHED)
    write_shard(paths[0], 0, 3, seed=3)
    write_shard(paths[1], 1, 3, seed=4, n=64)
    write_shard(paths[2], 2, 3, seed=5)
    snap = index.scan()
    result = reconcile(
        snap.desired,
        actual,
        model="m",
        base_version=0,
        verify=VerifyMode.CHECKSUM,
        fingerprint=Fingerprinter(),
    )
    assert result.plan is not None
    assert result.plan.names() == ("t.0",)
    assert [b.tensor for b in result.blocked] == ["t.1"]
    assert "shape" in result.blocked[0].reason
    assert result.not_loaded == ("t.2",)
    dry = reconcile(
        snap.desired,
        {},
        model="m",
        base_version=0,
        verify=VerifyMode.STAT,
        fingerprint=Fingerprinter(),
        plan_unloaded=True,
    )
    assert dry.plan is not None
    assert sorted(dry.plan.names()) == ["t.0", "t.1", "t.2"]
    assert plan_id_for("m", 0, dry.plan.jobs) == dry.plan.plan_id
    assert plan_id_for("m", 0, tuple(reversed(dry.plan.jobs))) == dry.plan.plan_id


def test_symlinked_shards_report_the_real_directory_to_watch(tmp_path: Path) -> None:
    """Shards that are symlinks into another directory make that directory a watch root."""
    blobs = tmp_path / "blobs"
    snap_dir = tmp_path / "snap"
    paths = write_per_tensor_model(blobs, 2)
    snap_dir.mkdir()
    for no, path in enumerate(paths):
        (snap_dir / shard_name("m", no, 2)).symlink_to(path)
    index = ModelIndex(model_config(snap_dir))
    snap = index.scan()
    assert sorted(snap.desired) == ["t.0", "t.1"]
    roots = {r.directory: r for r in index.watch_roots()}
    assert roots[str(blobs)].is_link_target
    assert index.concerns(str(paths[1]))
    assert not index.concerns(str(blobs / ".hidden"))


@pytest.mark.reliability(
    "bad input",
    "a current.gguf symlink (and a hard link) to a sibling shard in the same watched directory",
    tries=2,
    outcome="one shard set, read from the file itself: every tensor plannable, no 'two shard "
    "sets' problem; two copies of a file (other inodes) still conflict",
)
def test_a_link_to_a_sibling_shard_is_the_same_shard_not_a_second_set(tmp_path: Path) -> None:
    """``current.gguf`` pointing at a shard of the same directory (a symlink, or a hard link: the
    same device and inode) is that shard: its tensors are desired from the file (by a name that
    is no symlink), not held as being in two shard sets; a copy (another inode) conflicts."""
    directory = tmp_path / "m"
    directory.mkdir()
    model = Path(write_model(tiny_dense(), directory)[0])
    (directory / "current.gguf").symlink_to(model.name)
    os.link(model, directory / "hard.gguf")
    snap = ModelIndex(model_config(directory)).scan()
    assert snap.problems == (), snap.problems
    assert snap.held == frozenset()
    assert snap.desired
    [path] = {r.path for r in snap.desired.values()}  # one file, by one of its own names
    assert os.path.samefile(path, model)
    assert not os.path.islink(path)
    (directory / "copy.gguf").write_bytes(model.read_bytes())
    again = ModelIndex(model_config(directory)).scan()
    assert any("two shard sets" in p for p in again.problems), again.problems
