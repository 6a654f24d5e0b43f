"""The shape of an architecture's torch-free spec: ``ArchRules`` (what llama.cpp's loader and
graph do for it) and ``WriterHooks`` (what the writer does for it beyond the shared plan).

The facts are those of llama.cpp as llama-cpp-python 0.3.36 vendors it:
``llama_model_base::load_hparams`` (``src/llama-model.cpp``, the keys every architecture shares)
and each architecture's ``load_arch_hparams`` / ``load_arch_tensors`` (``src/models/<arch>.cpp``),
named in ``ArchRules.source``. ``docs/models.md`` has the same rules as a table.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from ggufswap.shards.keys import Arch, Keys

if TYPE_CHECKING:
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards.value_types import TypedValue
    from ggufswap.shards.writer import ModelSpec


class Experts(enum.Enum):
    """Which blocks an architecture's loader gives routed experts."""

    NONE = "none"  # dense: the loader creates no expert tensors
    ALL_OR_NONE = "all-or-none"  # dense when expert_count = 0, else MoE in every block
    ALL = "all"  # MoE in every block; expert_count > 0 required
    # deepseek2: blocks [0, leading_dense_block_count) are dense, the others MoE.
    AFTER_DENSE_LEAD = "after leading_dense_block_count"


class ExpertWidth(enum.Enum):
    """The key that sizes the routed experts' FFN (``n_ff_exp``)."""

    # llama (Mixtral): expert tensors are {n_embd, n_ff, n_expert} with n_ff from
    # {arch}.feed_forward_length; expert_feed_forward_length is never read.
    FEED_FORWARD_LENGTH = "feed_forward_length"
    # qwen2moe / qwen3moe: {arch}.expert_feed_forward_length, else
    # feed_forward_length / expert_used_count ("n_ff_exp() ? n_ff_exp() : n_ff / n_expert_used").
    EXPERT_KEY_OR_SPLIT = "expert_feed_forward_length, else feed_forward_length / expert_used_count"
    # deepseek2: {arch}.expert_feed_forward_length, required (load_arch_hparams).
    EXPERT_KEY = "expert_feed_forward_length (required)"


class SharedExpert(enum.Enum):
    """Whether the loader creates shared-expert tensors."""

    # None: a file that has ffn_*_shexp tensors is refused ("wrong number of tensors").
    NONE = "none"
    # In every block: ffn_{gate,up,down}_shexp and the sigmoid gate ffn_gate_inp_shexp, of width
    # {arch}.expert_shared_feed_forward_length, else feed_forward_length.
    REQUIRED = "required"
    # deepseek2: {arch}.expert_shared_count (required) shared experts, ungated, fused into
    # ffn_{gate,up,down}_shexp of width expert_feed_forward_length * expert_shared_count, in
    # every MoE block.
    COUNTED = "expert_shared_count"
    # glm4moe: as COUNTED, but expert_shared_count 0 means no shared-expert tensors.
    COUNTED_OPTIONAL = "expert_shared_count (0: none)"
    # llama4: one ungated shared expert of the routed experts' width in every MoE block.
    EXPERT_WIDTH = "ungated, expert_feed_forward_length wide"


