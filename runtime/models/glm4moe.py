"""GLM-4.5 / 4.6 / 4.7 decoder (``general.architecture = glm4moe``).

Follows llama.cpp's ``llama_model_glm4_moe::graph`` (``src/models/glm4-moe.cpp``):

- attention: Q/K/V with optional biases, optional per-head Q/K RMS norms (GLM-4.5 355B), RoPE
  NEOX on the first ``rope.dimension_count`` dims of each head (partial rotary: half of the head
  in GLM-4.5), scale ``1/sqrt(head_dim)`` (``llama.Attention``);
- per block ``h = x + attn(attn_norm(x))``, then ``out = h + ffn(attn_post_norm(h))``: glm4moe's
  ``attn_post_norm`` is the FFN's pre-norm (there is no ``ffn_norm``);
- blocks ``[0, leading_dense_block_count)`` dense SwiGLU, the others routed experts (sigmoid by
  default, ``exp_probs_b`` selection bias required, weights norm/scale) plus the optional shared
  experts (``blocks.moe.RoutedExperts``);
- the ``nextn_predict_layers`` trailing NextN/MTP blocks are loaded and never computed: their
  tensors are what ``unused`` lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from torch import nn

from ggufswap.runtime.models._moe_hparams import ROUTING_KEYS, routing_kwargs
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.decoder import DecoderStack, TransformerBlock
from ggufswap.runtime.models.blocks.moe import lead_dense_ffn
from ggufswap.runtime.models.blocks.rope import RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import WeightProvider
from ggufswap.runtime.models.hparams import Arch, Gating, HParams, KeyReader
from ggufswap.shards.keys import Keys, TensorNames

KEYS: Final = (*ROUTING_KEYS, Keys.LLM.ROPE_DIMENSION_SECTIONS)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_glm4_moe::load_arch_hparams: sigmoid gating unless the file says otherwise;
    multimodal RoPE sections (GLM-4.5V) are not implemented."""
    sections = reader.md.get(Keys.LLM.ROPE_DIMENSION_SECTIONS.format(reader.arch))
    if sections is not None and any(sections):
        reader.problems.append(
            f"{Keys.LLM.ROPE_DIMENSION_SECTIONS.format(reader.arch)} = {list(sections)}: "
            "multimodal RoPE is not implemented by the reference decoder"
        )
    return routing_kwargs(reader, default_gating=Gating.SIGMOID)


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


ARCHITECTURE = Architecture(
    arch=Arch.GLM4MOE, decoder=Glm4MoeTransformer, read_keys=read_keys, keys=KEYS
)
