"""deepseek2: multi-head latent attention in both file forms, leading dense blocks,
grouped routing, counted shared experts, YaRN.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer does for it: its
refusals, keys and latent attention tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ggufswap.shards.archs._common import f32, routing_metadata, u32
from ggufswap.shards.archs._rules import Experts, ExpertWidth, SharedExpert, WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import GGUFValueType, TypedValue

if TYPE_CHECKING:
    from ggufswap.shards.writer import ModelSpec


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
    if spec.mla_ik:
        errors += ik_errors(spec)
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


IK_SOURCE = "ik_llama.cpp: llm_load_hparams, LLM_ARCH_DEEPSEEK2 (src/llama-hparams.cpp)"
IK_LITE_LAYERS = (26, 27)  # ik's is_lite: no q_lora_rank


def ik_errors(spec: ModelSpec) -> list[str]:
    """What ik_llama.cpp's deepseek2 loader needs of its three-tensor form."""
    errors, why = [], f"({IK_SOURCE})"
    if spec.mla_split:
        errors.append(
            f"mla_ik is ik_llama.cpp's attn_kv_b form with 2-D attn_k_b/attn_v_b beside it: "
            f"it needs mla_split=False {why}"
        )
    if spec.expert_weights_scale == 0 or spec.n_expert == 0:
        errors.append(
            f"mla_ik: ik_llama.cpp requires expert_weights_scale, which the writer writes for "
            f"an MoE model with a scale {why}"
        )
    if spec.q_lora_rank <= 0 and spec.n_layers not in IK_LITE_LAYERS:
        errors.append(
            f"mla_ik: ik_llama.cpp requires q_lora_rank > 0 but in {IK_LITE_LAYERS} blocks {why}"
        )
    return errors


def mla_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """deepseek2's keys, as llama.cpp's converter writes them (conversion/deepseek.py)."""
    a, llm = spec.arch_name, Keys.LLM
    kv = [
        (llm.LEADING_DENSE_BLOCK_COUNT.format(a), u32(spec.n_dense_lead)),
        (llm.Q_LORA_RANK.format(a), u32(spec.q_lora_rank)),
        (llm.KV_LORA_RANK.format(a), u32(spec.kv_lora_rank)),
    ]
    if spec.mla_split:
        kv += [
            (llm.KEY_LENGTH_MLA.format(a), u32(spec.n_embd_head)),
            (llm.VALUE_LENGTH_MLA.format(a), u32(spec.head_v)),
        ]
    kv.append((llm.ROPE_DIMENSION_COUNT.format(a), u32(spec.n_rot)))
    kv += routing_metadata(spec)
    if spec.rope_scaling is not None:
        kv += [
            (llm.ROPE_SCALING_TYPE.format(a), TypedValue(GGUFValueType.STRING, spec.rope_scaling)),
            (llm.ROPE_SCALING_FACTOR.format(a), f32(spec.rope_scaling_factor)),
        ]
    if spec.rope_orig_ctx:
        kv.append((llm.ROPE_SCALING_ORIG_CTX_LEN.format(a), u32(spec.rope_orig_ctx)))
    if spec.yarn_log_mul:
        kv.append((llm.ROPE_SCALING_YARN_LOG_MUL.format(a), f32(spec.yarn_log_mul)))
    return kv


def plan_attention(spec: ModelSpec, add: Any, b: int) -> None:
    """deepseek2's attention tensors of block ``b`` (llama_model_deepseek2::load_arch_tensors)."""
    from ggufswap.shards._roles import Role

    e, h, rank, rot = spec.n_embd, spec.n_head, spec.kv_lora_rank, spec.n_rot
    nope, v = spec.n_embd_head - rot, spec.head_v
    if spec.q_lora_rank > 0:
        add(Role.ATTN_Q_A_NORM, (spec.q_lora_rank,), b)
    add(Role.ATTN_KV_A_NORM, (rank,), b)
    if spec.q_lora_rank > 0:
        add(Role.ATTN_Q_A, (e, spec.q_lora_rank), b)
        add(Role.ATTN_Q_B, (spec.q_lora_rank, h * spec.n_embd_head), b)
    else:
        add(Role.ATTN_Q, (e, h * spec.n_embd_head), b)
    add(Role.ATTN_KV_A_MQA, (e, rank + rot), b)
    if spec.mla_split:
        add(Role.ATTN_K_B, (nope, rank, h), b)
        add(Role.ATTN_V_B, (rank, v, h), b)
    else:
        add(Role.ATTN_KV_B, (rank, h * (nope + v)), b)
    if spec.mla_ik:  # ik_llama.cpp's converter: the same matrices split per head, 2-D
        add(Role.ATTN_K_B, (nope, h * rank), b)
        add(Role.ATTN_V_B, (rank, h * v), b)
    add(Role.ATTN_O, (h * v, e), b)


RULES = rules(
    Arch.DEEPSEEK2,
    "llama_model_deepseek2::load_arch_hparams/load_arch_tensors (src/models/deepseek2.cpp)",
    experts=Experts.AFTER_DENSE_LEAD,
    expert_width=ExpertWidth.EXPERT_KEY,
    shared_expert=SharedExpert.COUNTED,
    mla=True,
    rope_neox=False,
    rope_yarn=True,
    norm_topk=False,
    writer=WriterHooks(errors=mla_errors, metadata=mla_metadata, attention=plan_attention),
    llama_cpp_keys=(
        Keys.LLM.KEY_LENGTH_MLA,
        Keys.LLM.VALUE_LENGTH_MLA,
        Keys.LLM.Q_LORA_RANK,
        Keys.LLM.KV_LORA_RANK,
        Keys.LLM.ATTENTION_TEMPERATURE_LENGTH,
        Keys.LLM.ATTENTION_TEMPERATURE_SCALE,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.EXPERT_GATING_FUNC,
        Keys.LLM.EXPERT_SHARED_COUNT,
        Keys.LLM.EXPERT_WEIGHTS_NORM,
        Keys.LLM.EXPERT_WEIGHTS_SCALE,
        Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
        Keys.LLM.ROPE_SCALING_YARN_LOG_MUL,
    ),
)
