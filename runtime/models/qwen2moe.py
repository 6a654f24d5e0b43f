"""qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): llama.cpp's ``llama_model_qwen2moe``
(``src/models/qwen2moe.cpp``).

The llama decoder (:class:`~.llama.Transformer`) with RoPE NEOX, Q/K/V biases where present, and
in every block routed experts (softmax over all experts, then top-k, *not* renormalised) plus a
shared expert under a sigmoid gate (``ffn_*_shexp``, ``ffn_gate_inp_shexp``: required).
``expert_feed_forward_length`` sizes the experts (else ``feed_forward_length / expert_used_count``),
``expert_shared_feed_forward_length`` the shared one (else ``feed_forward_length``).
"""

from __future__ import annotations

from ggufswap.runtime.models._moe_hparams import QWEN_MOE_KEYS, qwen_moe_kwargs
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.hparams import Arch
from ggufswap.runtime.models.llama import Transformer

ARCHITECTURE = Architecture(
    arch=Arch.QWEN2MOE, decoder=Transformer, read_keys=qwen_moe_kwargs, keys=QWEN_MOE_KEYS
)
