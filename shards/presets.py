"""Preset model specs: the tiny models the tests use and the demo's model.

Each returns a :class:`~ggufswap.shards.writer.ModelSpec`; keyword overrides replace any field
(``tiny_moe(n_layers=2)``). ``ggufswap make-model --preset NAME`` writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Final

from gguf import GGMLQuantizationType as Q

from ggufswap.shards.keys import Arch
from ggufswap.shards.writer import ModelSpec, Role


def _preset(arch: Arch, name: str, overrides: Mapping[str, Any], **fields: Any) -> ModelSpec:
    """``ModelSpec(arch=arch, name=name, **fields)``, then ``overrides`` replace any field."""
    return replace(ModelSpec(arch=arch, name=name, **fields), **overrides)


# 4 blocks, 4 experts of width 64, 2 used: tiny_moe and tiny_gpt_oss.
_FOUR_EXPERTS: Final[Mapping[str, Any]] = MappingProxyType(
    {"n_layers": 4, "n_expert": 4, "n_expert_used": 2, "n_ff_expert": 64}
)
# deepseek2's and glm4moe's routed blocks: 3 blocks (one leading dense), 8 experts of width 32
# (2 used) plus one shared expert, sigmoid gating with the exp_probs_b selection bias, weights
# renormalised and scaled by 2.5.
_ROUTED: Final[Mapping[str, Any]] = MappingProxyType(
    {
        "n_layers": 3,
        "n_ff": 128,
        "n_expert": 8,
        "n_expert_used": 2,
        "n_ff_expert": 32,
        "n_dense_lead": 1,
        "shared_expert": True,
        "expert_gating_func": 2,
        "expert_probs_bias": True,
        "expert_weights_norm": True,
        "expert_weights_scale": 2.5,
    }
)


def tiny_dense(**overrides: Any) -> ModelSpec:
    """A 2-block dense llama (n_embd 64, vocab 256): the smallest realistic model."""
    return _preset(Arch.LLAMA, "tiny-dense", overrides)


def tiny_moe(**overrides: Any) -> ModelSpec:
    """A 4-block qwen3moe with 4 experts, 2 used (n_embd 64, vocab 256)."""
    return _preset(Arch.QWEN3MOE, "tiny-moe", overrides, n_ff=128, **_FOUR_EXPERTS)


def tiny_deepseek2(**overrides: Any) -> ModelSpec:
    """A 3-block deepseek2 (n_embd 64, vocab 256) with every feature llama.cpp's graph has:
    latent attention with q_lora (attn_k_b/attn_v_b form; ``mla_split=False`` for attn_kv_b,
    ``q_lora_rank=0`` for attn_q), one leading dense block, 8 experts (2 used) in 4 groups (2
    used), sigmoid gating with the exp_probs_b selection bias, renormalised and scaled weights,
    one shared expert, YaRN x4 (original context 64, log multiplier 0.1).
    Rows of 32 values: Q8_0/Q4_* fit; pass ``n_embd=256`` for K-quant rows (``deepseek2_wide``).
    """
    fields = dict(overrides)
    if not fields.get("mla_split", True):  # attn_kv_b is multi-head
        fields.setdefault("n_head_kv", fields.get("n_head", ModelSpec.n_head))
    return _preset(
        Arch.DEEPSEEK2,
        "tiny-deepseek2",
        fields,
        **_ROUTED,
        n_head_kv=1,
        head_dim=48,
        rope_dim=16,
        v_head_dim=32,
        q_lora_rank=32,
        kv_lora_rank=32,
        n_expert_groups=4,
        n_group_used=2,
        rope_scaling="yarn",
        rope_scaling_factor=4.0,
        rope_orig_ctx=64,
        yarn_log_mul=0.1,
    )


def tiny_deepseek2_ik(**overrides: Any) -> ModelSpec:
    """``tiny-deepseek2`` in ik_llama.cpp's form (DeepSeek-R1-0528 / V3-0324 as the GGUF Tool
    Suite ships them): ``attn_kv_b`` and, beside it, 2-D ``attn_k_b`` / ``attn_v_b`` holding its
    matrices split per head (from the written ``attn_kv_b``'s values), no ``*_mla`` keys, one
    key/value head per query head. ik_llama.cpp loads it; mainline llama.cpp refuses it."""
    fields = {"name": "tiny-deepseek2-ik", "mla_split": False, "mla_ik": True, **overrides}
    return tiny_deepseek2(**fields)


# The DSA lightning indexer of the tiny DeepSeek-V3.2 / GLM-5: 4 heads of 64 (llama.cpp's
# Hadamard rotation needs a power of 2 >= 64), each query keeping its 4 best-scored positions,
# so every position past the fourth attends sparsely.
_INDEXER: Final[Mapping[str, Any]] = MappingProxyType(
    {"indexer_heads": 4, "indexer_head_dim": 64, "indexer_top_k": 4}
)


def tiny_deepseek32(**overrides: Any) -> ModelSpec:
    """A deepseek32 like DeepSeek-V3.2, tiny: ``tiny-deepseek2``'s blocks (attn_k_b/attn_v_b,
    q_lora, 8 experts in 4 groups, sigmoid with the selection bias, YaRN x4) and a lightning
    indexer in every block (4 heads of 64, top-k 4)."""
    return tiny_deepseek2(
        **{"arch": Arch.DEEPSEEK32, "name": "tiny-deepseek32", **_INDEXER, **overrides}
    )


def tiny_glm_dsa(**overrides: Any) -> ModelSpec:
    """A glm-dsa like GLM-5.2, tiny (n_embd 64, vocab 256): 4 blocks (one dense), latent
    attention with q_lora, the indexer in blocks 0 and 2 (blocks 1 and 3 reuse their top-k,
    ``indexer_types``), 8 experts (2 used) with the default sigmoid gating and the selection
    bias, renormalised and scaled by 2.5, one shared expert, no RoPE scaling."""
    return _preset(
        Arch.GLM_DSA,
        "tiny-glm-dsa",
        overrides,
        **{**_ROUTED, "n_layers": 4, "expert_gating_func": 0},
        **_INDEXER,
        indexer_types=(True, False, True, False),
        n_head_kv=1,
        head_dim=48,
        rope_dim=16,
        v_head_dim=32,
        q_lora_rank=32,
        kv_lora_rank=32,
    )


def tiny_glm4moe(**overrides: Any) -> ModelSpec:
    """A glm4moe like GLM-4.5-Air, tiny (n_embd 64, vocab 256): 3 blocks (one dense) and one
    NextN/MTP block, heads of 32 with Q/K/V biases and half of each head rotated, 8 experts (2
    used) with sigmoid gating, the exp_probs_b selection bias, renormalised and scaled by 2.5,
    one shared expert. ``attn_qk_norm=True`` adds GLM-4.5's per-head Q/K norms."""
    return _preset(
        Arch.GLM4MOE,
        "tiny-glm4moe",
        overrides,
        **_ROUTED,
        n_nextn=1,
        head_dim=32,
        rope_dim=16,
        attn_bias=True,
    )


