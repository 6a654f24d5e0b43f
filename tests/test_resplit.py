"""``ggufswap split``: one tensor per shard and back to one file, every tensor's bytes, type and
shape and every metadata key (but ``split.*``) unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from processes import run_ggufswap

from ggufswap.shards import Fingerprinter, Layout, ShardSet, open_shard_set, tiny_moe, write_model

pytestmark = pytest.mark.process

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def content(shard_set: ShardSet) -> dict[str, tuple[str, tuple[int, ...], str]]:
    fp = Fingerprinter()
    return {n: (r.ggml_type.name, r.ne, fp(r)) for n, r in shard_set.tensors.items()}


def metadata(shard_set: ShardSet) -> dict[str, object]:
    return {k: v for k, v in shard_set.metadata.items() if not k.startswith("split.")}


@pytest.mark.parametrize("layout", [Layout.SINGLE, Layout.SPLIT], ids=lambda x: x.value)
def test_per_tensor_and_back_keeps_every_tensor_and_key(tmp_path: Path, layout: Layout) -> None:
    """A model split per tensor is a valid set of one tensor per shard with the source's tensors
    and keys; merged back it is one file with the same again, byte for byte per tensor."""
    paths = write_model(tiny_moe(), tmp_path / "src", layout=layout)
    source = open_shard_set(paths[0])
    run = run_ggufswap("split", paths[0], tmp_path / "per", "--per-tensor")
    assert run.returncode == 0, run.stderr
    first = Path(run.stdout.split()[0])
    per = open_shard_set(first)
    assert len(per.shards) == len(source.tensors)
    assert all(len(h.tensors) == 1 for h in per.shards)
    assert [t.name for h in per.shards for t in h.tensors] == [
        t.name for h in source.shards for t in h.tensors
    ]
    assert content(per) == content(source)
    assert metadata(per) == metadata(source)
    assert per.metadata["split.count"] == len(per.shards)
    assert all(set(h.metadata) == set(SPLIT_KEYS) for h in per.shards[1:])

    run = run_ggufswap("split", first, tmp_path / "one.gguf", "--merge")
    assert run.returncode == 0, run.stderr
    one = open_shard_set(tmp_path / "one.gguf")
    assert len(one.shards) == 1
    assert content(one) == content(source)
    assert metadata(one) == metadata(source)
    assert not any(k.startswith("split.") for k in one.metadata)


def test_split_of_a_missing_file_fails_naming_it(tmp_path: Path) -> None:
    """A model that cannot be read exits 1 with its path."""
    run = run_ggufswap("split", tmp_path / "nope.gguf", tmp_path / "out", "--per-tensor")
    assert run.returncode == 1
    assert "nope.gguf" in run.stderr
