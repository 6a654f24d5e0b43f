"""ggufswap.runtime.models: one module per architecture, over a small library of shared blocks.

``<arch>.py`` holds an architecture's keys, decoder and state; ``blocks/`` the attention, MoE,
RoPE, norm and FFN blocks they compose; ``registry.ARCHITECTURES`` one line per architecture;
``hparams.HParams`` the config every decoder reads. Every decoder reads its weights through a
:class:`WeightProvider` (the core's tensor store when serving) at forward time, so a committed
swap is what the next forward computes with. This package imports torch, the GGUF keys of
:mod:`ggufswap.shards` and the core's public names only.
"""

from __future__ import annotations

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.weights import DictWeightProvider, WeightProvider
from ggufswap.runtime.models.deepseek2 import Deepseek2Transformer
from ggufswap.runtime.models.errors import (
    HParamsError,
    KVCacheError,
    MissingWeightError,
    ModelError,
)
from ggufswap.runtime.models.gemma3 import Gemma3Transformer
from ggufswap.runtime.models.ggml_numerics import Numerics
from ggufswap.runtime.models.glm4moe import Glm4MoeTransformer
from ggufswap.runtime.models.gpt_oss import GptOssTransformer
from ggufswap.runtime.models.hparams import Arch, HParams, RopeType
from ggufswap.runtime.models.kv_cache import KVCache
from ggufswap.runtime.models.llama import Transformer
from ggufswap.runtime.models.registry import (
    ARCHITECTURES,
    DECODERS,
    Decoder,
    architecture,
    build_model,
    unused_tensors,
)

__all__ = [
    "ARCHITECTURES",
    "DECODERS",
    "Arch",
    "Architecture",
    "Decoder",
    "Deepseek2Transformer",
    "DictWeightProvider",
    "Gemma3Transformer",
    "Glm4MoeTransformer",
    "GptOssTransformer",
    "HParams",
    "HParamsError",
    "KVCache",
    "KVCacheError",
    "MissingWeightError",
    "ModelError",
    "Numerics",
    "RopeType",
    "Transformer",
    "WeightProvider",
    "architecture",
    "build_model",
    "unused_tensors",
]
