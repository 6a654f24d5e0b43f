"""qwen3moe: MoE in every block, per-head Q/K norms, no shared expert.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``).
"""

from __future__ import annotations

from ggufswap.shards.archs._rules import Experts, ExpertWidth, rules
from ggufswap.shards.keys import Arch, Keys

RULES = rules(
    Arch.QWEN3MOE,
    "llama_model_qwen3moe::load_arch_hparams/load_arch_tensors (src/models/qwen3moe.cpp)",
    experts=Experts.ALL,
    expert_width=ExpertWidth.EXPERT_KEY_OR_SPLIT,
    qk_norm=True,
    llama_cpp_keys=(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,),
)
