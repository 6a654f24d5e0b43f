"""minimax-m2: Q/K RMS norms across all heads at once, partial NEOX RoPE, sigmoid or softmax
routing with the required selection bias, read as llama.cpp reads them; refusals; an expert
swap equals a fresh load with the block's experts in one family."""

from __future__ import annotations

from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
import torch
from runtime_helpers import ModelDir, Q, assert_swap_equals_fresh_load, one_thread, open_model

from ggufswap.runtime import Storage
from ggufswap.runtime.models import HParams, HParamsError
from ggufswap.runtime.models.blocks import DictWeightProvider, TensorSpec
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RotaryEmbedding
from ggufswap.runtime.models.hparams import Gating
from ggufswap.runtime.models.minimax_m2 import NormedAttention
from ggufswap.shards import read_header
from ggufswap.shards.presets import tiny_minimax_m2
from ggufswap.shards.writer import write_sparse_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def metadata(**overrides: object) -> dict[str, object]:
    with TemporaryDirectory() as tmp:
        return dict(read_header(write_sparse_model(tiny_minimax_m2(**overrides), tmp)).metadata)


def test_the_keys_are_read_as_llama_cpp_reads_them() -> None:
    """The experts take feed_forward_length, the gating function is the file's, the chosen
    weights are renormalised, and half of each head rotates."""
    config = HParams.from_metadata(metadata())
    assert (config.n_ff_exp, config.gating, config.norm_topk) == (64, Gating.SIGMOID, True)
    assert (config.head_dim, config.n_rot, config.has_shared_expert) == (16, 8, False)
    assert HParams.from_metadata(metadata(expert_gating_func=1)).gating is Gating.SOFTMAX


def test_q_and_k_are_normed_across_all_heads_at_once() -> None:
    """attn_q_norm is as wide as all query heads: one RMS over the whole projection, then the
    heads (not a norm per head)."""
    config = HParams.from_metadata(metadata())
    g = torch.Generator().manual_seed(0)
    d, hd = config.n_embd, config.head_dim
    q_dim, kv_dim = config.n_head * hd, config.n_head_kv * hd
    names = ("attn_q", "attn_k", "attn_v", "attn_output")
    shapes = ((q_dim, d), (kv_dim, d), (kv_dim, d), (d, q_dim))
    tensors = {f"blk.0.{n}.weight": torch.randn(*s, generator=g) / 8 for n, s in zip(names, shapes)}
    tensors["blk.0.attn_q_norm.weight"] = 1 + torch.randn(q_dim, generator=g) / 10
    tensors["blk.0.attn_k_norm.weight"] = 1 + torch.randn(kv_dim, generator=g) / 10
    attention = NormedAttention(config, DictWeightProvider(tensors), 0, TensorSpec())
    x = torch.randn(1, 1, d, generator=g)  # one position: attention returns its own value
    rope = RotaryEmbedding(config)(0, 1, torch.device("cpu"))
    v = (x @ tensors["blk.0.attn_v.weight"].T).view(1, 1, config.n_head_kv, hd)
    y = v.repeat_interleave(config.q_per_kv, dim=2).reshape(1, 1, q_dim)
    torch.testing.assert_close(
        attention(x, rope, None, None), y @ tensors["blk.0.attn_output.weight"].T
    )
    q = rms_norm(x @ tensors["blk.0.attn_q.weight"].T, tensors["blk.0.attn_q_norm.weight"], 1e-6)
    per_head = rms_norm(
        (x @ tensors["blk.0.attn_q.weight"].T).view(1, 1, config.n_head, hd),
        tensors["blk.0.attn_q_norm.weight"].view(config.n_head, hd),
        1e-6,
    )
    assert not torch.allclose(q.view_as(per_head), per_head), "the two norms differ"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"expert_probs_bias": False}, "exp_probs_b is required"),
        ({"expert_gating_func": 0}, "expert_gating_func 1 .* or 2"),
        ({"tied_output": True}, "cannot tie its output"),
    ],
)
def test_the_writer_refuses_what_llama_cpp_refuses(
    overrides: dict[str, object], reason: str
) -> None:
    """No selection bias, no gating function, a tied output: llama.cpp would refuse (or abort on)
    each, so the writer does."""
    with pytest.raises(ValueError, match=reason):
        tiny_minimax_m2(**overrides)


def test_a_file_without_a_gating_function_is_refused_by_name() -> None:
    """build_moe_ffn aborts without expert_gating_func; the decoder refuses it with the key."""
    md = metadata()
    del md["minimax-m2.expert_gating_func"]
    with pytest.raises(HParamsError, match=r"minimax-m2\.expert_gating_func = 0"):
        HParams.from_metadata(md)


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_an_expert_swap_equals_a_fresh_load_and_restores(tmp_path: Path, storage: Storage) -> None:
    """Re-quantizing an expert stack and committing it gives a fresh load's logits bit for bit,
    the original back the first ones; the block's three stacks are one family (the selection
    bias stands alone)."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_minimax_m2())
    name = "blk.2.ffn_gate_exps.weight"
    saved = model_dir.save(name, tmp_path / "saved")
    variant = model_dir.variant(name, Q.Q4_0, tmp_path / "variants")
    runtime, model = open_model(model_dir.first, storage=storage)
    try:
        family = {f"blk.2.ffn_{r}_exps.weight" for r in ("gate", "up", "down")}
        assert set(runtime.store.families["blk.2.ffn_exps"]) == family
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, name, variant, storage=storage, saved=saved
        )
    finally:
        runtime.close()
