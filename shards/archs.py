"""What llama.cpp's loader requires of a file, per ``general.architecture``.

One table, read by the writer (which refuses a spec llama.cpp would refuse) and by the reference
decoder's config (which reads every hyper-parameter with llama.cpp's rule). The facts are those of
llama.cpp as llama-cpp-python 0.3.36 vendors it: ``llama_model_base::load_hparams``
(``src/llama-model.cpp``, the keys every architecture shares) and each architecture's
``load_arch_hparams`` / ``load_arch_tensors`` (``src/models/<arch>.cpp``), named in
``ArchRules.source``. ``docs/models.md`` has the same rules as a table.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from ggufswap.shards.keys import Arch


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
    # glm4moe: the FFN's pre-norm is attn_post_norm (no ffn_norm); every MoE block has
    # exp_probs_b; q/k/v biases and per-head q/k norms are optional (TENSOR_NOT_REQUIRED);
    # nextn_predict_layers trailing blocks are NextN/MTP blocks (loaded, never run).
    glm: bool = False

    @property
    def has_experts(self) -> bool:
        return self.experts is not Experts.NONE


def _rules(
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
    glm: bool = False,
) -> ArchRules:
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
        glm=glm,
    )


ARCH_RULES: Final[Mapping[Arch, ArchRules]] = MappingProxyType(
    {
        Arch.LLAMA: _rules(
            Arch.LLAMA,
            "llama_model_llama::load_arch_hparams/load_arch_tensors (src/models/llama.cpp); "
            "n_rot check in llama_model_base::load_hparams",
            experts=Experts.ALL_OR_NONE,
            expert_width=ExpertWidth.FEED_FORWARD_LENGTH,
            rope_dims_equal_head=True,
            rope_freqs=True,
        ),
        Arch.QWEN2: _rules(
            Arch.QWEN2,
            "llama_model_qwen2::load_arch_tensors (src/models/qwen2.cpp)",
            free_head_dim=False,
        ),
        Arch.QWEN2MOE: _rules(
            Arch.QWEN2MOE,
            "llama_model_qwen2moe::load_arch_hparams/load_arch_tensors (src/models/qwen2moe.cpp)",
            experts=Experts.ALL,
            expert_width=ExpertWidth.EXPERT_KEY_OR_SPLIT,
            shared_expert=SharedExpert.REQUIRED,
            tied_output=False,
            free_head_dim=False,
        ),
        Arch.QWEN3: _rules(
            Arch.QWEN3,
            "llama_model_qwen3::load_arch_tensors (src/models/qwen3.cpp)",
            qk_norm=True,
        ),
        Arch.QWEN3MOE: _rules(
            Arch.QWEN3MOE,
            "llama_model_qwen3moe::load_arch_hparams/load_arch_tensors (src/models/qwen3moe.cpp)",
            experts=Experts.ALL,
            expert_width=ExpertWidth.EXPERT_KEY_OR_SPLIT,
            qk_norm=True,
        ),
        # gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE): experts in every block, sized by the
        # required expert_feed_forward_length; output.weight required.
        Arch.GPT_OSS: _rules(
            Arch.GPT_OSS,
            "llama_model_openai_moe::load_arch_hparams/load_arch_tensors "
            "(src/models/openai-moe.cpp)",
            experts=Experts.ALL,
            expert_width=ExpertWidth.EXPERT_KEY,
            tied_output=False,
            gpt_oss=True,
        ),
        Arch.GEMMA3: _rules(
            Arch.GEMMA3,
            "llama_model_gemma3::load_arch_hparams/load_arch_tensors (src/models/gemma3.cpp)",
            qk_norm=True,
            post_norms=True,
        ),
        Arch.DEEPSEEK2: _rules(
            Arch.DEEPSEEK2,
            "llama_model_deepseek2::load_arch_hparams/load_arch_tensors (src/models/deepseek2.cpp)",
            experts=Experts.AFTER_DENSE_LEAD,
            expert_width=ExpertWidth.EXPERT_KEY,
            shared_expert=SharedExpert.COUNTED,
            mla=True,
        ),
        Arch.GLM4MOE: _rules(
            Arch.GLM4MOE,
            "llama_model_glm4_moe::load_arch_hparams/load_arch_tensors (src/models/glm4-moe.cpp)",
            experts=Experts.AFTER_DENSE_LEAD,
            expert_width=ExpertWidth.EXPERT_KEY,
            shared_expert=SharedExpert.COUNTED_OPTIONAL,
            glm=True,
        ),
    }
)


def rules_of(arch: Arch | str) -> ArchRules:
    """The rules of ``arch`` (a ``general.architecture`` value)."""
    return ARCH_RULES[Arch(arch)]
