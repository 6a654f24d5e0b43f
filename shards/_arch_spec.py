"""deepseek2's and glm4moe's part of the writer: what llama.cpp accepts of a spec, its keys.

Kept apart from ``shards.writer`` (which calls these for architectures whose ``shards.archs`` row
has ``mla`` or ``glm``); the tensor plan itself stays in ``writer.plan_tensors``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFValueType, Keys

from ggufswap.shards._gguf_encode import TypedValue
from ggufswap.shards.archs import rules_of

if TYPE_CHECKING:
    from ggufswap.shards.writer import ModelSpec


def _u32(v: int) -> TypedValue:
    return TypedValue(GGUFValueType.UINT32, v)


def _f32(v: float) -> TypedValue:
    return TypedValue(GGUFValueType.FLOAT32, v)


def mla_errors(spec: ModelSpec, why: str) -> list[str]:
    """deepseek2's latent attention and routing as llama.cpp's loader and graph accept them."""
    a, errors = spec.arch_name, []
    if spec.kv_lora_rank <= 0 or spec.q_lora_rank < 0:
        errors.append(f"{a} needs kv_lora_rank > 0 and q_lora_rank >= 0 {why}")
    if spec.n_rot % 2 or not 0 < spec.n_rot < spec.n_embd_head or spec.head_v <= 0:
        errors.append(
            f"{a} needs even rope dims below head_dim (non-rope dims >= 1) and v_head_dim > 0: "
            f"rope_dim {spec.n_rot}, head_dim {spec.n_embd_head}, v_head_dim {spec.head_v} {why}"
        )
    if spec.mla_split and spec.n_head_kv != 1:
        errors.append(
            f"{a} with attn_k_b/attn_v_b has one key/value head: n_head_kv must be 1 {why}"
        )
    if not spec.mla_split and spec.n_head_kv != spec.n_head:
        errors.append(f"{a} with attn_kv_b is multi-head: n_head_kv must equal n_head {why}")
    if spec.expert_gating_func not in (0, 1, 2):
        errors.append(f"expert_gating_func must be 0 (unset), 1 (softmax) or 2 (sigmoid) {why}")
    g, used = spec.n_expert_groups, spec.n_group_used
    if g > 1 and not (spec.n_expert % g == 0 and spec.n_expert // g >= 2 and 0 < used < g):
        errors.append(
            f"expert groups: n_expert ({spec.n_expert}) must split into {g} groups of >= 2 and "
            f"0 < n_group_used ({used}) < {g} {why}"
        )
    if spec.n_expert > 0 and spec.n_expert_shared <= 0:
        errors.append(f"{a} needs n_expert_shared > 0 in an MoE model {why}")
    return errors


def glm_errors(spec: ModelSpec, why: str) -> list[str]:
    """glm4moe's blocks as llama.cpp's loader and graph accept them."""
    a, errors = spec.arch_name, []
    if spec.n_expert <= 0:
        errors.append(f"{a} needs n_expert > 0 (llama.cpp asserts it) {why}")
    if spec.n_expert > 0 and not spec.expert_probs_bias:
        errors.append(f"{a} needs expert_probs_bias: exp_probs_b is required in MoE blocks {why}")
    if spec.n_rot % 2 or not 0 < spec.n_rot <= spec.n_embd_head:
        errors.append(f"rope_dim {spec.n_rot} must be even and in (0, head_dim] {why}")
    if spec.shared_expert != (spec.n_expert_shared > 0):
        errors.append(
            f"{a}: shared_expert ({spec.shared_expert}) must match n_expert_shared > 0 "
            f"({spec.n_expert_shared}) {why}"
        )
    if spec.expert_gating_func not in (0, 1, 2):
        errors.append(f"expert_gating_func must be 0 (unset), 1 (softmax) or 2 (sigmoid) {why}")
    return errors


def head_lengths(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """``attention.key_length`` / ``value_length``: the head width, or deepseek2's as its
    converter writes them (attn_k_b/attn_v_b: the latent head, kv_lora_rank + rope dims and
    kv_lora_rank; attn_kv_b: the decompressed heads)."""
    a, att = spec.arch_name, Keys.Attention
    key, value = spec.n_embd_head, spec.n_embd_head
    if rules_of(spec.arch).mla:
        if spec.mla_split:
            key, value = spec.kv_lora_rank + spec.n_rot, spec.kv_lora_rank
        else:
            value = spec.head_v
    return [
        (att.KEY_LENGTH.format(arch=a), _u32(key)),
        (att.VALUE_LENGTH.format(arch=a), _u32(value)),
    ]


def mla_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """deepseek2's keys, as llama.cpp's converter writes them (conversion/deepseek.py)."""
    a, llm, att, rope = spec.arch_name, Keys.LLM, Keys.Attention, Keys.Rope
    kv = [
        (llm.LEADING_DENSE_BLOCK_COUNT.format(arch=a), _u32(spec.n_dense_lead)),
        (att.Q_LORA_RANK.format(arch=a), _u32(spec.q_lora_rank)),
        (att.KV_LORA_RANK.format(arch=a), _u32(spec.kv_lora_rank)),
    ]
    if spec.mla_split:
        kv += [
            (att.KEY_LENGTH_MLA.format(arch=a), _u32(spec.n_embd_head)),
            (att.VALUE_LENGTH_MLA.format(arch=a), _u32(spec.head_v)),
        ]
    kv.append((rope.DIMENSION_COUNT.format(arch=a), _u32(spec.n_rot)))
    kv += _routing_metadata(spec)
    if spec.rope_scaling is not None:
        kv += [
            (rope.SCALING_TYPE.format(arch=a), TypedValue(GGUFValueType.STRING, spec.rope_scaling)),
            (rope.SCALING_FACTOR.format(arch=a), _f32(spec.rope_scaling_factor)),
        ]
    if spec.rope_orig_ctx:
        kv.append((rope.SCALING_ORIG_CTX_LEN.format(arch=a), _u32(spec.rope_orig_ctx)))
    if spec.yarn_log_mul:
        kv.append((rope.SCALING_YARN_LOG_MUL.format(arch=a), _f32(spec.yarn_log_mul)))
    return kv


def glm_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """glm4moe's keys, as llama.cpp's converter writes them (conversion/glm.py)."""
    a, llm = spec.arch_name, Keys.LLM
    kv = [
        (llm.LEADING_DENSE_BLOCK_COUNT.format(arch=a), _u32(spec.n_dense_lead)),
        (Keys.Rope.DIMENSION_COUNT.format(arch=a), _u32(spec.n_rot)),
        *_routing_metadata(spec),
    ]
    if spec.n_nextn:
        kv.append((llm.NEXTN_PREDICT_LAYERS.format(arch=a), _u32(spec.n_nextn)))
    return kv


def _routing_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """The expert keys deepseek2's and glm4moe's loaders read."""
    a, llm, kv = spec.arch_name, Keys.LLM, []
    # Both required by load_arch_hparams, dense models included (the converter writes 0 shared).
    if spec.n_expert == 0:
        kv.append((llm.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), _u32(spec.n_ff_expert)))
    shared = spec.n_expert_shared if spec.n_expert > 0 else 0
    kv.append((llm.EXPERT_SHARED_COUNT.format(arch=a), _u32(shared)))
    if spec.n_expert > 0:
        if spec.expert_weights_scale:
            kv.append((llm.EXPERT_WEIGHTS_SCALE.format(arch=a), _f32(spec.expert_weights_scale)))
        if spec.expert_weights_norm:
            kv.append(
                (llm.EXPERT_WEIGHTS_NORM.format(arch=a), TypedValue(GGUFValueType.BOOL, True))
            )
        if spec.expert_gating_func:
            kv.append((llm.EXPERT_GATING_FUNC.format(arch=a), _u32(spec.expert_gating_func)))
        if spec.n_expert_groups:
            kv += [
                (llm.EXPERT_GROUP_COUNT.format(arch=a), _u32(spec.n_expert_groups)),
                (llm.EXPERT_GROUP_USED_COUNT.format(arch=a), _u32(spec.n_group_used)),
            ]
    return kv
