"""qwen2moe: MoE in every block with a required gated shared expert.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``).
"""

from __future__ import annotations

from ggufswap.shards.archs._rules import Experts, ExpertWidth, SharedExpert, rules
from ggufswap.shards.keys import Arch, Keys

RULES = rules(
    Arch.QWEN2MOE,
    "llama_model_qwen2moe::load_arch_hparams/load_arch_tensors (src/models/qwen2moe.cpp)",
    experts=Experts.ALL,
    expert_width=ExpertWidth.EXPERT_KEY_OR_SPLIT,
    shared_expert=SharedExpert.REQUIRED,
    tied_output=False,
    free_head_dim=False,
    norm_topk=False,
    llama_cpp_keys=(
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH,
    ),
)
