"""llama: dense, or Mixtral-style MoE in every block; optional ``rope_freqs``.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``).
"""

from __future__ import annotations

from ggufswap.shards.archs._rules import Experts, ExpertWidth, rules
from ggufswap.shards.keys import Arch

RULES = rules(
    Arch.LLAMA,
    "llama_model_llama::load_arch_hparams/load_arch_tensors (src/models/llama.cpp); "
    "n_rot check in llama_model_base::load_hparams",
    experts=Experts.ALL_OR_NONE,
    expert_width=ExpertWidth.FEED_FORWARD_LENGTH,
    rope_dims_equal_head=True,
    rope_freqs=True,
    rope_neox=False,
)
