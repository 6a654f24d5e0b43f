"""The MoE and latent-attention hyper-parameters several architectures share.

The routing keys (``routing_kwargs``: deepseek2, glm4moe), the qwen MoE expert widths
(``qwen_moe_kwargs``: qwen2moe, qwen3moe), multi-head latent attention's shape (``MLAShape``),
and what llama.cpp's loaders refuse of them (``lead_problems``, ``deepseek2_problems``, called by
``HParams.__post_init__``). Each architecture's module calls the readers it needs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ggufswap.shards.archs import ExpertWidth, SharedExpert, rules_of
from ggufswap.shards.keys import Keys

if TYPE_CHECKING:
    from ggufswap.runtime.models.hparams import HParams, KeyReader


class Gating(enum.IntEnum):
    """How router logits become expert probabilities (llama.cpp's ``expert_gating_func``)."""

    SOFTMAX = 1
    SIGMOID = 2


@dataclass(frozen=True)
class MLAShape:
    """deepseek2's multi-head latent attention (llama_model_deepseek2::load_arch_tensors).

    ``split``: the file holds ``attn_k_b`` / ``attn_v_b`` (llama.cpp's converter today; the keys
    ``attention.key_length_mla`` / ``value_length_mla`` are set) rather than the older
    ``attn_kv_b``. ``q_lora_rank`` 0: ``attn_q`` instead of ``attn_q_a`` / ``attn_q_b``.
    """

    q_lora_rank: int
    kv_lora_rank: int
    head_k: int  # nope + rope dims of a query/key head (n_embd_head_k_mla)
    head_v: int  # value head width (n_embd_head_v_mla)
    n_rot: int  # the decoupled rope dims at the end of each query head
    split: bool
    # ik_llama.cpp's attention scale and RoPE magnitude factor for this file (its deepseek2
    # graph's mscale = attn_factor * (1 + log_mul * ln(1 / freq_scale)), the converter's log_mul
    # as stored, and 1 / (1 + 0.1 ln(1 / freq_scale))): what its three-tensor form runs with.
    ik_scales: tuple[float, float] = (0.0, 1.0)

    @property
    def nope(self) -> int:
        return self.head_k - self.n_rot


@dataclass(frozen=True)
class DSAShape:
    """The DSA lightning indexer of deepseek32 / glm-dsa (``attention.indexer.*``;
    ``blocks.indexer``).

    ``full_layers[i]``: block ``i`` runs its own indexer; glm-dsa's "shared" blocks (False) reuse
    the top-k of the last block that did. ``rope_neox``: the indexer's RoPE pairs (deepseek32
    NEOX, glm-dsa NORM). ``norm_eps``: the indexer key norm's epsilon (llama.cpp's
    ``f_norm_eps``: 1e-6 for deepseek32, never set, so 0, for glm-dsa).
    """

    n_head: int
    head_dim: int
    top_k: int
    full_layers: tuple[bool, ...]
    rope_neox: bool
    norm_eps: float

    def problems(self, *, n_rot: int) -> list[str]:
        """What llama.cpp's DSA graphs assert of the indexer."""
        out = []
        if min(self.n_head, self.head_dim, self.top_k) <= 0:
            out.append(
                f"attention.indexer.head_count / key_length / top_k must be > 0, found "
                f"{self.n_head} / {self.head_dim} / {self.top_k}"
            )
        if n_rot > self.head_dim:
            out.append(
                f"rope.dimension_count {n_rot} exceeds attention.indexer.key_length "
                f"{self.head_dim} (llama.cpp: GGML_ASSERT(n_rot <= n_embd_indexer_head))"
            )
        if self.full_layers and not self.full_layers[0]:
            out.append(
                "attention.indexer.types: block 0 must run its own indexer (a shared block "
                "reuses the top-k of an earlier full one)"
            )
        return out


# The keys routing_kwargs reads.
ROUTING_KEYS: Final = (
    Keys.LLM.NEXTN_PREDICT_LAYERS,
    Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    Keys.LLM.EXPERT_SHARED_COUNT,
    Keys.LLM.EXPERT_WEIGHTS_NORM,
    Keys.LLM.EXPERT_WEIGHTS_SCALE,
    Keys.LLM.EXPERT_GATING_FUNC,
    Keys.LLM.EXPERT_GROUP_COUNT,
    Keys.LLM.EXPERT_GROUP_USED_COUNT,
)


def routing_kwargs(reader: KeyReader, *, default_gating: Gating) -> dict[str, Any]:
    """The keys deepseek2's and glm4moe's load_arch_hparams read for their blocks and routing
    (expert_feed_forward_length and expert_shared_count required; expert_gating_func absent or 0:
    ``default_gating``)."""
    k = Keys.LLM
    gating = reader.get_int(k.EXPERT_GATING_FUNC, 0) or int(default_gating)
    if gating not in tuple(Gating):
        reader.problems.append(
            f"{k.EXPERT_GATING_FUNC.format(reader.arch)} = {gating}: the reference decoder "
            "implements softmax (1) and sigmoid (2)"
        )
        gating = Gating.SOFTMAX
    scale = reader.get_float(k.EXPERT_WEIGHTS_SCALE, 0.0)
    return {
        "n_layer_nextn": reader.get_int(k.NEXTN_PREDICT_LAYERS, 0),
        "n_layer_dense_lead": reader.get_int(k.LEADING_DENSE_BLOCK_COUNT, 0),
        "n_ff_exp": reader.get_int(k.EXPERT_FEED_FORWARD_LENGTH),
        "n_expert_shared": reader.get_int(k.EXPERT_SHARED_COUNT),
        "expert_weights_norm": bool(reader.md.get(k.EXPERT_WEIGHTS_NORM.format(reader.arch), 0)),
        "expert_weights_scale": scale if scale != 0.0 else 1.0,  # 0: no scaling (build_moe_ffn)
        "gating": Gating(gating),
        "n_expert_groups": reader.get_int(k.EXPERT_GROUP_COUNT, 0),
        "n_group_used": reader.get_int(k.EXPERT_GROUP_USED_COUNT, 0),
    }


# The keys qwen_moe_kwargs reads.
QWEN_MOE_KEYS: Final = (
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH,
)


def qwen_moe_kwargs(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """The qwen MoE loaders' expert widths: ``expert_feed_forward_length`` (0 when absent: then
    ``feed_forward_length / expert_used_count``), and where the architecture has a gated shared
    expert, ``expert_shared_feed_forward_length`` (0: ``feed_forward_length``)."""
    rules, out = rules_of(reader.arch), {}
    if common["n_expert"] > 0 and rules.expert_width is ExpertWidth.EXPERT_KEY_OR_SPLIT:
        out["n_ff_exp"] = reader.get_int(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0)
    if common["n_expert"] > 0 and rules.shared_expert is SharedExpert.REQUIRED:
        out["n_ff_shexp"] = reader.get_int(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)
    return out


def lead_problems(config: HParams, *, is_moe: bool) -> list[str]:
    """What the deepseek2 / glm4moe loaders refuse of their blocks and routing."""
    a, problems = config.arch.value, []
    n_trunk = config.n_layer - config.n_layer_nextn
    if not 0 <= config.n_layer_nextn < config.n_layer:
        problems.append(
            f"{a}: nextn_predict_layers {config.n_layer_nextn} must be below block_count "
            f"{config.n_layer}"
        )
    if config.n_layer_dense_lead > 0 and config.n_ff <= 0:
        problems.append(f"{a}: leading dense blocks need feed_forward_length > 0")
    if config.n_layer_dense_lead < n_trunk and not is_moe:
        problems.append(
            f"{a}: blocks {config.n_layer_dense_lead}..{n_trunk - 1} are MoE "
            "(leading_dense_block_count) but expert_count is 0 (llama.cpp: n_expert must be > 0)"
        )
    counted = rules_of(config.arch).shared_expert is SharedExpert.COUNTED
    if is_moe and counted and config.n_expert_shared <= 0:
        problems.append(
            f"{a}: expert_shared_count must be > 0: llama.cpp creates ffn_*_shexp tensors of "
            f"width expert_feed_forward_length * expert_shared_count in every MoE block"
        )
    groups, used = config.n_expert_groups, config.n_group_used
    if groups > 1 and not (config.n_expert % groups == 0 and 0 < used < groups < config.n_expert):
        problems.append(
            f"{a}: expert_group_count {groups} / expert_group_used_count {used}: llama.cpp needs "
            f"expert_count ({config.n_expert}) divisible by the groups and 0 < used < groups"
        )
    if groups > 1 and (config.n_expert // groups) < 2:
        problems.append(f"{a}: group-limited routing needs at least 2 experts per group")
    return problems


def deepseek2_problems(config: HParams, *, head_dim: int) -> list[str]:
    """What llama.cpp's deepseek2 loader or graph would refuse of its latent attention."""
    a, mla, problems = config.arch.value, config.mla, []
    if mla is None:
        return [f"{a}: the latent attention's shape (MLAShape) is missing"]
    if mla.nope < 1:
        problems.append(
            f"{a}: key head {mla.head_k} leaves no non-rope dims beside rope.dimension_count "
            f"{mla.n_rot} (llama.cpp asserts n_embd_head_qk_nope >= 1)"
        )
    if mla.kv_lora_rank <= 0:
        problems.append(f"{a}: attention.kv_lora_rank must be > 0, found {mla.kv_lora_rank}")
    if mla.split and config.n_head_kv != 1:
        problems.append(
            f"{a}: attention.head_count_kv must be 1 with attn_k_b/attn_v_b (latent attention is "
            f"one shared key/value head), found {config.n_head_kv}"
        )
    if mla.split and head_dim != mla.kv_lora_rank + mla.n_rot:
        problems.append(
            f"{a}: attention.key_length must be kv_lora_rank + rope dims "
            f"({mla.kv_lora_rank} + {mla.n_rot}) with attn_k_b/attn_v_b, found {head_dim}"
        )
    if not mla.split and config.n_head_kv != config.n_head:
        problems.append(
            f"{a}: attention.head_count_kv must equal head_count ({config.n_head}) with "
            f"attn_kv_b (decompressed multi-head attention), found {config.n_head_kv}"
        )
    return problems


def dsa_problems(config: HParams) -> list[str]:
    """What llama.cpp's deepseek32 / glm-dsa loaders and graphs refuse beyond deepseek2's: the
    absorbed form only (``DEEPSEEK32 architecture requires MLA``), q_lora (``attn_q_a`` is
    created unconditionally) and the indexer's shape."""
    a, mla, dsa = config.arch.value, config.mla, config.dsa
    if mla is None or dsa is None:
        return [f"{a}: the latent attention's and the indexer's shapes are missing"]
    problems = []
    if not mla.split:
        problems.append(
            f"{a}: attention.key_length_mla / value_length_mla are required (llama.cpp: "
            f"the architecture requires MLA, the attn_k_b/attn_v_b form)"
        )
    if mla.q_lora_rank <= 0:
        problems.append(f"{a}: attention.q_lora_rank must be > 0, found {mla.q_lora_rank}")
    n_trunk = config.n_layer - config.n_layer_nextn
    if len(dsa.full_layers) != n_trunk:
        problems.append(
            f"{a}: the indexer pattern has {len(dsa.full_layers)} entries for {n_trunk} blocks"
        )
    return problems + [f"{a}: {p}" for p in dsa.problems(n_rot=mla.n_rot)]
