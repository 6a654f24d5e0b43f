"""gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE): experts in every block, sized by the
required expert_feed_forward_length; output.weight required; its own block (sinks, biases).

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and its block of tensors for the writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.shards.archs._rules import Experts, ExpertWidth, WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys

if TYPE_CHECKING:
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards.writer import ModelSpec


def plan_block(spec: ModelSpec, b: int) -> list[PlannedTensor]:
    """One gpt-oss block as llama_model_openai_moe::load_arch_tensors creates it: biased
    attention with sinks, post_attention_norm (the FFN's input norm), a biased router and biased
    experts."""
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards._roles import Role

    e, hd, f, x = spec.n_embd, spec.n_embd_head, spec.n_ff_expert, spec.n_expert
    q, kv = spec.n_head * hd, spec.n_head_kv * hd
    shapes = (
        (Role.ATTN_NORM, (e,)),
        (Role.ATTN_Q, (e, q)),
        (Role.ATTN_Q_BIAS, (q,)),
        (Role.ATTN_K, (e, kv)),
        (Role.ATTN_K_BIAS, (kv,)),
        (Role.ATTN_V, (e, kv)),
        (Role.ATTN_V_BIAS, (kv,)),
        (Role.ATTN_O, (q, e)),
        (Role.ATTN_O_BIAS, (e,)),
        (Role.ATTN_SINKS, (spec.n_head,)),
        (Role.ATTN_POST_NORM, (e,)),
        (Role.FFN_GATE_INP, (e, x)),
        (Role.FFN_GATE_INP_BIAS, (x,)),
        (Role.FFN_GATE_EXPS, (e, f, x)),
        (Role.FFN_GATE_EXPS_BIAS, (f, x)),
        (Role.FFN_UP_EXPS, (e, f, x)),
        (Role.FFN_UP_EXPS_BIAS, (f, x)),
        (Role.FFN_DOWN_EXPS, (f, e, x)),
        (Role.FFN_DOWN_EXPS_BIAS, (e, x)),
    )
    return [PlannedTensor(r.tensor_name(b), r, spec.type_of(r), ne, b) for r, ne in shapes]


RULES = rules(
    Arch.GPT_OSS,
    "llama_model_openai_moe::load_arch_hparams/load_arch_tensors (src/models/openai-moe.cpp)",
    experts=Experts.ALL,
    expert_width=ExpertWidth.EXPERT_KEY,
    tied_output=False,
    gpt_oss=True,
    rope_yarn=True,
    norm_topk=False,
    writer=WriterHooks(block=plan_block),
    llama_cpp_keys=(
        Keys.LLM.SLIDING_WINDOW,
        Keys.LLM.SLIDING_WINDOW_PATTERN,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.ROPE_FREQ_BASE_SWA,
    ),
)
