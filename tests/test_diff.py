"""Tensor-table diffs: one test per change kind and field, and hypothesis properties."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import fuzz_budget
import ggufbytes as gb
import pytest
from gguf import GGMLQuantizationType
from ggufbytes import TI
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import run_ggufswap

from ggufswap.shards import (
    ChangeKind,
    Field,
    FileIdentity,
    Fingerprinter,
    TensorChange,
    TensorRecord,
    diff_tables,
    read_header,
    tensor_nbytes,
)
from ggufswap.shards.presets import tiny_moe
from ggufswap.shards.writer import Layout, write_model

Q = GGMLQuantizationType
ID_A = FileIdentity(1, 10, 1 << 20, 100, 100)
ID_B = FileIdentity(1, 11, 1 << 20, 200, 200)


def rec(
    name: str = "w",
    ggml_type: Q = Q.F32,
    ne: tuple[int, ...] = (32, 4),
    *,
    offset: int = 0,
    path: str = "/m/a.gguf",
    identity: FileIdentity = ID_A,
) -> TensorRecord:
    return TensorRecord(name, ggml_type, ne, offset, tensor_nbytes(ggml_type, ne), path, identity)


def one(old: TensorRecord, new: TensorRecord, **kw: object) -> TensorChange:
    (change,) = diff_tables({old.name: old}, {new.name: new}, include_unchanged=True, **kw)  # type: ignore[arg-type]
    return change


def test_added() -> None:
    """A name only in the new table is ADDED, with the new record."""
    new = rec("x")
    (change,) = diff_tables({}, {"x": new})
    assert (change.kind, change.old, change.new, change.fields) == (
        ChangeKind.ADDED,
        None,
        new,
        frozenset(),
    )
    assert change.describe() == "added F32 [4, 32]"


def test_removed() -> None:
    """A name only in the old table is REMOVED, with the old record."""
    old = rec("x")
    (change,) = diff_tables({"x": old}, {})
    assert (change.kind, change.old, change.new) == (ChangeKind.REMOVED, old, None)
    assert change.describe() == "removed"


def test_unchanged_is_omitted_by_default() -> None:
    """An identical record is left out unless include_unchanged is set."""
    r = rec()
    assert diff_tables({"w": r}, {"w": r}) == []
    assert one(r, r).kind is ChangeKind.UNCHANGED
    assert one(r, r).fields == frozenset()


def test_shape_changed() -> None:
    """A different logical shape is SHAPE_CHANGED, described as refused, whatever else differs."""
    change = one(rec(ne=(32, 4)), rec(ne=(32, 8), ggml_type=Q.Q8_0, offset=64))
    assert change.kind is ChangeKind.SHAPE_CHANGED
    assert change.describe() == "shape [4, 32] -> [8, 32] (will be refused)"


def test_same_elements_other_shape_is_shape_changed() -> None:
    """A transposed ne (same element count) is still a shape change."""
    assert one(rec(ne=(32, 64)), rec(ne=(64, 32))).kind is ChangeKind.SHAPE_CHANGED


def test_type_change() -> None:
    """A type change is MODIFIED with TYPE, NBYTES and CONTENT."""
    change = one(rec(ggml_type=Q.F32), rec(ggml_type=Q.Q8_0))
    assert change.kind is ChangeKind.MODIFIED
    assert change.fields == {Field.TYPE, Field.NBYTES, Field.CONTENT}
    assert change.describe() == "type F32 -> Q8_0, bytes 512 -> 136, content"


def test_type_change_same_size() -> None:
    """F16 -> BF16 keeps the byte size: TYPE and CONTENT but not NBYTES."""
    change = one(rec(ggml_type=Q.F16), rec(ggml_type=Q.BF16))
    assert change.fields == {Field.TYPE, Field.CONTENT}


def test_offset_only() -> None:
    """A move within the same file version is MODIFIED with OFFSET only (content unknown)."""
    change = one(rec(offset=0), rec(offset=512))
    assert (change.kind, change.fields) == (ChangeKind.MODIFIED, {Field.OFFSET})
    assert change.describe() == "offset"


def test_shard_move() -> None:
    """A tensor moved to another shard is MODIFIED with SHARD (and IDENTITY)."""
    change = one(rec(), rec(path="/m/b.gguf", identity=ID_B))
    assert change.fields == {Field.SHARD, Field.IDENTITY}
    assert change.describe() == "shard"


def test_identity_only() -> None:
    """Same place in a rewritten file is MODIFIED with IDENTITY, described as a rewrite."""
    change = one(rec(), rec(identity=ID_B))
    assert (change.kind, change.fields) == (ChangeKind.MODIFIED, {Field.IDENTITY})
    assert change.describe() == "file rewritten"


def _two_versions(tmp_path: Path, first: bytes, second: bytes) -> tuple[TensorRecord, TensorRecord]:
    """Tensor ``w`` in a.gguf, then in b.gguf at another offset (both files kept)."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(gb.build(tensors=[TI("w", (64,), data=first)]).data)
    b.write_bytes(gb.build(tensors=[TI("pad", (8,)), TI("w", (64,), data=second)]).data)
    return read_header(a).tensor_map()["w"], read_header(b).tensor_map()["w"]