# The keys llama_model_base::load_hparams reads for every architecture that change what a model
# computes (context length, names, pooling and the like do not). An architecture's own are its
# ArchRules.llama_cpp_keys. A file holding one that the runtime's module does not read is
# refused by name (HParams.from_metadata), unless its value is llama.cpp's no-op default below.
SHARED_LLAMA_CPP_KEYS: Final = (
    Keys.LLM.EMBEDDING_LENGTH,
    Keys.LLM.BLOCK_COUNT,
    Keys.LLM.FEED_FORWARD_LENGTH,
    Keys.LLM.HEAD_COUNT,
    Keys.LLM.HEAD_COUNT_KV,
    Keys.LLM.KEY_LENGTH,
    Keys.LLM.VALUE_LENGTH,
    Keys.LLM.RMS_EPS,
    Keys.LLM.EXPERT_COUNT,
    Keys.LLM.EXPERT_USED_COUNT,
    Keys.LLM.EXPERT_GROUP_COUNT,
    Keys.LLM.EXPERT_GROUP_USED_COUNT,
    Keys.LLM.NEXTN_PREDICT_LAYERS,
    Keys.LLM.ROPE_FREQ_BASE,
    Keys.LLM.ROPE_DIMENSION_COUNT,
    Keys.LLM.ROPE_SCALING_TYPE,
    Keys.LLM.ROPE_SCALING_FACTOR,
    Keys.LLM.ROPE_SCALE_LINEAR,
    Keys.LLM.ROPE_SCALING_ATTN_FACTOR,
    Keys.LLM.ROPE_SCALING_ALPHA,
    Keys.LLM.ATTENTION_CAUSAL,
    Keys.LLM.KEY_LENGTH_SWA,
    Keys.LLM.VALUE_LENGTH_SWA,
    Keys.LLM.ROPE_DIMENSION_COUNT_SWA,
)
# Values with which a key changes nothing (llama.cpp's defaults).
NEUTRAL_VALUES: Final[Mapping[str, tuple[object, ...]]] = MappingProxyType(
    {
        Keys.LLM.ATTENTION_CAUSAL: (True, 1),
        Keys.LLM.EXPERT_GROUP_COUNT: (0, 1),
        Keys.LLM.EXPERT_GROUP_USED_COUNT: (0, 1),
        Keys.LLM.NEXTN_PREDICT_LAYERS: (0,),
        Keys.LLM.ROPE_SCALING_ATTN_FACTOR: (1.0,),
        Keys.LLM.ROPE_SCALING_ALPHA: (0.0, 1.0),
    }
)


def _no_errors(spec: ModelSpec, why: str) -> list[str]:
    return []


def _no_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    return []


@dataclass(frozen=True, kw_only=True)
class WriterHooks:
    """What the writer does for one architecture beyond the plan every architecture shares
    (``shards._arch_spec.plan``): the spec combinations its loader refuses (``errors(spec,
    why)``, ``why`` naming the loader), its own metadata keys, its attention tensors of a block
    (``attention(spec, add, block)``, ``add(role, ne, block)``: None = Q/K/V/O), or a whole block
    of its own (``block(spec, block)``: None = the shared block)."""

    errors: Callable[[ModelSpec, str], list[str]] = _no_errors
    metadata: Callable[[ModelSpec], list[tuple[str, TypedValue]]] = _no_metadata
    attention: Callable[[ModelSpec, Any, int], None] | None = None
    block: Callable[[ModelSpec, int], list[PlannedTensor]] | None = None
    # rope_freqs.weight's values when the architecture writes its own (gemma4), else llama 3.1's
    rope_factors: Callable[[ModelSpec], list[float]] | None = None


