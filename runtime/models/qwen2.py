"""qwen2 (Qwen2 / Qwen2.5 dense): llama.cpp's ``llama_model_qwen2`` (``src/models/qwen2.cpp``).

The llama decoder (:class:`~.llama.Transformer`) with RoPE NEOX and Q/K/V biases where the file
has them; ``attn_q`` is ``{n_embd, n_embd}`` (the head width is ``n_embd / n_head``).
"""

from __future__ import annotations

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.hparams import Arch
from ggufswap.runtime.models.llama import Transformer

ARCHITECTURE = Architecture(arch=Arch.QWEN2, decoder=Transformer)
