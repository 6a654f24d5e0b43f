"""dots.llm1 (``general.architecture = dots1``): llama.cpp's ``llama_model_dots1``
(``src/models/dots1.cpp``).

qwen3's attention (per-head Q/K RMS norms before NEOX RoPE over the whole head, ``attn_k`` /
``attn_v`` as wide as the queries: ``head_count_kv`` must equal ``head_count``) in pre-norm
blocks whose FFN is, below ``leading_dense_block_count``, dense SwiGLU, and after it deepseek2's
routed experts (``blocks.moe.RoutedExperts``): the file's ``expert_gating_func`` (required:
llama.cpp's build_moe_ffn aborts without it), the optional ``exp_probs_b`` selection bias,
expert groups, ``expert_weights_norm`` / ``_scale``, plus ``expert_shared_count`` ungated shared
experts. ``output.weight`` is required.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ggufswap.runtime.models._moe_hparams import ROUTING_KEYS, routing_kwargs
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.decoder import DecoderStack, TransformerBlock
from ggufswap.runtime.models.blocks.moe import lead_dense_ffn
from ggufswap.runtime.models.blocks.rope import RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import (
    TensorSpec,
    WeightProvider,
    refuse_weight_scales,
)
from ggufswap.runtime.models.hparams import Arch, Gating, HParams, KeyReader
from ggufswap.shards.keys import Keys


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_dots1::load_arch_hparams: deepseek2's routing keys, the gating function
    required, and K/V as many heads as Q."""
    key = Keys.LLM.EXPERT_GATING_FUNC.format(reader.arch)
    if key not in reader.md:
        reader.problems.append(
            f"missing {key!r}: llama.cpp's build_moe_ffn aborts without a gating function"
        )
    if common["n_head_kv"] != common["n_head"]:
        reader.problems.append(
            f"{Keys.LLM.HEAD_COUNT_KV.format(reader.arch)} = {common['n_head_kv']}: dots1 creates "
            f"attn_k/attn_v as wide as the {common['n_head']} query heads"
        )
    return routing_kwargs(reader, default_gating=Gating.SOFTMAX)


class Dots1Block(TransformerBlock):
    """qwen3's attention, then a dense or routed FFN."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__(config, weights, layer, spec)
        refuse_weight_scales(spec, weights, layer)

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        return lead_dense_ffn(self.config, layer)


class Dots1Transformer(DecoderStack):
    """The dots1 decoder."""

    arch = Arch.DOTS1
    block = Dots1Block

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        self.rope = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)


ARCHITECTURE = Architecture(
    arch=Arch.DOTS1, decoder=Dots1Transformer, read_keys=read_keys, keys=ROUTING_KEYS
)
