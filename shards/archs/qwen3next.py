"""qwen3next (Qwen3-Next-80B-A3B): the hybrid blocks of Qwen3.5 with one fused beta/alpha
projection (``ssm_ba``), value heads interleaved over the key heads, plain NEOX RoPE, and routed
experts with a gated shared expert in every block (``expert_count`` > 0 required).

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``); the writer's hooks are qwen35's (its plan
writes ``ssm_ba`` for this architecture), without the RoPE sections.
"""

from __future__ import annotations

from ggufswap.shards.archs._rules import Experts, ExpertWidth, SharedExpert, WriterHooks, rules
from ggufswap.shards.archs.qwen35 import (
    HYBRID_LLAMA_CPP_KEYS,
    hybrid_errors,
    hybrid_metadata,
    plan_block,
)
from ggufswap.shards.keys import Arch, Keys

RULES = rules(
    Arch.QWEN3NEXT,
    "llama_model_qwen3next::load_arch_hparams/load_arch_tensors (src/models/qwen3next.cpp)",
    experts=Experts.ALL,
    expert_width=ExpertWidth.EXPERT_KEY_OR_SPLIT,
    shared_expert=SharedExpert.REQUIRED,
    qk_norm=True,
    hybrid=True,
    writer=WriterHooks(errors=hybrid_errors, metadata=hybrid_metadata, block=plan_block),
    llama_cpp_keys=(
        *HYBRID_LLAMA_CPP_KEYS,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH,
    ),
)
