"""Qwen3-VL MoE's text tower (``general.architecture = qwen3vlmoe``): llama.cpp's
``llama_model_qwen3vlmoe`` (``src/models/qwen3vlmoe.cpp``).

qwen3moe's blocks (per-head Q/K RMS norms, routed experts: softmax over every expert, top-k,
renormalised; no shared expert) with interleaved multimodal RoPE over the whole head
(``rope.dimension_sections``, four values, required): llama.cpp gives a text token its position
in the first three components and 0 in the fourth, so a pair whose sector falls to the fourth does
not rotate (:func:`~.blocks.rope.rotating_pairs`). ``n_deepstack_layers`` adds the vision tower's
deepstack features to the first blocks' outputs; for text tokens llama.cpp pads the input
embedding with zeros there (``build_inp_embd``), so the additions are zeros and text decodes as
without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ggufswap.runtime.models._moe_hparams import QWEN_MOE_KEYS, qwen_moe_kwargs
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.decoder import DecoderStack, TransformerBlock
from ggufswap.runtime.models.blocks.rope import RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import (
    TensorSpec,
    WeightProvider,
    refuse_weight_scales,
)
from ggufswap.runtime.models.hparams import Arch, HParams, KeyReader
from ggufswap.shards.keys import Keys

KEYS: Final = (Keys.LLM.ROPE_DIMENSION_SECTIONS, Keys.LLM.NUM_DEEPSTACK_LAYERS, *QWEN_MOE_KEYS)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_qwen3vlmoe::load_arch_hparams: the expert width, the four required RoPE
    sections (summing to at most the head's pairs' span: the head width), the deepstack count
    (zeros for text), and the graph's ``GGML_ASSERT(n_embd_head == n_rot)``."""
    out = qwen_moe_kwargs(reader, common)
    head = common["key_length"] or (common["n_embd"] // max(common["n_head"], 1))
    key = Keys.LLM.ROPE_DIMENSION_SECTIONS.format(reader.arch)
    sections = reader.md.get(key)
    if sections is None or len(sections) < 4:
        reader.problems.append(f"missing required key {key!r} (four values)")
    else:
        out["rope_sections"] = tuple(int(v) for v in list(sections)[:4])
        if sum(out["rope_sections"]) > head:
            reader.problems.append(
                f"{key} = {list(sections)}: the sections must sum to at most the head width "
                f"{head} (GGML_ASSERT(sect_dims <= ne0))"
            )
    if common["rope_dim"] not in (None, head):
        reader.problems.append(
            f"{Keys.LLM.ROPE_DIMENSION_COUNT.format(reader.arch)} = {common['rope_dim']}: "
            f"qwen3vlmoe rotates the whole head of {head} (GGML_ASSERT(n_embd_head == n_rot))"
        )
    if reader.get_int(Keys.LLM.NUM_DEEPSTACK_LAYERS, 0) < 0:
        reader.problems.append(f"{Keys.LLM.NUM_DEEPSTACK_LAYERS.format(reader.arch)} is negative")
    return out


class Qwen3VLMoeBlock(TransformerBlock):
    """qwen3moe's block; llama.cpp's per-tensor weight scales refused by name."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__(config, weights, layer, spec)
        refuse_weight_scales(spec, weights, layer)


class Qwen3VLMoeTransformer(DecoderStack):
    """qwen3moe's decoder with interleaved multimodal RoPE (text positions)."""

    arch = Arch.QWEN3VLMOE
    block = Qwen3VLMoeBlock

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        self.rope = RotaryEmbedding(
            config, freq_scale=config.rope_freq_scale, sections=config.rope_sections
        )


ARCHITECTURE = Architecture(
    arch=Arch.QWEN3VLMOE, decoder=Qwen3VLMoeTransformer, read_keys=read_keys, keys=KEYS
)