def test_fingerprint_same_content_moved_is_unchanged(tmp_path: Path) -> None:
    """With fingerprints, equal bytes moved to another shard and offset are UNCHANGED."""
    old, new = _two_versions(tmp_path, bytes(range(256)), bytes(range(256)))
    fp = Fingerprinter()
    change = one(old, new, fingerprint=fp)
    assert change.kind is ChangeKind.UNCHANGED
    assert change.fields == {Field.SHARD, Field.OFFSET, Field.IDENTITY}
    assert Field.CONTENT not in change.fields
    assert diff_tables({"w": old}, {"w": new}, fingerprint=fp) == []


def test_fingerprint_changed_content(tmp_path: Path) -> None:
    """With fingerprints, different bytes of the same type are MODIFIED with CONTENT."""
    old, new = _two_versions(tmp_path, bytes(range(256)), bytes(255 - b for b in range(256)))
    change = one(old, new, fingerprint=Fingerprinter())
    assert change.kind is ChangeKind.MODIFIED
    assert Field.CONTENT in change.fields


def test_fingerprint_not_called_when_nothing_moved() -> None:
    """An identical record is UNCHANGED without reading any bytes."""
    calls: list[TensorRecord] = []

    def fp(r: TensorRecord) -> str:
        calls.append(r)
        return "x"

    assert one(rec(), rec(), fingerprint=fp).kind is ChangeKind.UNCHANGED
    assert calls == []


def test_sorted_by_name() -> None:
    """Changes come sorted by tensor name."""
    old = {n: rec(n) for n in ("b", "d")}
    new = {n: rec(n) for n in ("a", "c")}
    assert [c.name for c in diff_tables(old, new)] == ["a", "b", "c", "d"]


def test_change_is_hashable() -> None:
    """TensorChange is a frozen record usable in sets."""
    change = one(rec(), rec(offset=32))
    assert change in {change}


# --- properties --------------------------------------------------------------------------------

