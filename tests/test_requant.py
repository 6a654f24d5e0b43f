"""Re-encoding one tensor of a shard (``requantize``), ``restore`` and the ``requant`` command."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from processes import run_ggufswap

from ggufswap.shards import kquants
from ggufswap.shards.errors import ShardError
from ggufswap.shards.presets import demo_moe, tiny_moe
from ggufswap.shards.reader import read_header
from ggufswap.shards.requant import SUPPORTED_TARGETS, RequantError, requantize, restore
from ggufswap.shards.writer import Layout, write_model

UP = "blk.1.ffn_up_exps.weight"


def _fields(path: Path | gguf.GGUFReader) -> dict[str, tuple[list[int], object]]:
    """Every metadata key with its value types and decoded value."""
    reader = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(path)
    return {
        k: ([int(t) for t in f.types], f.contents())
        for k, f in reader.fields.items()
        if k not in ("GGUF.tensor_count", "GGUF.kv_count")
    }


def _tensors(path: Path | gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    reader = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(path)
    return {t.name: t for t in reader.tensors}


def _floats(t: gguf.ReaderTensor) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def _assert_only_changed(before: Path, after: Path, name: str, new_type: Q) -> None:
    """All metadata and every other tensor's bytes, type and shape are identical."""
    # One reader per file: gguf-py takes seconds to parse a long vocabulary.
    old_reader, new_reader = gguf.GGUFReader(before), gguf.GGUFReader(after)
    assert _fields(old_reader) == _fields(new_reader)
    old, new = _tensors(old_reader), _tensors(new_reader)
    assert list(old) == list(new)
    for n in old:
        assert tuple(old[n].shape) == tuple(new[n].shape), n
        if n != name:
            assert old[n].tensor_type == new[n].tensor_type, n
            assert bytes(old[n].data) == bytes(new[n].data), n
    assert new[name].tensor_type == new_type


@pytest.mark.parametrize("target", [Q.Q4_0, Q.Q5_1, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_requant_changes_exactly_one_tensor(tmp_path: Path, target: Q) -> None:
    """requantize(out=...) re-encodes one tensor; metadata and other tensors stay byte-identical."""
    (src,) = write_model(tiny_moe(), tmp_path / "m")
    original = src.read_bytes()
    out = requantize(src, UP, target.name.lower(), out=tmp_path / "new.gguf")
    assert out == tmp_path / "new.gguf"
    assert src.read_bytes() == original
    _assert_only_changed(src, out, UP, target)
    before, after = _floats(_tensors(src)[UP]), _floats(_tensors(out)[UP])
    rel = float(np.sqrt(np.mean((after - before) ** 2)) / np.sqrt(np.mean(before**2)))
    assert rel < 0.15, rel
    assert read_header(out).tensor_map()[UP].ggml_type == target


def test_requant_to_f32_is_exactly_the_dequantized_original(tmp_path: Path) -> None:
    """A synthesized Q4_K tensor requantized to F32 holds exactly its dequantized values."""
    name = "blk.0.ffn_down_exps.weight"
    (src,) = write_model(demo_moe(n_layers=1).with_types(ffn_down_exps="q4_k"), tmp_path)
    out = requantize(src, name, Q.F32, out=tmp_path / "f32.gguf")
    _assert_only_changed(src, out, name, Q.F32)
    np.testing.assert_array_equal(_floats(_tensors(out)[name]), _floats(_tensors(src)[name]))


def test_requant_in_place_on_a_split_shard_keeps_split_keys(tmp_path: Path) -> None:
    """Without out, the shard is replaced by rename, keeps its split.* keys and leaves no temp."""
    paths = write_model(tiny_moe(), tmp_path, layout=Layout.SPLIT)
    shard = next(p for p in paths if UP in _tensors(p))
    saved = tmp_path / "saved" / shard.name
    saved.parent.mkdir()
    saved.write_bytes(shard.read_bytes())
    inode = shard.stat().st_ino
    assert requantize(shard, UP, "q4_1") == shard
    assert shard.stat().st_ino != inode
    _assert_only_changed(saved, shard, UP, Q.Q4_1)
    assert {"split.no", "split.count", "split.tensors.count"} <= set(_fields(shard))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(p.name for p in paths), "saved"])
    restore(saved, shard)
    assert shard.read_bytes() == saved.read_bytes()


def test_requant_keeps_a_long_vocabulary_byte_identical(tmp_path: Path) -> None:
    """A shard with a 20000-entry vocabulary keeps its whole header up to the tensor table."""
    name = "token_embd.weight"
    (src,) = write_model(tiny_moe(extra_vocab_strings=20_000), tmp_path)
    out = requantize(src, name, "q5_0", out=tmp_path / "o.gguf")
    # The tensor table starts with token_embd's name: everything before it is preamble and KV.
    first_info = struct.pack("<Q", len(name)) + name.encode()
    before, after = src.read_bytes(), out.read_bytes()
    kv_end = before.index(first_info)
    assert kv_end > 20_000 * 8
    assert after.index(first_info) == kv_end
    assert after[:kv_end] == before[:kv_end]
    # The metadata is byte-identical above, so the tensors are compared through the project's
    # reader (gguf-py takes seconds to parse the 20000 strings again; the other tests use it).
    old, new = read_header(src).tensor_map(), read_header(out).tensor_map()
    assert list(old) == list(new)
    for n, record in old.items():
        assert new[n].ne == record.ne, n
        if n != name:
            assert new[n].ggml_type == record.ggml_type, n
            assert after[new[n].offset : new[n].end] == before[record.offset : record.end], n
    assert new[name].ggml_type == Q.Q5_0


