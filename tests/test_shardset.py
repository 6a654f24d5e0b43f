"""Shard sets: one file, gguf-split shards and one tensor per shard open as the same model.

Broken sets are built byte by byte (``ggufbytes``) with exactly one inconsistency each; every one
must be a ShardSetError whose message names the problem.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ggufbytes as gb
import pytest
from ggufbytes import KV, TI, V, kv_str
from processes import run_ggufswap

from ggufswap.shards import (
    HeaderCache,
    ShardError,
    ShardSet,
    ShardSetError,
    TensorRecord,
    open_shard_set,
    read_header,
)
from ggufswap.shards.presets import tiny_moe
from ggufswap.shards.shardset import split_path
from ggufswap.shards.writer import Layout, write_model


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[Layout, list[Path]]:
    root = tmp_path_factory.mktemp("layouts")
    spec = tiny_moe()
    return {layout: write_model(spec, root / layout.value, layout=layout) for layout in Layout}


def _view(tensors: dict[str, TensorRecord] | object) -> dict[str, tuple[object, ...]]:
    """What must agree across layouts: everything but the file and where in it."""
    assert isinstance(tensors, dict)
    return {n: (t.ggml_type, t.ne, t.nbytes) for n, t in tensors.items()}


def _content(t: TensorRecord) -> bytes:
    with open(t.path, "rb") as f:
        f.seek(t.offset)
        return f.read(t.nbytes)


def test_layouts_give_the_same_view(layouts: dict[Layout, list[Path]]) -> None:
    """Single, split and per-tensor layouts of one model give the same name -> record view."""
    views = {layout: open_shard_set(paths[0]) for layout, paths in layouts.items()}
    single = views[Layout.SINGLE]
    assert len(single.shards) == 1
    assert len(views[Layout.PER_TENSOR].shards) == len(single.tensors)
    assert len(views[Layout.SPLIT].shards) == len(layouts[Layout.SPLIT]) > 1
    for layout, shard_set in views.items():
        assert _view(dict(shard_set.tensors)) == _view(dict(single.tensors)), layout
        for name, t in shard_set.tensors.items():
            assert _content(t) == _content(single.tensors[name]), (layout, name)
        assert shard_set.metadata["general.architecture"] == "qwen3moe"


@pytest.mark.parametrize("layout", [Layout.SPLIT, Layout.PER_TENSOR])
def test_open_from_any_member(layouts: dict[Layout, list[Path]], layout: Layout) -> None:
    """Opening a split set from any of its members gives the same shards in split order."""
    paths = layouts[layout]
    expected = open_shard_set(paths[0])
    assert expected.paths == tuple(str(p.resolve()) for p in paths)
    for member in paths:
        shard_set = open_shard_set(member)
        assert shard_set.paths == expected.paths
        assert dict(shard_set.tensors) == dict(expected.tensors)


def test_open_through_symlink(layouts: dict[Layout, list[Path]], tmp_path: Path) -> None:
    """A symlink to a member resolves to the real set (siblings found next to the real file)."""
    link = tmp_path / "current.gguf"
    link.symlink_to(layouts[Layout.SPLIT][1])
    assert open_shard_set(link).paths == open_shard_set(layouts[Layout.SPLIT][0]).paths


def test_from_headers_any_order(layouts: dict[Layout, list[Path]]) -> None:
    """ShardSet.from_headers sorts by split.no whatever the order it is given."""
    headers = [read_header(p) for p in reversed(layouts[Layout.SPLIT])]
    shard_set = ShardSet.from_headers(headers)
    assert [h.split_no for h in shard_set.shards] == list(range(len(headers)))


def test_from_headers_empty() -> None:
    """An empty set is a programming error (ValueError)."""
    with pytest.raises(ValueError, match="at least one shard"):
        ShardSet.from_headers([])


# --- broken sets -------------------------------------------------------------------------------


def _shard(
    directory: Path,
    no: int,
    count: int,
    tensors: list[str],
    *,
    declared_count: int | None = None,
    total: int | None = None,
    name: str | None = None,
) -> Path:
    """One gguf-split shard: split.no/count/tensors.count plus the given tensors."""
    kvs = [kv_str("general.architecture", "llama")] if no == 0 else []
    kvs += [
        KV("split.no", V.UINT16, no),
        KV("split.count", V.UINT16, count if declared_count is None else declared_count),
        KV("split.tensors.count", V.INT32, total if total is not None else 2 * count),
    ]
    built = gb.build(kvs=kvs, tensors=[TI(t, (32,)) for t in tensors])
    path = directory / (name or os.path.basename(split_path("m", no, count)))
    path.write_bytes(built.data)
    return path


def _good_set(directory: Path, count: int = 3) -> list[Path]:
    return [_shard(directory, n, count, [f"t{n}.a", f"t{n}.b"]) for n in range(count)]


def test_good_handmade_set(tmp_path: Path) -> None:
    """The hand-made set used below is valid when nothing is broken (no over-rejection)."""
    paths = _good_set(tmp_path)
    assert len(open_shard_set(paths[0]).tensors) == 6


def test_missing_shard(tmp_path: Path) -> None:
    """A missing member is named, with its position and the set size."""
    paths = _good_set(tmp_path)
    paths[1].unlink()
    with pytest.raises(ShardSetError) as info:
        open_shard_set(paths[0])
    message = str(info.value)
    assert "1 of 3 shards are missing" in message
    assert "m-00002-of-00003.gguf" in message


def test_missing_shard_from_headers(tmp_path: Path) -> None:
    """from_headers names the absent position when a header is left out."""
    paths = _good_set(tmp_path)
    with pytest.raises(ShardSetError, match=r"missing shard\(s\) \[3\] of 3.*m-00003-of-00003"):
        ShardSet.from_headers([read_header(p) for p in paths[:2]])


def test_wrong_split_count_in_one_member(tmp_path: Path) -> None:
    """A member that declares another split.count is named with both counts."""
    paths = _good_set(tmp_path)
    _shard(tmp_path, 1, 3, ["t1.a", "t1.b"], declared_count=4)
    with pytest.raises(ShardSetError) as info:
        open_shard_set(paths[0])
    message = str(info.value)
    assert str(paths[1].resolve()) in message
    assert "split.count=4, the set has 3" in message


def test_name_does_not_match_split_no(tmp_path: Path) -> None:
    """A shard whose file name says 2-of-3 but whose metadata says 3 is refused from any side."""
    paths = _good_set(tmp_path)
    _shard(tmp_path, 2, 3, ["t1.a", "t1.b"], name="m-00002-of-00003.gguf")
    with pytest.raises(ShardSetError, match="its name says shard 2, its metadata says 3"):
        open_shard_set(paths[0])
    with pytest.raises(ShardSetError, match=r"must end in '-00003-of-00003\.gguf'"):
        open_shard_set(paths[1])


def test_split_file_without_split_name(tmp_path: Path) -> None:
    """A file declaring split metadata under a plain name cannot locate its siblings."""
    path = _shard(tmp_path, 0, 2, ["a"], name="model.gguf")
    with pytest.raises(ShardSetError, match="gguf-split naming convention"):
        open_shard_set(path)


def test_tensor_in_two_shards(tmp_path: Path) -> None:
    """A tensor present in two shards is named with both files."""
    paths = _good_set(tmp_path)
    _shard(tmp_path, 2, 3, ["t2.a", "t0.b"])
    with pytest.raises(ShardSetError) as info:
        open_shard_set(paths[0])
    message = str(info.value)
    assert "tensor 't0.b' is in both" in message
    assert str(paths[0].resolve()) in message
    assert str(paths[2].resolve()) in message


def test_tensors_count_mismatch(tmp_path: Path) -> None:
    """split.tensors.count disagreeing with the tensors found is refused with both numbers."""
    paths = [_shard(tmp_path, n, 2, [f"t{n}"], total=3) for n in range(2)]
    with pytest.raises(ShardSetError, match=r"split\.tensors\.count=3 .* hold 2 tensors"):
        open_shard_set(paths[1])


def test_every_problem_is_listed(tmp_path: Path) -> None:
    """from_headers lists every inconsistency, not only the first."""
    paths = _good_set(tmp_path)
    _shard(tmp_path, 1, 3, ["t0.a", "t1.b"], declared_count=5, total=6)
    with pytest.raises(ShardSetError) as info:
        ShardSet.from_headers([read_header(p) for p in paths])
    message = str(info.value)
    assert "split.count=5" in message
    assert "'t0.a' is in both" in message


def test_missing_file_is_shard_error(tmp_path: Path) -> None:
    """Opening a path that does not exist is a ShardError naming it."""
    with pytest.raises(ShardError, match="no such file"):
        open_shard_set(tmp_path / "nope.gguf")


# --- header cache ------------------------------------------------------------------------------


def test_cache_reuses_unchanged_header(layouts: dict[Layout, list[Path]]) -> None:
    """A file whose identity has not changed is not parsed again."""
    cache = HeaderCache()
    first = open_shard_set(layouts[Layout.SPLIT][0], cache=cache)
    second = open_shard_set(layouts[Layout.SPLIT][2], cache=cache)
    assert len(cache) == len(layouts[Layout.SPLIT])
    for a, b in zip(first.shards, second.shards, strict=True):
        assert a is b


def test_cache_rereads_after_atomic_rename(tmp_path: Path) -> None:
    """A file replaced by rename (new inode) is parsed again and its new table is returned."""
    path = tmp_path / "m.gguf"
    path.write_bytes(gb.build(tensors=[TI("a", (32,))]).data)
    cache = HeaderCache()
    before = cache.get(path)
    assert cache.get(path) is before
    tmp = tmp_path / ".m.gguf.tmp"
    tmp.write_bytes(gb.build(tensors=[TI("a", (32,)), TI("b", (64,))]).data)
    os.replace(tmp, path)
    after = cache.get(path)
    assert after is not before
    assert after.identity != before.identity
    assert [t.name for t in after.tensors] == ["a", "b"]
    assert cache.get(path) is after


def test_cache_forgets_removed_file(tmp_path: Path) -> None:
    """A removed file raises ShardError and leaves the cache."""
    path = tmp_path / "m.gguf"
    path.write_bytes(gb.build(tensors=[TI("a", (32,))]).data)
    cache = HeaderCache()
    cache.get(path)
    path.unlink()
    with pytest.raises(ShardError, match="no such file"):
        cache.get(path)
    assert len(cache) == 0


# --- ggufswap inspect (a real subprocess) ------------------------------------------------------


@pytest.mark.process
def test_cli_inspect_json_split_set(layouts: dict[Layout, list[Path]]) -> None:
    """`ggufswap inspect SHARD --json` lists every shard, every tensor and per-type totals."""
    paths = layouts[Layout.SPLIT]
    proc = run_ggufswap("inspect", paths[1], "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    expected = open_shard_set(paths[0])
    assert [s["path"] for s in doc["shards"]] == list(expected.paths)
    assert [s["split_no"] for s in doc["shards"]] == list(range(len(paths)))
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows.keys() == expected.tensors.keys()
    for name, t in expected.tensors.items():
        row = rows[name]
        assert (row["type"], row["shape"], row["offset"], row["bytes"], row["shard"]) == (
            t.ggml_type.name,
            list(t.shape),
            t.offset,
            t.nbytes,
            t.path,
        )
    assert sum(v["bytes"] for v in doc["totals"].values()) == doc["total"]["bytes"]
    assert doc["total"]["tensors"] == len(expected.tensors)
    assert doc["metadata"]["general.architecture"] == "qwen3moe"
    assert doc["metadata"]["tokenizer.ggml.tokens"] == {"array_of": "STRING", "count": 256}


@pytest.mark.process
def test_cli_inspect_text(layouts: dict[Layout, list[Path]]) -> None:
    """The text form shows the shard list, metadata, the tensor table and totals by type."""
    proc = run_ggufswap("inspect", layouts[Layout.SINGLE][0])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for fragment in ("metadata:", "general.architecture = 'qwen3moe'", "totals by type:"):
        assert fragment in out
    assert "blk.3.ffn_down_exps.weight  Q8_0  4x64x64" in out


@pytest.mark.process
def test_cli_inspect_bad_file(tmp_path: Path) -> None:
    """A file that is not GGUF exits 1 with the reader's message on stderr."""
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"hello, this is not a model at all")
    proc = run_ggufswap("inspect", path, "--json")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "expected magic b'GGUF'" in proc.stderr
    assert str(path) in proc.stderr


def test_split_set_behind_hugging_face_blob_links_opens(tmp_path: Path) -> None:
    """A split model whose shards are links in snapshots/ to hash-named blobs opens from a link."""
    from ggufswap.shards import Layout, tiny_moe, write_model

    written = write_model(tiny_moe(), tmp_path / "built", layout=Layout.SPLIT)
    blobs = tmp_path / "blobs"
    snapshot = tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(written)):
        blob = blobs / f"{i:040x}"
        path.rename(blob)
        (snapshot / path.name).symlink_to(blob)
    first = sorted(snapshot.iterdir())[0]
    shard_set = open_shard_set(first)
    assert len(shard_set.shards) == len(written)
    assert {Path(s.path).parent for s in shard_set.shards} == {blobs}
    assert open_shard_set(sorted(snapshot.iterdir())[-1]).tensors.keys() == shard_set.tensors.keys()
