"""The decoder's config reads every hyper-parameter with llama.cpp's rule for the architecture
(llama_model_base::load_hparams and each src/models/<arch>.cpp), and refuses what llama.cpp's
loader refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ggufswap.runtime.models import HParams, HParamsError, MissingWeightError, Transformer
from ggufswap.runtime.models.blocks import DictWeightProvider

E, H, FF, V = 32, 4, 48, 8


def md(arch: str, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.block_count": 1,
        f"{arch}.embedding_length": E,
        f"{arch}.feed_forward_length": FF,
        f"{arch}.attention.head_count": H,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.context_length": 64,
        f"{arch}.vocab_size": V,
    }
    out.update({f"{arch}.{k}": v for k, v in extra.items()})
    return out


MOE = {"expert_count": 4, "expert_used_count": 2}


def test_qwen_moe_expert_width_falls_back_to_ff_over_experts_used() -> None:
    """qwen2moe/qwen3moe: expert_feed_forward_length, else feed_forward_length / used experts."""
    for arch in ("qwen2moe", "qwen3moe"):
        assert HParams.from_metadata(md(arch, **MOE)).n_ff_exp == FF // 2
        keyed = md(arch, **MOE, expert_feed_forward_length=16)
        assert HParams.from_metadata(keyed).n_ff_exp == 16


def test_qwen2moe_shared_width_falls_back_to_feed_forward_length() -> None:
    """qwen2moe's shared expert is expert_shared_feed_forward_length wide, else
    feed_forward_length; qwen3moe and llama have none."""
    assert HParams.from_metadata(md("qwen2moe", **MOE)).n_ff_shexp == FF
    keyed = md("qwen2moe", **MOE, expert_shared_feed_forward_length=24)
    config = HParams.from_metadata(keyed)
    assert (config.n_ff_shexp, config.has_shared_expert) == (24, True)
    for arch in ("qwen3moe", "llama"):
        config = HParams.from_metadata(md(arch, **MOE, expert_shared_feed_forward_length=24))
        assert (config.n_ff_shexp, config.has_shared_expert) == (0, False)


def test_expert_weight_keys_are_not_read_where_llama_cpp_does_not_read_them() -> None:
    """expert_weights_norm/scale and expert_gating_func do not change llama/qwen MoE routing:
    their loaders never read them (their graphs fix softmax, norm_w and no scale)."""
    extra = {"expert_weights_norm": True, "expert_weights_scale": 2.5, "expert_gating_func": 2}
    qwen2 = HParams.from_metadata(md("qwen2moe", **MOE, **extra))
    assert (qwen2.norm_topk, qwen2.expert_weights_scale) == (False, 1.0)
    llama = HParams.from_metadata(md("llama", **MOE, expert_weights_norm=False))
    assert llama.norm_topk


def _weights(config: HParams, *, shared: bool, output: bool) -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {
        "token_embd.weight": torch.zeros(V, E),
        "output_norm.weight": torch.ones(E),
        "blk.0.attn_norm.weight": torch.ones(E),
        "blk.0.ffn_norm.weight": torch.ones(E),
        "blk.0.ffn_gate_inp.weight": torch.zeros(4, E),
        **{f"blk.0.attn_{p}.weight": torch.zeros(E, E) for p in ("q", "k", "v", "output")},
        **{
            f"blk.0.ffn_{p}_exps.weight": torch.zeros(4, config.n_ff_exp, E)
            for p in "gate up".split()
        },
        "blk.0.ffn_down_exps.weight": torch.zeros(4, E, config.n_ff_exp),
    }
    if output:
        t["output.weight"] = torch.zeros(V, E)
    if shared:
        t |= {f"blk.0.ffn_{p}_shexp.weight": torch.zeros(FF, E) for p in ("gate", "up")}
        t |= {"blk.0.ffn_down_shexp.weight": torch.zeros(E, FF)}
        t |= {"blk.0.ffn_gate_inp_shexp.weight": torch.zeros(E)}
    if config.arch.value == "qwen3moe":
        t |= {
            "blk.0.attn_q_norm.weight": torch.ones(E // H),
            "blk.0.attn_k_norm.weight": torch.ones(E // H),
        }
    return t


def test_a_shared_expert_where_the_architecture_has_none_is_refused() -> None:
    """qwen3moe with ffn_*_shexp tensors is refused naming them (llama.cpp: wrong number of
    tensors); the same weights without them build."""
    config = HParams.from_metadata(md("qwen3moe", **MOE))
    with pytest.raises(MissingWeightError, match=r"ffn_up_shexp\.weight: qwen3moe has no shared"):
        Transformer(config, DictWeightProvider(_weights(config, shared=True, output=True)))
    Transformer(config, DictWeightProvider(_weights(config, shared=False, output=True)))


def test_qwen2moe_needs_its_shared_expert_and_its_output() -> None:
    """qwen2moe without output.weight or without its shared expert is refused (llama.cpp
    requires both); with both it builds."""
    config = HParams.from_metadata(md("qwen2moe", **MOE))
    with pytest.raises(MissingWeightError, match=r"output\.weight: missing"):
        Transformer(config, DictWeightProvider(_weights(config, shared=True, output=False)))
    with pytest.raises(MissingWeightError, match=r"ffn_gate_inp_shexp\.weight: missing"):
        Transformer(config, DictWeightProvider(_weights(config, shared=False, output=True)))
    Transformer(config, DictWeightProvider(_weights(config, shared=True, output=True)))


def test_rope_scaling_type_defaults_to_linear_and_reads_the_old_key() -> None:
    """rope.scaling.factor without a type scales linearly (llama.cpp's default "linear"), so does
    the old rope.scale_linear; type "none" never scales."""
    assert (
        HParams.from_metadata(md("llama", **{"rope.scaling.factor": 4.0})).rope_freq_scale == 0.25
    )
    assert HParams.from_metadata(md("llama", **{"rope.scale_linear": 2.0})).rope_freq_scale == 0.5
    none = md("llama", **{"rope.scaling.type": "none", "rope.scaling.factor": 4.0})
    assert HParams.from_metadata(none).rope_freq_scale == 1.0


def test_vocab_is_the_token_list_before_vocab_size() -> None:
    """llama.cpp sizes token_embd by the tokenizer's token list; vocab_size only names the model."""
    both = md("qwen3", vocab_size=99)
    both["tokenizer.ggml.tokens"] = ["a"] * V
    assert HParams.from_metadata(both).n_vocab == V


def test_per_layer_arrays_with_one_value_are_read() -> None:
    """feed_forward_length and head counts may be per-layer arrays (get_key_or_arr): one value
    repeated is that value; differing values are refused by name."""
    config = HParams.from_metadata(
        md("qwen3", feed_forward_length=(FF,), **{"attention.head_count_kv": (2,)})
    )
    assert (config.n_ff, config.n_head_kv) == (FF, 2)
    with pytest.raises(HParamsError, match=r"qwen3\.feed_forward_length: per-layer values"):
        HParams.from_metadata(md("qwen3", block_count=2, feed_forward_length=(FF, 64)))


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        ("llama", {"rope.dimension_count": 4}, "invalid n_rot: 4, expected 8"),
        (
            "qwen2",
            {"attention.key_length": 16, "attention.value_length": 16},
            "key_length 16 must be n_embd / n_head",
        ),
        ("qwen3", {"attention.key_length": 16}, "value_length = 8 differs"),
    ],
)
def test_head_widths_llama_cpp_refuses_are_refused(
    arch: str, extra: dict[str, Any], message: str
) -> None:
    """llama's rope dims must be the head width, qwen2's head width n_embd / n_head, and value
    heads as wide as key heads."""
    with pytest.raises(HParamsError, match=message):
        HParams.from_metadata(md(arch, **extra))


def test_gemma3_27b_scales_attention_by_embedding_over_heads() -> None:
    """gemma3 with 62 blocks (the 27B) uses 1/sqrt(n_embd / n_head), others 1/sqrt(key_length)."""
    head = {"attention.key_length": 16, "attention.value_length": 16, "attention.sliding_window": 4}
    small = HParams.from_metadata(md("gemma3", **head))
    big = HParams.from_metadata(md("gemma3", block_count=62, **head))
    assert small.attn_scale == pytest.approx(16**-0.5)
    assert big.attn_scale == pytest.approx((E // H) ** -0.5)
