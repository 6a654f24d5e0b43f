"""deepseek2's and glm4moe's hyper-parameters, read as their ``load_arch_hparams`` read them.

``hparams.HParams.from_metadata`` calls these for the architectures whose ``shards.archs`` row
has ``mla`` (deepseek2: latent attention, YaRN) or ``experts = AFTER_DENSE_LEAD`` (both: leading
dense blocks, shared experts, routing); ``HParams.__post_init__`` checks what their loaders and
graphs refuse.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ggufswap.shards.archs import SharedExpert, rules_of
from ggufswap.shards.keys import Keys

if TYPE_CHECKING:
    from ggufswap.runtime.models.hparams import HParams, _KeyReader


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

    @property
    def nope(self) -> int:
        return self.head_k - self.n_rot


# deepseek2's "lite" files (DeepSeek-V2-Lite, GigaChat3, Kanana-2) may omit q_lora_rank: these
# block counts (and 48 with a 128256-token vocabulary), as load_arch_hparams decides.
DEEPSEEK2_LITE_LAYERS: Final = (26, 27)
# No expert_gating_func: softmax (DeepSeek V2/V2.5), but sigmoid for GLM 4.7 Lite (47 or 48
# blocks, 154880 tokens).
DEEPSEEK2_SIGMOID_LAYERS: Final = (47, 48)
DEEPSEEK2_SIGMOID_VOCAB: Final = 154880


def deepseek2_kwargs(
    reader: _KeyReader,
    common: Mapping[str, Any],
    *,
    key_length: int,
    value_length: int,
    n_rot: int,
    yarn: bool,
) -> dict[str, Any]:
    """llama_model_deepseek2::load_arch_hparams, the YaRN parameters llama_context derives from
    them, and the graph's attention scale (src/models/deepseek2.cpp)."""
    k = Keys.LLM
    n_layer = common["n_layer"] - reader.get_int(k.NEXTN_PREDICT_LAYERS, 0)
    n_vocab = common["n_vocab"]
    lite = n_layer in DEEPSEEK2_LITE_LAYERS or (n_layer == 48 and n_vocab == 128256)
    k_mla = reader.get_int(k.KEY_LENGTH_MLA, 0)
    v_mla = reader.get_int(k.VALUE_LENGTH_MLA, 0)
    if (k_mla == 0) != (v_mla == 0):
        reader.problems.append(
            f"{k.KEY_LENGTH_MLA.format(reader.arch)} ({k_mla}) and "
            f"{k.VALUE_LENGTH_MLA.format(reader.arch)} ({v_mla}) must be both set or both absent"
        )
    split = k_mla != 0 and v_mla != 0
    mla = MLAShape(
        q_lora_rank=reader.get_int(k.Q_LORA_RANK, 0) if lite else reader.get_int(k.Q_LORA_RANK),
        kv_lora_rank=reader.get_int(k.KV_LORA_RANK),
        head_k=k_mla if split else key_length,
        head_v=v_mla if split else value_length,
        n_rot=n_rot,
        split=split,
    )
    sigmoid = n_layer in DEEPSEEK2_SIGMOID_LAYERS and n_vocab == DEEPSEEK2_SIGMOID_VOCAB
    out = _routing_kwargs(reader, default_gating=Gating.SIGMOID if sigmoid else Gating.SOFTMAX)
    out["mla"] = mla
    out.update(_yarn(reader, common, head_k=mla.head_k, yarn=yarn))
    return out


def _routing_kwargs(reader: _KeyReader, *, default_gating: Gating) -> dict[str, Any]:
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


def glm4moe_kwargs(reader: _KeyReader) -> dict[str, Any]:
    """llama_model_glm4_moe::load_arch_hparams: sigmoid gating unless the file says otherwise;
    multimodal RoPE sections (GLM-4.5V) are not implemented."""
    sections = reader.md.get(Keys.LLM.ROPE_DIMENSION_SECTIONS.format(reader.arch))
    if sections is not None and any(sections):
        reader.problems.append(
            f"{Keys.LLM.ROPE_DIMENSION_SECTIONS.format(reader.arch)} = {list(sections)}: "
            "multimodal RoPE is not implemented by the reference decoder"
        )
    return _routing_kwargs(reader, default_gating=Gating.SIGMOID)


def _yarn(
    reader: _KeyReader, common: Mapping[str, Any], *, head_k: int, yarn: bool
) -> dict[str, Any]:
    """llama_context's YaRN parameters (ext_factor 1 for ``yarn`` scaling, attn_factor with its
    mscale adjustments) and deepseek2's kq scale ``mscale^2 / sqrt(head_k)``, which undoes the
    adjustment and applies ``rope.scaling.yarn_log_multiplier`` (stored x0.1 by the converter)."""
    k = Keys.LLM
    freq_scale = common["rope_freq_scale"]  # 1 for scaling type none (hparams._rope_freq_scale)
    log_mul = reader.get_float(k.ROPE_SCALING_YARN_LOG_MUL, 0.0) / 0.1
    ext_factor = 1.0 if yarn else 0.0
    attn_factor = 1.0
    factor = 1.0 / freq_scale
    if ext_factor != 0.0:

        def get_mscale(scale: float, mscale: float) -> float:
            return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0

        # With a log multiplier, deepseek2 takes mscale = mscale_all_dims, so the ratio
        # get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dims) is 1.
        attn_factor = 1.0 if log_mul != 0.0 else get_mscale(factor, 1.0)
        attn_factor *= 1.0 / (1.0 + 0.1 * math.log(factor))
    attn_factor *= reader.get_float(k.ROPE_SCALING_ATTN_FACTOR, 1.0)
    attn_factor_org = attn_factor * (1.0 + 0.1 * math.log(factor))
    mscale = attn_factor_org * (1.0 + 0.1 * log_mul * math.log(factor))
    return {
        "rope_ext_factor": ext_factor,
        "rope_attn_factor": attn_factor,
        "rope_ctx_orig": reader.get_int(k.ROPE_SCALING_ORIG_CTX_LEN, common["context_length"]),
        "attention_scale": mscale * mscale / math.sqrt(head_k),
    }


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