def test_unknown_tensor_is_refused_with_nearest_names(tmp_path: Path) -> None:
    """An unknown tensor name raises RequantError listing the nearest names; nothing is written."""
    (src,) = write_model(tiny_moe(), tmp_path)
    original = src.read_bytes()
    with pytest.raises(RequantError, match=r"nearest: blk\.1\.ffn_up_exps\.weight") as info:
        requantize(src, "blk.1.ffn_up_exp.weight", "q4_0")
    assert isinstance(info.value, ShardError)
    assert info.value.path == str(src)
    assert src.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == [src.name]


def test_unsupported_target_type_lists_the_supported_ones(tmp_path: Path) -> None:
    """A target requant cannot write is refused with the supported types and the tool that can."""
    (src,) = write_model(tiny_moe(), tmp_path)
    original = src.read_bytes()
    with pytest.raises(RequantError) as info:
        requantize(src, UP, "iq3_s")
    message = str(info.value)
    assert "cannot quantize to IQ3_S" in message
    assert all(t.name in message for t in SUPPORTED_TARGETS)
    assert "llama.cpp's tool writes it: llama-quantize --allow-requantize --tensor-type" in message
    assert "'^blk\\.1\\.ffn_up_exps\\.weight$=iq3_s' IN.gguf OUT.gguf IQ3_S" in message
    with pytest.raises(RequantError, match=r"--imatrix IMATRIX\.dat --tensor-type"):
        requantize(src, UP, Q.IQ2_XS)
    with pytest.raises(RequantError, match=r"ik_llama\.cpp's tool .* --custom-q .*=iq4_ks'"):
        requantize(src, UP, "iq4_ks")
    with pytest.raises(RequantError, match=r"no quantizer writes Q8_K .*; requant writes F32"):
        requantize(src, UP, "q8_k")
    with pytest.raises(RequantError, match="unknown GGML type 'not_a_type'; requant writes F32"):
        requantize(src, UP, "not_a_type")
    assert src.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == [src.name]


@pytest.mark.parametrize("target", kquants.TYPES, ids=lambda t: t.name)
def test_requant_to_k_quants_writes_ggml_reference_bytes(tmp_path: Path, target: Q) -> None:
    """A K-quant/IQ4 target holds kquants' bytes of the dequantized tensor; nothing else changes."""
    name = "blk.0.attn_q.weight"
    (src,) = write_model(demo_moe(n_layers=1), tmp_path / "m")
    out = requantize(src, name, target.name.lower(), out=tmp_path / "new.gguf")
    _assert_only_changed(src, out, name, target)
    before = _floats(_tensors(src)[name])
    assert bytes(_tensors(out)[name].data) == bytes(kquants.quantize(before, target))
    after = _floats(_tensors(out)[name])
    rel = float(np.sqrt(np.mean((after - before) ** 2)) / np.sqrt(np.mean(before**2)))
    assert rel < 0.5, rel


def test_k_quant_target_needs_whole_super_blocks(tmp_path: Path) -> None:
    """A row length that is not a multiple of 256 is refused for a K-quant, naming both."""
    (src,) = write_model(tiny_moe(), tmp_path)
    with pytest.raises(
        RequantError, match=r"ne\[0\]=64 is not a multiple of the Q4_K block size 256"
    ):
        requantize(src, UP, "q4_k")


@pytest.mark.process
def test_requant_command(tmp_path: Path) -> None:
    """`ggufswap requant` prints what it changed (types and bytes) and the written shard; an
    unknown tensor or type exits 1 with why."""
    (src,) = write_model(tiny_moe(), tmp_path)
    done = run_ggufswap("requant", str(src), UP, "q8_0", "--out", str(tmp_path / "o.gguf"))
    assert done.returncode == 0, done.stderr
    changed, written = done.stdout.strip().splitlines()
    old = read_header(src).tensor_map()[UP]
    new = read_header(tmp_path / "o.gguf").tensor_map()[UP]
    assert changed == (
        f"{UP}: {old.ggml_type.name} → Q8_0, {old.nbytes:,} → {new.nbytes:,} bytes"
    ), changed
    assert Path(written) == tmp_path / "o.gguf"
    _assert_only_changed(src, tmp_path / "o.gguf", UP, Q.Q8_0)
    bad = run_ggufswap("requant", str(src), "blk.1.ffn_upexps.weight", "q8_0")
    assert bad.returncode == 1
    assert "blk.1.ffn_up_exps.weight" in bad.stderr
    refused = run_ggufswap("requant", str(src), UP, "tq1_0")
    assert refused.returncode == 1
    assert "cannot quantize to TQ1_0" in refused.stderr
    assert "llama-quantize --allow-requantize --tensor-type" in refused.stderr
