"""gemma3: post-attention and post-FFN norms, per-head Q/K norms, GeGLU.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``).
"""

from __future__ import annotations

from ggufswap.shards.archs._rules import rules
from ggufswap.shards.keys import Arch, Keys

RULES = rules(
    Arch.GEMMA3,
    "llama_model_gemma3::load_arch_hparams/load_arch_tensors (src/models/gemma3.cpp)",
    qk_norm=True,
    post_norms=True,
    gemma=True,
    llama_cpp_keys=(
        Keys.LLM.SLIDING_WINDOW,
        Keys.LLM.SLIDING_WINDOW_PATTERN,
        Keys.LLM.FINAL_LOGIT_SOFTCAPPING,
        Keys.LLM.ROPE_FREQ_BASE_SWA,
    ),
)