@dataclass(frozen=True, kw_only=True)
class ArchRules:
    """What one architecture's loader reads and requires (see the module docstring)."""

    arch: Arch
    experts: Experts
    expert_width: ExpertWidth | None  # None for dense-only architectures
    shared_expert: SharedExpert
    tied_output: bool  # output.weight may be absent: the head then reads token_embd.weight
    qk_norm: bool  # attn_q_norm / attn_k_norm required in every block
    # The loader creates an optional rope_freqs tensor ({n_rot/2} RoPE frequency factors, llama
    # 3.1+ scaling); elsewhere a file holding one is refused (wrong number of tensors).
    rope_freqs: bool = False
    # gpt-oss: attention sinks, alternating sliding-window layers, biased attention, router and
    # experts, clamped SwiGLU (swiglu_oai), softmax over the top-k router logits, YaRN RoPE.
    gpt_oss: bool = False
    post_norms: bool  # post_attention_norm / post_ffw_norm required (gemma3)
    # attn_q is {n_embd, n_embd_head_k * n_head}; False where the loader sizes it {n_embd, n_embd}
    # (qwen2, qwen2moe), so key_length must be n_embd / n_head.
    free_head_dim: bool
    # llama's load_hparams: "invalid n_rot" unless rope.dimension_count equals the head width.
    rope_dims_equal_head: bool
    source: str
    # deepseek2: multi-head latent attention (attn_kv_a_mqa, attn_kv_b or attn_k_b/attn_v_b,
    # optional attn_q_a/attn_q_b), the expert_gating_func / expert_weights_* / expert_group_*
    # keys, the optional exp_probs_b selection bias, and YaRN RoPE scaling.
    mla: bool = False
    # deepseek32 / glm-dsa: the DSA lightning indexer (indexer.* tensors, attention.indexer.*
    # keys) beside deepseek2's latent attention in its attn_k_b/attn_v_b form.
    dsa: bool = False
    # glm4moe: the FFN's pre-norm is attn_post_norm (no ffn_norm); every MoE block has
    # exp_probs_b; q/k/v biases and per-head q/k norms are optional (TENSOR_NOT_REQUIRED);
    # nextn_predict_layers trailing blocks are NextN/MTP blocks (loaded, never run).
    glm: bool = False
    # llama_model_rope_type: NEOX (halves) or NORM (adjacent pairs: llama, deepseek2).
    rope_neox: bool = True
    # rope.scaling.type "yarn" is implemented (deepseek2, gpt-oss); elsewhere it is refused.
    rope_yarn: bool = False
    # build_moe_ffn's norm_w in the graph: the top-k weights renormalised (llama, qwen3moe) or
    # not (qwen2moe, gpt-oss); deepseek2 and glm4moe read expert_weights_norm (default false).
    norm_topk: bool = True
    # gemma: GeGLU (tanh GELU) FFNs and token embeddings scaled by sqrt(n_embd).
    ffn_gelu: bool = False
    embd_scaled: bool = False
    # Qwen3.5 / Qwen3-Next: gated delta-net blocks beside full attention (whole blocks of their
    # own in the writer), interleaved multimodal RoPE sections (qwen35, qwen35moe: required).
    hybrid: bool = False
    rope_sections: bool = False
    # The keys of its own llama.cpp's load_arch_hparams reads that change what the model
    # computes (besides SHARED_LLAMA_CPP_KEYS).
    llama_cpp_keys: tuple[str, ...] = ()
    # Keys whose per-layer arrays of different values the architecture's module reads itself
    # (gemma4's head_count_kv); elsewhere such an array is refused.
    per_layer_keys: tuple[str, ...] = ()
    writer: WriterHooks = field(default_factory=WriterHooks, compare=False)

    @property
    def has_experts(self) -> bool:
        return self.experts is not Experts.NONE


def rules(
    arch: Arch,
    source: str,
    *,
    experts: Experts = Experts.NONE,
    expert_width: ExpertWidth | None = None,
    shared_expert: SharedExpert = SharedExpert.NONE,
    tied_output: bool = True,
    qk_norm: bool = False,
    rope_freqs: bool = False,
    gpt_oss: bool = False,
    post_norms: bool = False,
    free_head_dim: bool = True,
    rope_dims_equal_head: bool = False,
    mla: bool = False,
    dsa: bool = False,
    glm: bool = False,
    rope_neox: bool = True,
    rope_yarn: bool = False,
    norm_topk: bool = True,
    gemma: bool = False,
    hybrid: bool = False,
    rope_sections: bool = False,
    writer: WriterHooks | None = None,
    llama_cpp_keys: tuple[str, ...] = (),
    per_layer_keys: tuple[str, ...] = (),
) -> ArchRules:
    """An architecture's rules: every flag off unless named (see ``ArchRules``)."""
    return ArchRules(
        arch=arch,
        experts=experts,
        expert_width=expert_width,
        shared_expert=shared_expert,
        tied_output=tied_output,
        qk_norm=qk_norm,
        rope_freqs=rope_freqs,
        gpt_oss=gpt_oss,
        post_norms=post_norms,
        free_head_dim=free_head_dim,
        rope_dims_equal_head=rope_dims_equal_head,
        source=source,
        mla=mla,
        dsa=dsa,
        glm=glm,
        rope_neox=rope_neox,
        rope_yarn=rope_yarn,
        norm_topk=norm_topk,
        ffn_gelu=gemma,
        embd_scaled=gemma,
        hybrid=hybrid,
        rope_sections=rope_sections,
        writer=writer or WriterHooks(),
        llama_cpp_keys=llama_cpp_keys,
        per_layer_keys=per_layer_keys,
    )
