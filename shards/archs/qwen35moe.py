"""qwen35moe (Qwen3.5 / 3.6 MoE: 35B-A3B, 122B-A10B, 397B-A17B): qwen35's hybrid blocks with
routed experts (softmax, top-k renormalised) and a gated shared expert in every block.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``); the writer's hooks are qwen35's.
"""

from __future__ import annotations

from ggufswap.shards.archs._rules import Experts, ExpertWidth, SharedExpert, rules
from ggufswap.shards.archs.qwen35 import HYBRID_LLAMA_CPP_KEYS, WRITER
from ggufswap.shards.keys import Arch, Keys

RULES = rules(
    Arch.QWEN35MOE,
    "llama_model_qwen35moe::load_arch_hparams/load_arch_tensors (src/models/qwen35moe.cpp)",
    experts=Experts.ALL,
    expert_width=ExpertWidth.EXPERT_KEY_OR_SPLIT,
    shared_expert=SharedExpert.REQUIRED,
    qk_norm=True,
    rope_sections=True,
    hybrid=True,
    writer=WRITER,
    llama_cpp_keys=(
        *HYBRID_LLAMA_CPP_KEYS,
        Keys.LLM.ROPE_DIMENSION_SECTIONS,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH,
    ),
)
