"""qwen3: dense, per-head Q/K norms required.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``).
"""

from __future__ import annotations

from ggufswap.shards.archs._rules import rules
from ggufswap.shards.keys import Arch

RULES = rules(
    Arch.QWEN3,
    "llama_model_qwen3::load_arch_tensors (src/models/qwen3.cpp)",
    qk_norm=True,
)
