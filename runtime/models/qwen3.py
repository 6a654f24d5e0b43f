"""qwen3 (Qwen3 dense): llama.cpp's ``llama_model_qwen3`` (``src/models/qwen3.cpp``).

The llama decoder (:class:`~.llama.Transformer`) with RoPE NEOX and the required per-head Q/K RMS
norms before RoPE.
"""

from __future__ import annotations

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.hparams import Arch
from ggufswap.runtime.models.llama import Transformer

ARCHITECTURE = Architecture(arch=Arch.QWEN3, decoder=Transformer)
