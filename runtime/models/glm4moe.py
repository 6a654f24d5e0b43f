"""GLM-4.5 / 4.6 / 4.7 decoder (``general.architecture = glm4moe``).

Follows llama.cpp's ``llama_model_glm4_moe::graph`` (``src/models/glm4-moe.cpp``):

- attention: Q/K/V with optional biases, optional per-head Q/K RMS norms (GLM-4.5 355B), RoPE
  NEOX on the first ``rope.dimension_count`` dims of each head (partial rotary: half of the head
  in GLM-4.5), scale ``1/sqrt(head_dim)`` (``llama.Attention``);
- per block ``h = x + attn(attn_norm(x))``, then ``out = h + ffn(attn_post_norm(h))``: glm4moe's
  ``attn_post_norm`` is the FFN's pre-norm (there is no ``ffn_norm``);
- blocks ``[0, leading_dense_block_count)`` dense SwiGLU, the others routed experts (sigmoid by
  default, ``exp_probs_b`` selection bias required, weights norm/scale) plus the optional shared
  experts (``deepseek2.RoutedExperts``);
- the ``nextn_predict_layers`` trailing NextN/MTP blocks are loaded and never computed: their
  tensors are what ``unused`` lists.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from ggufswap.runtime.models.deepseek2 import lead_dense_ffn
from ggufswap.runtime.models.hparams import Arch, HParams
from ggufswap.runtime.models.llama import (
    DecoderStack,
    RotaryEmbedding,
    TransformerBlock,
    WeightProvider,
)
from ggufswap.shards.keys import TensorNames


class Glm4MoeBlock(TransformerBlock):
    """Pre-norm attention, then a dense or routed FFN normed by attn_post_norm."""

    ffn_norm_name: ClassVar[str] = TensorNames.ATTN_POST_NORM

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        return lead_dense_ffn(self.config, layer)


class Glm4MoeTransformer(DecoderStack):
    """The glm4moe decoder: llama's attention and RoPE, deepseek2's experts."""

    arch = Arch.GLM4MOE
    block = Glm4MoeBlock

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        self.rope = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)