def tiny_llama3(**overrides: Any) -> ModelSpec:
    """``tiny-dense`` with Llama 3.1 RoPE scaling: a ``rope_freqs.weight`` computed by the
    converter's rule (factor 8, low/high frequency factors 1 and 4) for an original context of 32
    positions, so that the factors change the rotation within a few tokens (Llama 3.1 itself:
    8192)."""
    return _preset(
        Arch.LLAMA,
        "tiny-llama3",
        overrides,
        rope_llama3_factor=8.0,
        rope_llama3_original_context=32,
    )


def tiny_gpt_oss(**overrides: Any) -> ModelSpec:
    """A 4-block gpt-oss (two sliding-window layers of 4 tokens, two global), 4 experts (2 used)
    in MXFP4 as OpenAI ships them, YaRN as gpt-oss's files (factor 32 over 4096 positions, RoPE
    base 150000); n_embd 64, four heads of 16."""
    mxfp4 = {Role.FFN_GATE_EXPS: Q.MXFP4, Role.FFN_UP_EXPS: Q.MXFP4, Role.FFN_DOWN_EXPS: Q.MXFP4}
    return _preset(
        Arch.GPT_OSS,
        "tiny-gpt-oss",
        overrides,
        **_FOUR_EXPERTS,
        rope_freq_base=150000.0,
        rope_yarn_factor=32.0,
        rope_yarn_original_context=4096,
        sliding_window=4,
        types=mxfp4,
    )


def tiny_qwen3vlmoe(**overrides: Any) -> ModelSpec:
    """Qwen3-VL-235B-A22B's text tower, tiny: ``tiny-moe``'s blocks (4 experts of 64, 2 used,
    heads of 16) with interleaved multimodal RoPE sections [4, 2, 2, 0] over the whole head (as
    Qwen3-VL's [24, 20, 20] over 64 pairs, they leave one pair of each head unrotated for text)
    and Qwen3-VL's RoPE base 5e6."""
    return _preset(
        Arch.QWEN3VLMOE,
        "tiny-qwen3vlmoe",
        overrides,
        n_ff=128,
        **_FOUR_EXPERTS,
        rope_sections=(4, 2, 2, 0),
        rope_freq_base=5_000_000.0,
    )


