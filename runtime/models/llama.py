"""llama (``general.architecture = llama``): dense, or Mixtral-style MoE in every block.

llama.cpp's ``llama_model_llama`` (``src/models/llama.cpp``): pre-norm blocks of grouped-query
attention (RoPE NORM: adjacent pairs) and SwiGLU, or routed experts in every block when
``llama.expert_count`` > 0 (softmax over all experts, top-k, renormalised; experts sized by
``feed_forward_length``; old Mixtral files with one tensor per expert load too). An optional
``rope_freqs.weight`` (Llama 3.1+ scaling) divides each pair's frequency at every forward.

:class:`Transformer` is the decoder of the llama family: qwen2, qwen3, qwen2moe and qwen3moe run
it too, their differences being what ``HParams`` reads (Q/K/V biases, per-head Q/K norms, a gated
shared expert, NEOX RoPE, routing renormalised or not).
"""

from __future__ import annotations

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.decoder import DecoderStack
from ggufswap.runtime.models.blocks.rope import RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import WeightProvider
from ggufswap.runtime.models.hparams import Arch, HParams


class Transformer(DecoderStack):
    """The llama-family decoder (llama, qwen2, qwen3, qwen2moe, qwen3moe)."""

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        self.rope = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)


ARCHITECTURE = Architecture(arch=Arch.LLAMA, decoder=Transformer)
