"""qwen2: dense, ``attn_q`` sized ``{n_embd, n_embd}``.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``).
"""

from __future__ import annotations

from ggufswap.shards.archs._rules import rules
from ggufswap.shards.keys import Arch

RULES = rules(
    Arch.QWEN2,
    "llama_model_qwen2::load_arch_tensors (src/models/qwen2.cpp)",
    free_head_dim=False,
)
