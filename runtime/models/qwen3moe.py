"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): llama.cpp's ``llama_model_qwen3moe``
(``src/models/qwen3moe.cpp``).

The llama decoder (:class:`~.llama.Transformer`) with RoPE NEOX, per-head Q/K RMS norms, and in
every block routed experts (softmax over all experts, top-k, renormalised), no shared expert.
``expert_feed_forward_length`` sizes the experts (else ``feed_forward_length /
expert_used_count``).
"""

from __future__ import annotations

from ggufswap.runtime.models._moe_hparams import QWEN_MOE_KEYS, qwen_moe_kwargs
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.hparams import Arch
from ggufswap.runtime.models.llama import Transformer

ARCHITECTURE = Architecture(
    arch=Arch.QWEN3MOE, decoder=Transformer, read_keys=qwen_moe_kwargs, keys=QWEN_MOE_KEYS
)