def tiny_minimax_m2(**overrides: Any) -> ModelSpec:
    """A minimax-m2 like MiniMax-M2, tiny (n_embd 64, vocab 256): 4 blocks, heads of 16 with half
    of each rotated (MiniMax-M2: 64 of 128) and Q/K norms across all heads, 4 experts of width 64
    (2 used) with sigmoid gating and the exp_probs_b selection bias, RoPE base 5e6."""
    return _preset(
        Arch.MINIMAX_M2,
        "tiny-minimax-m2",
        overrides,
        **_FOUR_EXPERTS,
        rope_dim=8,
        expert_gating_func=2,
        expert_probs_bias=True,
        rope_freq_base=5_000_000.0,
    )


def tiny_llama4(**overrides: Any) -> ModelSpec:
    """A llama4 like Llama 4 Maverick, tiny (n_embd 64, vocab 256): 4 blocks, the odd ones
    routed (4 experts of width 64, 1 used, sigmoid weights before the expert, a shared expert of
    the same width), the even ones dense SwiGLU (n_ff 128); blocks 0-2 chunked with RoPE and
    weightless Q/K norms, block 3 NoPE with the attention temperature; Llama 4's RoPE base 5e5
    and llama3-type scaling factors (factor 16 over an original context of 32 positions, so they
    matter within a few tokens; Scout: over 8192)."""
    return _preset(
        Arch.LLAMA4,
        "tiny-llama4",
        overrides,
        **{**_FOUR_EXPERTS, "n_expert_used": 1},
        n_ff=128,
        moe_layer_step=2,
        rope_freq_base=500_000.0,
        rope_llama3_factor=16.0,
        rope_llama3_low_freq_factor=1.0,
        rope_llama3_high_freq_factor=4.0,
        rope_llama3_original_context=32,
    )


def tiny_gemma4(**overrides: Any) -> ModelSpec:
    """A gemma4 like Gemma 4 31B, tiny (n_embd 64, vocab 256): 6 blocks, the first five
    sliding-window (window 4, heads of 16 over 2 key/value heads, RoPE base 10000), the sixth full
    attention (heads of 32 over 1 key/value head and no attn_v, V = K; "proportional" RoPE: 8 of
    the 32 dims rotate, base 1e6), Q/K/V norms, GeGLU (n_ff 128), soft-capping 30. With
    ``n_expert`` > 0 every block adds routed experts (Gemma 4 26B-A4B)."""
    return _preset(
        Arch.GEMMA4,
        "tiny-gemma4",
        overrides,
        n_layers=6,
        full_attention_interval=6,
        head_dim=32,
        head_dim_swa=16,
        n_head_kv_full=1,
        attn_k_eq_v=True,
        rope_dim=8,
        rope_freq_base=1_000_000.0,
        final_logit_softcap=30.0,
    )


def gemma4_wide(**overrides: Any) -> dict[str, Any]:
    """Spec fields that give every quantizable row of ``tiny_gemma4`` 256 values."""
    wide = {
        "n_embd": 256,
        "n_ff": 256,
        "n_ff_expert": 256,
        "head_dim": 128,
        "head_dim_swa": 64,
        "rope_dim": 32,
    }
    return {**wide, **overrides}


def tiny_dots1(**overrides: Any) -> ModelSpec:
    """A dots1 like dots.llm1, tiny (n_embd 64, vocab 256): ``tiny-deepseek2``'s routed blocks
    (3 blocks, one dense, 8 experts of 32, 2 used, sigmoid with the exp_probs_b bias,
    renormalised and scaled by 2.5, one shared expert) under qwen3's attention (four heads of 16,
    as many key/value heads, per-head Q/K norms)."""
    return _preset(Arch.DOTS1, "tiny-dots1", overrides, **_ROUTED, n_head_kv=4)


# Qwen3.5 / Qwen3-Next tiny: 4 blocks (three gated delta-net blocks, then full attention), two
# query heads of 32 over one key/value head, 8 dims rotated (Qwen3.5's partial rotary is 1/4).
_HYBRID: Final[Mapping[str, Any]] = MappingProxyType(
    {"n_layers": 4, "n_head": 2, "n_head_kv": 1, "head_dim": 32, "rope_dim": 8}
)
# ... and its routed experts: 4 of width 32 (2 used) and a gated shared expert of width 64.
_HYBRID_MOE: Final[Mapping[str, Any]] = MappingProxyType(
    {**_HYBRID, "n_expert": 4, "n_expert_used": 2, "n_ff_expert": 32, "shared_expert": True}
)


