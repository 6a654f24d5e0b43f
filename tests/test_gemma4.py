"""gemma4: per-layer attention shapes read as llama.cpp reads them, V = K without attn_v,
proportional RoPE through rope_freqs, routed experts beside the dense MLP (stacked or fused as
the converter writes them, with their scales in the block's family), swaps equal to a fresh
load, and what is refused by name."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
import torch
from runtime_helpers import ModelDir, Q, assert_swap_equals_fresh_load, one_thread, open_model

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import Storage
from ggufswap.runtime.models import HParams, HParamsError
from ggufswap.runtime.models.gemma4 import layer_config
from ggufswap.shards import read_header, requantize
from ggufswap.shards.presets import tiny_gemma4
from ggufswap.shards.writer import plan_tensors, write_sparse_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the shared code

import xcheck  # found on the path above

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

MOE = {"n_expert": 4, "n_expert_used": 2, "n_ff_expert": 32}
CONVERTED = xcheck.family_fixtures("gemma4") / "converted" / "gemma4-tiny-F32.gguf"


def metadata(**overrides: object) -> dict[str, object]:
    with TemporaryDirectory() as tmp:
        return dict(read_header(write_sparse_model(tiny_gemma4(**overrides), tmp)).metadata)


def test_each_layer_takes_its_kinds_heads_and_rope() -> None:
    """Sliding layers: heads of key_length_swa over their key/value heads, rope dims _swa, base
    freq_base_swa; the full layer: its own head width and key/value heads (a per-layer array),
    every dim rotated by rope_freqs; softmax scale 1."""
    config = HParams.from_metadata(metadata())
    assert config.swa_layers == (True,) * 5 + (False,)
    assert (config.sliding_window, config.attn_scale, config.final_logit_softcap) == (4, 1.0, 30)
    swa, full = layer_config(config, 0), layer_config(config, 5)
    assert (swa.head_dim, swa.n_rot, swa.n_head_kv) == (16, 16, 2)
    assert (full.head_dim, full.n_rot, full.n_head_kv) == (32, 32, 1)
    assert config.rope_base_local == 10000.0


def test_the_writer_lays_out_llama_cpps_tensors() -> None:
    """rope_freqs (1 for the rotating pairs, 1e30 for the others), no attn_v in the full layer
    with attention_k_eq_v, and with experts the router and per-expert scales, the second
    pre/post norms; every block a layer output scale."""
    planned = {t.name: t for t in plan_tensors(tiny_gemma4(**MOE))}
    assert planned["rope_freqs.weight"].ne == (16,)
    assert "blk.5.attn_v.weight" not in planned
    assert "blk.4.attn_v.weight" in planned
    for name in ("ffn_gate_inp.scale", "ffn_down_exps.scale", "pre_ffw_norm_2.weight"):
        assert f"blk.0.{name}" in planned
    assert all(f"blk.{b}.layer_output_scale.weight" in planned for b in range(6))
    with TemporaryDirectory() as tmp:
        path = ModelDir.write(Path(tmp), tiny_gemma4()).first
        runtime, model = open_model(path)
        try:
            factors = runtime.store.weight("rope_freqs.weight")
            assert factors.tolist() == [1.0] * 4 + [pytest.approx(1e30, rel=1e-6)] * 12
            tables = model.rope(2, 1, torch.device("cpu"), factors=factors)
            assert tables.sin[0, 4:].abs().max() < 1e-20  # the unrotated pairs
        finally:
            runtime.close()


@pytest.mark.parametrize(
    ("key", "value", "what"),
    [
        ("gemma4.attention.shared_kv_layers", 2, "layers reusing earlier layers' keys and values"),
        ("gemma4.embedding_length_per_layer_input", 256, "per-layer embeddings"),
    ],
)
def test_gemma4_e2b_features_are_refused_by_name(key: str, value: int, what: str) -> None:
    """Files of Gemma 4 E2B/E4B (shared key/value layers, per-layer embeddings) are refused with
    the key: the decoder does not implement them."""
    with pytest.raises(HParamsError, match=rf"{key} = {value}: {what}"):
        HParams.from_metadata(metadata() | {key: value})


def test_a_per_layer_key_value_array_is_read_only_where_declared() -> None:
    """gemma4 reads differing per-layer head_count_kv values; other architectures still refuse
    such an array by name."""
    assert HParams.from_metadata(metadata()).n_head_kv_layers == (2, 2, 2, 2, 2, 1)
    with TemporaryDirectory() as tmp:
        md = dict(read_header(write_sparse_model(tiny_gemma4(arch="gemma3"), tmp)).metadata)
    md["gemma3.attention.head_count_kv"] = [2, 2, 2, 2, 2, 1]
    with pytest.raises(HParamsError, match=r"head_count_kv: per-layer values"):
        HParams.from_metadata(md)


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_an_expert_swap_equals_a_fresh_load_and_restores(tmp_path: Path, storage: Storage) -> None:
    """Re-quantizing a block's expert stack and committing it gives a fresh load's logits bit for
    bit, the original back the first ones; the block's family holds the stacks and the
    per-expert down scale."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_gemma4(**MOE))
    name = "blk.5.ffn_up_exps.weight"
    saved = model_dir.save(name, tmp_path / "saved")
    variant = model_dir.variant(name, Q.Q4_0, tmp_path / "variants")
    runtime, model = open_model(model_dir.first, storage=storage)
    try:
        family = {f"blk.5.ffn_{r}_exps.weight" for r in ("gate", "up", "down")}
        family.add("blk.5.ffn_down_exps.scale")
        assert set(runtime.store.families["blk.5.ffn_exps"]) == family
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, name, variant, storage=storage, saved=saved
        )
    finally:
        runtime.close()


def test_a_rope_freqs_swap_equals_a_fresh_load(tmp_path: Path) -> None:
    """The full layers' factors are read at every forward: another set swapped in (more pairs
    rotating) gives a fresh load's logits."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_gemma4())
    other = ModelDir.write(tmp_path / "other", tiny_gemma4(rope_dim=16))
    runtime, model = open_model(model_dir.first)
    try:
        name = "rope_freqs.weight"
        replacement = other.shard_of(name)
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, name, replacement, storage=Storage.DEQUANTIZED
        )
    finally:
        runtime.close()


def test_a_fused_gate_up_swap_in_a_converter_file_equals_a_fresh_load(tmp_path: Path) -> None:
    """The converter writes Gemma 4's experts as one ffn_gate_up_exps stack: it is read as the
    gate's rows then the up's, belongs to the block's family, and a re-quantized stack committed
    into the running model gives a fresh load's logits."""
    path = Path(shutil.copy2(CONVERTED, tmp_path / CONVERTED.name))
    name = "blk.0.ffn_gate_up_exps.weight"
    runtime, model = open_model(path)
    try:
        assert name in runtime.store.families["blk.0.ffn_exps"]
        with torch.inference_mode():
            before = model(xcheck_tokens())
        requantize(path, name, "q8_0")
        runtime.apply(Plan("fused", "", (Job(read_header(path).tensor_map()[name]),)))
        with torch.inference_mode():
            swapped = model(xcheck_tokens())
        assert not torch.equal(swapped, before)
        fresh_runtime, fresh = open_model(path)
        try:
            with torch.inference_mode():
                assert torch.equal(swapped, fresh(xcheck_tokens()))
        finally:
            fresh_runtime.close()
    finally:
        runtime.close()


def xcheck_tokens() -> torch.Tensor:
    return torch.tensor([xcheck.TOKENS], dtype=torch.int64)