NAMES = st.sampled_from([f"blk.{i}.w" for i in range(8)])
TYPES = st.sampled_from([Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
NES = st.sampled_from([(32,), (32, 2), (64, 2), (32, 4), (32, 2, 2)])
IDENTITIES = st.sampled_from([ID_A, ID_B])
PATHS = st.sampled_from(["/m/a.gguf", "/m/b.gguf"])
OFFSETS = st.sampled_from([0, 64, 128])


@st.composite
def records(draw: st.DrawFn, name: str) -> TensorRecord:
    return rec(
        name,
        draw(TYPES),
        draw(NES),
        offset=draw(OFFSETS),
        path=draw(PATHS),
        identity=draw(IDENTITIES),
    )


@st.composite
def tables(draw: st.DrawFn) -> dict[str, TensorRecord]:
    names = draw(st.sets(NAMES, max_size=6))
    return {n: draw(records(n)) for n in sorted(names)}


def content_of(contents: Mapping[tuple[str, FileIdentity, int], int]) -> Callable[..., str]:
    """A fingerprint function over a table of (path, identity, offset) -> content id."""

    def fp(r: TensorRecord) -> str:
        return f"{r.ggml_type.name}:{contents.get((r.path, r.identity, r.offset), 0)}"

    return fp


PROPS = settings(max_examples=fuzz_budget.examples(150), deadline=None, database=None)


@PROPS
@given(tables())
def test_prop_self_diff_is_empty(table: dict[str, TensorRecord]) -> None:
    """The diff of a table with itself is empty."""
    assert diff_tables(table, table) == []
    assert diff_tables(table, dict(table), fingerprint=lambda r: r.name) == []


@PROPS
@given(tables(), tables())
def test_prop_added_removed_are_set_differences(
    old: dict[str, TensorRecord], new: dict[str, TensorRecord]
) -> None:
    """ADDED names are exactly new - old, REMOVED exactly old - new."""
    changes = diff_tables(old, new)
    assert {c.name for c in changes if c.kind is ChangeKind.ADDED} == new.keys() - old.keys()
    assert {c.name for c in changes if c.kind is ChangeKind.REMOVED} == old.keys() - new.keys()
    assert all(c.name in old.keys() & new.keys() for c in changes if c.old and c.new)


def _apply(old: Mapping[str, TensorRecord], changes: list[TensorChange]) -> dict[str, TensorRecord]:
    out = dict(old)
    for c in changes:
        if c.kind is ChangeKind.REMOVED:
            del out[c.name]
        else:
            assert c.new is not None
            out[c.name] = c.new
    return out


@PROPS
@given(tables(), tables())
def test_prop_apply_changes_yields_new(
    old: dict[str, TensorRecord], new: dict[str, TensorRecord]
) -> None:
    """Applying the changes to old gives new exactly (unchanged records are equal records)."""
    assert _apply(old, diff_tables(old, new)) == new


@PROPS
@given(
    tables(), tables(), st.dictionaries(st.tuples(PATHS, IDENTITIES, OFFSETS), st.integers(0, 2))
)
def test_prop_apply_with_fingerprints_yields_new(
    old: dict[str, TensorRecord],
    new: dict[str, TensorRecord],
    contents: dict[tuple[str, FileIdentity, int], int],
) -> None:
    """With fingerprints and include_unchanged, applying the changes gives new exactly."""
    changes = diff_tables(old, new, fingerprint=content_of(contents), include_unchanged=True)
    assert _apply(old, changes) == new


@PROPS
@given(tables(), tables())
def test_prop_shape_changes_always_flagged(
    old: dict[str, TensorRecord], new: dict[str, TensorRecord]
) -> None:
    """Every common tensor whose logical shape differs is SHAPE_CHANGED, and only those."""
    for fp in (None, content_of({})):
        changes = {c.name: c for c in diff_tables(old, new, fingerprint=fp)}
        for name in old.keys() & new.keys():
            differs = old[name].shape != new[name].shape
            flagged = name in changes and changes[name].kind is ChangeKind.SHAPE_CHANGED
            assert flagged == differs


@PROPS
@given(st.data(), tables())
def test_prop_same_content_moves_are_unchanged(
    data: st.DataObject, old: dict[str, TensorRecord]
) -> None:
    """With a fingerprint, a tensor moved with its type, shape and content intact is UNCHANGED."""
    new = {
        name: dataclasses.replace(
            r,
            offset=data.draw(st.sampled_from([0, 64, 128, 256])),
            path=data.draw(PATHS),
            identity=data.draw(IDENTITIES),
        )
        for name, r in old.items()
    }

    def same_content(r: TensorRecord) -> str:  # each tensor carries its bytes wherever it goes
        return f"bytes-of-{r.name}"

    changes = diff_tables(old, new, fingerprint=same_content, include_unchanged=True)
    assert len(changes) == len(old)
    for change in changes:
        assert change.kind is ChangeKind.UNCHANGED, change
        assert Field.CONTENT not in change.fields


# --- ggufswap diff (a real subprocess) ---------------------------------------------------------


def _models(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A model, a requantized copy (ffn_up_exps Q4_0) and the original as a split set."""
    spec = tiny_moe()
    (base,) = write_model(spec, tmp_path / "base")
    (requant,) = write_model(spec.with_types(ffn_up_exps="q4_0"), tmp_path / "requant")
    split = write_model(spec, tmp_path / "split", layout=Layout.SPLIT)
    return base, requant, split[2]


@pytest.mark.process
def test_cli_diff_types(tmp_path: Path) -> None:
    """`ggufswap diff A B --json` reports exactly the requantized tensors as type changes."""
    base, requant, _ = _models(tmp_path)
    proc = run_ggufswap("diff", base, requant, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    changed = [c for c in doc["changes"] if not c["relocated_only"]]
    assert [c["name"] for c in changed] == [f"blk.{b}.ffn_up_exps.weight" for b in range(4)]
    for c in changed:
        assert c["kind"] == "modified"
        assert {"type", "nbytes", "content"} <= set(c["fields"])
        assert (c["old"]["type"], c["new"]["type"]) == ("Q8_0", "Q4_0")
    assert doc["counts"]["modified"] == 4
    assert doc["content_compared"] is False


@pytest.mark.process
def test_cli_diff_text(tmp_path: Path) -> None:
    """The text form lists each change with its description and a summary line."""
    base, requant, _ = _models(tmp_path)
    proc = run_ggufswap("diff", base, requant)
    assert proc.returncode == 0, proc.stderr
    assert "MODIFIED      blk.2.ffn_up_exps.weight: type Q8_0 -> Q4_0" in proc.stdout
    assert "4 change(s): 0 added, 0 removed, 4 modified, 0 shape changed" in proc.stdout


@pytest.mark.process
def test_cli_diff_checksum_single_vs_split(tmp_path: Path) -> None:
    """With --checksum, the same model as one file and as a split set has no changes at all."""
    base, _, split_member = _models(tmp_path)
    plain = json.loads(run_ggufswap("diff", base, split_member, "--json").stdout)
    assert plain["counts"]["relocated_only"] == plain["counts"]["common"] > 0
    proc = run_ggufswap("diff", base, split_member, "--json", "--checksum")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["changes"] == []
    assert doc["content_compared"] is True
    assert len(doc["new"]) > 1


@pytest.mark.process
def test_cli_diff_checksum_detects_content(tmp_path: Path) -> None:
    """With --checksum, a tensor with other bytes of the same type is MODIFIED with content."""
    spec = tiny_moe()
    (a,) = write_model(spec, tmp_path / "a")
    (b,) = write_model(dataclasses.replace(spec, seed=1), tmp_path / "b")
    doc = json.loads(run_ggufswap("diff", a, b, "--json", "--checksum").stdout)
    assert doc["counts"]["modified"] == doc["counts"]["common"]
    assert all("content" in c["fields"] for c in doc["changes"])


@pytest.mark.process
def test_cli_diff_missing_file(tmp_path: Path) -> None:
    """A missing model exits 1 naming the path."""
    base, _, _ = _models(tmp_path)
    proc = run_ggufswap("diff", base, tmp_path / "gone.gguf")
    assert proc.returncode == 1
    assert "gone.gguf: no such file" in proc.stderr