def tiny_qwen35(**overrides: Any) -> ModelSpec:
    """A qwen35 like Qwen3.5 dense, tiny (n_embd 64, vocab 256): blocks 0-2 gated delta net (2
    key heads, 4 value heads of 16, conv kernel 4), block 3 full attention with its output gate
    (interleaved multimodal RoPE sections [11, 11, 10, 0]), dense SwiGLU."""
    return _preset(Arch.QWEN35, "tiny-qwen35", overrides, **_HYBRID)


def tiny_qwen35moe(**overrides: Any) -> ModelSpec:
    """``tiny-qwen35`` with routed experts (4, 2 used) and a gated shared expert in every
    block, as Qwen3.5-35B-A3B."""
    return _preset(Arch.QWEN35MOE, "tiny-qwen35moe", overrides, **_HYBRID_MOE)


def tiny_qwen3next(**overrides: Any) -> ModelSpec:
    """A qwen3next like Qwen3-Next-80B-A3B, tiny: ``tiny-qwen35moe``'s shapes with the fused
    ``ssm_ba`` projection, interleaved value heads and plain NEOX RoPE."""
    return _preset(Arch.QWEN3NEXT, "tiny-qwen3next", overrides, **_HYBRID_MOE)


def hybrid_wide(**overrides: Any) -> dict[str, Any]:
    """Spec fields that give every quantizable row of the hybrid presets 256 values."""
    wide = {
        "n_embd": 256,
        "n_ff": 256,
        "n_ff_expert": 256,
        "n_ff_shexp": 256,
        "head_dim": 128,
        "rope_dim": 32,
        "ssm_state_size": 64,
    }
    return {**wide, **overrides}


def deepseek2_wide(**overrides: Any) -> dict[str, Any]:
    """Spec fields that give every row of ``tiny_deepseek2`` 256 values (K-quant blocks)."""
    wide = {
        "n_embd": 256,
        "n_ff": 256,
        "n_ff_expert": 256,
        "head_dim": 272,
        "v_head_dim": 256,
        "kv_lora_rank": 256,
        "q_lora_rank": 256,
    }
    return {**wide, **overrides}


def tiny_arch(arch: Arch | str, **overrides: Any) -> ModelSpec:
    """A tiny model of ``arch``: dense, or 4 experts (2 used) for the MoE-only archs (qwen2moe
    with a shared expert). gemma3 gets six blocks (five sliding-window layers, then a global one)
    and a window of 4.
    """
    arch = Arch(arch)
    own = {
        Arch.DEEPSEEK2: tiny_deepseek2,
        Arch.DEEPSEEK32: tiny_deepseek32,
        Arch.GLM_DSA: tiny_glm_dsa,
        Arch.GLM4MOE: tiny_glm4moe,
        Arch.QWEN3MOE: tiny_moe,
        Arch.GPT_OSS: tiny_gpt_oss,
        Arch.QWEN3VLMOE: tiny_qwen3vlmoe,
        Arch.MINIMAX_M2: tiny_minimax_m2,
        Arch.LLAMA4: tiny_llama4,
        Arch.GEMMA4: tiny_gemma4,
        Arch.DOTS1: tiny_dots1,
        Arch.QWEN35: tiny_qwen35,
        Arch.QWEN35MOE: tiny_qwen35moe,
        Arch.QWEN3NEXT: tiny_qwen3next,
    }
    if arch in own:
        return own[arch](**overrides)
    if arch is Arch.QWEN2MOE:
        return tiny_moe(
            **{"arch": arch, "name": "tiny-qwen2moe", "shared_expert": True, **overrides}
        )
    n_layers = 6 if arch is Arch.GEMMA3 else 2
    return _preset(arch, f"tiny-{arch.value}", overrides, n_layers=n_layers)


def demo_moe(**overrides: Any) -> ModelSpec:
    """The demo model: a 4-block qwen3moe, 8 experts (2 used), n_embd 256, vocab 512.

    Rows of 256 elements let every tensor but the norms and routers take any writable type,
    K-quants and IQ4_XS included.
    """
    return _preset(
        Arch.QWEN3MOE,
        "demo-moe",
        overrides,
        n_layers=4,
        n_embd=256,
        n_head=8,
        n_head_kv=4,
        n_ff=512,
        n_vocab=512,
        n_expert=8,
        n_expert_used=2,
        n_ff_expert=256,
        context_length=512,
    )
