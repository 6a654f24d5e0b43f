"""Qwen3.5 / Qwen3.6 dense (``general.architecture = qwen35``): llama.cpp's ``llama_model_qwen35``
(``src/models/qwen35.cpp``), its keys, its hybrid decoder and its state.

- Blocks ``i`` with ``(i + 1) % full_attention_interval != 0`` (or as
  ``attention.recurrent_layers`` says) are gated delta-net linear attention
  (:class:`~.blocks.delta_net.GatedDeltaNet`, value heads tiled over the key heads), the others
  full attention with an output gate (:class:`~.blocks.attention.GatedAttention`: ``attn_q``
  gives each head's query and gate, per-head Q/K norms, interleaved multimodal RoPE on the first
  ``rope.dimension_count`` dims by ``rope.dimension_sections``: for text every position component
  is the token's, so sections only decide which pairs rotate);
- per block ``h = x + mixer(attn_norm(x))`` then ``out = h + ffn(attn_post_norm(h))``, the FFN
  dense SwiGLU (qwen35) or routed experts plus a gated shared expert (qwen35moe);
- ``nextn_predict_layers`` trailing MTP blocks are loaded and never run.

A sequence's state is a :class:`~.kv_cache.HybridCache`: keys and values of the attention
layers, conv and recurrent state of the delta-net layers, all valid for one weight version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from torch import nn

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.attention import GatedAttention
from ggufswap.runtime.models.blocks.decoder import DecoderStack, TransformerBlock
from ggufswap.runtime.models.blocks.delta_net import GatedDeltaNet
from ggufswap.runtime.models.blocks.rope import RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import WeightProvider
from ggufswap.runtime.models.hparams import Arch, HParams, KeyReader, SSMShape
from ggufswap.runtime.models.kv_cache import HybridCache
from ggufswap.shards.keys import Keys, TensorNames

# llama_model_qwen35::load_arch_hparams: full attention every 4th block unless the file says.
FULL_ATTENTION_INTERVAL: Final = 4
HYBRID_KEYS: Final = (
    Keys.LLM.SSM_CONV_KERNEL,
    Keys.LLM.SSM_INNER_SIZE,
    Keys.LLM.SSM_STATE_SIZE,
    Keys.LLM.SSM_TIME_STEP_RANK,
    Keys.LLM.SSM_GROUP_COUNT,
    Keys.LLM.ATTENTION_RECURRENT_LAYERS,
    Keys.LLM.FULL_ATTENTION_INTERVAL,
    Keys.LLM.NEXTN_PREDICT_LAYERS,
)
KEYS: Final = (*HYBRID_KEYS, Keys.LLM.ROPE_DIMENSION_SECTIONS)


def hybrid_kwargs(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """The delta-net keys and the layer pattern qwen35, qwen35moe and qwen3next read."""
    k = Keys.LLM
    n_layer = common["n_layer"]
    n_nextn = reader.get_int(k.NEXTN_PREDICT_LAYERS, 0)
    ssm = SSMShape(
        d_conv=reader.get_int(k.SSM_CONV_KERNEL),
        d_inner=reader.get_int(k.SSM_INNER_SIZE),
        d_state=reader.get_int(k.SSM_STATE_SIZE),
        n_v_heads=reader.get_int(k.SSM_TIME_STEP_RANK),
        n_k_heads=reader.get_int(k.SSM_GROUP_COUNT),
    )
    flags = reader.md.get(k.ATTENTION_RECURRENT_LAYERS.format(reader.arch))
    if flags is not None:
        recurrent = tuple(bool(f) for f in flags)[:n_layer]
    else:
        interval = reader.get_int(k.FULL_ATTENTION_INTERVAL, FULL_ATTENTION_INTERVAL)
        interval = max(interval, 1)
        recurrent = tuple(i < n_layer - n_nextn and (i + 1) % interval != 0 for i in range(n_layer))
    return {"ssm": ssm, "recurrent_layers": recurrent, "n_layer_nextn": n_nextn}


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_qwen35::load_arch_hparams: the delta-net keys, the layer pattern and the
    required ``rope.dimension_sections`` (four values)."""
    out = hybrid_kwargs(reader, common)
    key = Keys.LLM.ROPE_DIMENSION_SECTIONS.format(reader.arch)
    sections = reader.md.get(key)
    if sections is None or len(sections) < 4:
        reader.problems.append(f"missing required key {key!r} (four values)")
    else:
        out["rope_sections"] = tuple(int(v) for v in list(sections)[:4])
    return out


class HybridBlock(TransformerBlock):
    """``h = x + mixer(attn_norm(x))``, ``out = h + ffn(attn_post_norm(h))``: the mixer is the
    gated delta net in recurrent layers, gated full attention in the others."""

    ffn_norm_name: ClassVar[str] = TensorNames.ATTN_POST_NORM
    delta_net_cls: ClassVar[type[nn.Module]] = GatedDeltaNet

    def attention_cls_for(self, layer: int) -> type[nn.Module]:
        recurrent = self.config.recurrent_layers
        assert recurrent is not None, "a hybrid config carries its layer pattern"
        return self.delta_net_cls if recurrent[layer] else GatedAttention


class HybridTransformer(DecoderStack):
    """The Qwen3.5 / Qwen3-Next decoder: delta-net and full-attention blocks, one state."""

    block = HybridBlock

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        self.rope = RotaryEmbedding(
            config, freq_scale=config.rope_freq_scale, sections=config.rope_sections
        )

    def new_cache(self, *, max_len: int) -> HybridCache:
        """An empty state for one sequence: attention keys/values and delta-net states."""
        return HybridCache(n_layer=self.n_trunk, max_len=max_len)


class Qwen35Transformer(HybridTransformer):
    """qwen35: dense SwiGLU FFNs."""

    arch = Arch.QWEN35


ARCHITECTURE = Architecture(
    arch=Arch.QWEN35, decoder=Qwen35Transformer, read_keys=read_keys, keys=KEYS
)
