"""ggufswap.runtime.models.blocks: the shared library the architecture modules compose.

- ``weights``: the weight provider protocol, ``linear`` over every kind of weight, the shape
  checks (``TensorSpec``);
- ``norms``: RMS norm; ``rope``: RoPE tables (NORM/NEOX, linear, llama 3.1 factors, YaRN);
- ``attention``: grouped-query attention without K/V copies, sliding-window masks;
- ``ffn``: SwiGLU / GeGLU; ``moe``: expert routing (softmax top-k, grouped sigmoid/softmax with
  a selection bias), the grouped expert product (one call per projection) and the one expert
  loop;
- ``decoder``: the pre-norm block and the decoder stack every architecture subclasses.

Each block is ``Block(config, weights, layer, spec)`` and computes in ``forward``; a block reads
its weights from the provider at every forward, never at construction.
"""

from __future__ import annotations

from ggufswap.runtime.models.blocks.attention import (
    Attention,
    grouped_attention,
    sliding_window_mask,
)
from ggufswap.runtime.models.blocks.decoder import (
    DecoderStack,
    LayerInputs,
    TransformerBlock,
    embed,
    lm_head,
    output_name,
    rope_freqs_of,
)
from ggufswap.runtime.models.blocks.ffn import GATED_FFN, FeedForward, geglu, swiglu
from ggufswap.runtime.models.blocks.moe import (
    MoEFeedForward,
    RoutedExperts,
    combine_experts,
    lead_dense_ffn,
    routed_swiglu,
)
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables, RotaryEmbedding, rotary
from ggufswap.runtime.models.blocks.weights import (
    DictWeightProvider,
    ExpertStack,
    Matrix,
    TensorSpec,
    WeightProvider,
    check_weights,
    linear,
    linears,
    routed_linear,
)

__all__ = [
    "GATED_FFN",
    "Attention",
    "DecoderStack",
    "DictWeightProvider",
    "ExpertStack",
    "FeedForward",
    "LayerInputs",
    "Matrix",
    "MoEFeedForward",
    "RopeTables",
    "RotaryEmbedding",
    "RoutedExperts",
    "TensorSpec",
    "TransformerBlock",
    "WeightProvider",
    "check_weights",
    "combine_experts",
    "embed",
    "geglu",
    "grouped_attention",
    "lead_dense_ffn",
    "linear",
    "linears",
    "lm_head",
    "output_name",
    "rms_norm",
    "rope_freqs_of",
    "rotary",
    "routed_linear",
    "routed_swiglu",
    "sliding_window_mask",
    "swiglu",
]
