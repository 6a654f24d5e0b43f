"""glm-dsa (GLM-5 / 5.1 / 5.2): deepseek32's blocks with shared indexer blocks, NORM indexer
RoPE, sigmoid gating by default and no YaRN log multiplier.

The torch-free spec of the architecture (``RULES``); the writer's hooks are deepseek32's
(``shards.archs.deepseek32``), which write ``indexer_types`` and skip the indexer tensors of
shared blocks.
"""

from __future__ import annotations

from ggufswap.shards.archs import deepseek32
from ggufswap.shards.archs._rules import Experts, ExpertWidth, SharedExpert, rules
from ggufswap.shards.keys import Arch, Keys

RULES = rules(
    Arch.GLM_DSA,
    "llama_model_glm_dsa::load_arch_hparams/load_arch_tensors (src/models/glm-dsa.cpp)",
    experts=Experts.AFTER_DENSE_LEAD,
    expert_width=ExpertWidth.EXPERT_KEY,
    shared_expert=SharedExpert.COUNTED,
    mla=True,
    dsa=True,
    rope_neox=False,
    rope_yarn=True,
    norm_topk=False,
    writer=deepseek32.WRITER,
    llama_cpp_keys=(
        *deepseek32.MLA_LLAMA_CPP_KEYS,
        *deepseek32.INDEXER_LLAMA_CPP_KEYS,
        Keys.LLM.INDEXER_TYPES,
    ),
)
