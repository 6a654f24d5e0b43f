"""deepseek32 (DeepSeek-V3.2): deepseek2's latent attention in its attn_k_b/attn_v_b form with
the DSA lightning indexer in every block.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer does for it: its
refusals, keys and attention tensors. glm-dsa (``shards.archs.glm_dsa``) shares the hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from ggufswap.shards.archs import deepseek2
from ggufswap.shards.archs._common import u32
from ggufswap.shards.archs._rules import Experts, ExpertWidth, SharedExpert, WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import GGUFValueType, TypedValue

if TYPE_CHECKING:
    from ggufswap.shards.writer import ModelSpec

# llama.cpp rotates the indexer's queries and keys by a Walsh-Hadamard matrix whose size is the
# largest power of two (at least 64) dividing the head: only a head of that size fits it.
MIN_INDEXER_HEAD: Final = 64
INDEXER_LLAMA_CPP_KEYS: Final = (
    Keys.LLM.INDEXER_HEAD_COUNT,
    Keys.LLM.INDEXER_KEY_LENGTH,
    Keys.LLM.INDEXER_TOP_K,
)
# What both DSA loaders read of deepseek2's keys (neither reads attention.temperature_*).
MLA_LLAMA_CPP_KEYS: Final = (
    Keys.LLM.KEY_LENGTH_MLA,
    Keys.LLM.VALUE_LENGTH_MLA,
    Keys.LLM.Q_LORA_RANK,
    Keys.LLM.KV_LORA_RANK,
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    Keys.LLM.EXPERT_GATING_FUNC,
    Keys.LLM.EXPERT_SHARED_COUNT,
    Keys.LLM.EXPERT_WEIGHTS_NORM,
    Keys.LLM.EXPERT_WEIGHTS_SCALE,
    Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
)


def is_full(spec: ModelSpec, block: int) -> bool:
    """Whether ``block`` runs its own indexer (glm-dsa's ``indexer_types``; else every block)."""
    types = spec.indexer_types
    return types is None or block >= len(types) or types[block]


def dsa_errors(spec: ModelSpec, why: str) -> list[str]:
    """deepseek2's rules, then what the DSA loaders and graphs refuse or crash on."""
    a, errors = spec.arch_name, deepseek2.mla_errors(spec, why)
    if not spec.mla_split or spec.mla_ik:
        errors.append(f"{a} requires the attn_k_b/attn_v_b form (mla_split=True) {why}")
    if spec.q_lora_rank <= 0:
        errors.append(f"{a} needs q_lora_rank > 0 (attn_q_a is required) {why}")
    d = spec.indexer_head_dim
    if d < MIN_INDEXER_HEAD or d & (d - 1):
        errors.append(
            f"indexer_head_dim {d} must be a power of 2 >= {MIN_INDEXER_HEAD}: llama.cpp rotates "
            f"the indexer keys by a Hadamard matrix of that size {why}"
        )
    if spec.n_rot > d:
        errors.append(f"rope_dim {spec.n_rot} must not exceed indexer_head_dim {d} {why}")
    if spec.indexer_heads <= 0 or spec.indexer_top_k <= 0:
        errors.append(f"indexer_heads and indexer_top_k must be > 0 {why}")
    if spec.arch is Arch.DEEPSEEK32 and spec.expert_gating_func not in (1, 2):
        errors.append(f"{a} needs expert_gating_func 1 (softmax) or 2 (sigmoid): required {why}")
    types = spec.indexer_types
    if types is not None and spec.arch is not Arch.GLM_DSA:
        errors.append(f"indexer_types (shared indexer blocks) are glm-dsa's {why}")
    if types is not None and (len(types) != spec.n_layers or not types[0]):
        errors.append(
            f"indexer_types needs one flag per block ({spec.n_layers}), the first True (a "
            f"shared block reuses an earlier full block's top-k) {why}"
        )
    return errors


def dsa_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """deepseek2's keys and the indexer's, as llama.cpp's converter writes them
    (conversion/deepseek.py DeepseekV32Model, conversion/glm.py GlmMoeDsaModel)."""
    a, k = spec.arch_name, Keys.LLM
    kv = deepseek2.mla_metadata(spec)
    if spec.n_expert == 0 and spec.expert_gating_func:  # routing_metadata writes it with experts
        kv.append((k.EXPERT_GATING_FUNC.format(a), u32(spec.expert_gating_func)))
    kv += [
        (k.INDEXER_HEAD_COUNT.format(a), u32(spec.indexer_heads)),
        (k.INDEXER_KEY_LENGTH.format(a), u32(spec.indexer_head_dim)),
        (k.INDEXER_TOP_K.format(a), u32(spec.indexer_top_k)),
    ]
    if spec.indexer_types is not None:
        flags = [bool(f) for f in spec.indexer_types]
        kv.append(
            (
                k.INDEXER_TYPES.format(a),
                TypedValue(GGUFValueType.ARRAY, flags, GGUFValueType.BOOL),
            )
        )
    return kv


def plan_attention(spec: ModelSpec, add: Any, b: int) -> None:
    """deepseek2's attention tensors of block ``b``, then its indexer's
    (llama_model_deepseek32::load_arch_tensors)."""
    from ggufswap.shards._roles import Role

    deepseek2.plan_attention(spec, add, b)
    if not is_full(spec, b):
        return
    e, heads, d = spec.n_embd, spec.indexer_heads, spec.indexer_head_dim
    add(Role.INDEXER_K_NORM, (d,), b)
    add(Role.INDEXER_K_NORM_BIAS, (d,), b)
    add(Role.INDEXER_PROJ, (e, heads), b)
    add(Role.INDEXER_ATTN_K, (e, d), b)
    add(Role.INDEXER_ATTN_Q_B, (spec.q_lora_rank, heads * d), b)


WRITER: Final = WriterHooks(errors=dsa_errors, metadata=dsa_metadata, attention=plan_attention)

RULES = rules(
    Arch.DEEPSEEK32,
    "llama_model_deepseek32::load_arch_hparams/load_arch_tensors (src/models/deepseek32.cpp)",
    experts=Experts.AFTER_DENSE_LEAD,
    expert_width=ExpertWidth.EXPERT_KEY,
    shared_expert=SharedExpert.COUNTED,
    mla=True,
    dsa=True,
    rope_neox=False,
    rope_yarn=True,
    norm_topk=False,
    writer=WRITER,
    llama_cpp_keys=(
        *MLA_LLAMA_CPP_KEYS,
        Keys.LLM.ROPE_SCALING_YARN_LOG_MUL,
        *INDEXER_LLAMA_CPP_KEYS,
    ),
)
