"""MiniMax-M2 (``general.architecture = minimax-m2``): llama.cpp's ``llama_model_minimax_m2``
(``src/models/minimax-m2.cpp``).

- Attention: ``attn_q/k/v``, then one RMS norm over *all* query heads together
  (``attn_q_norm``: ``[n_head * head]``) and one over all key heads (``attn_k_norm``), before the
  heads are split; NEOX RoPE on the first ``rope.dimension_count`` dims of each head (MiniMax-M2:
  64 of 128), grouped-query attention with scale ``1/sqrt(head)``.
- Every block's FFN is routed experts: ``expert_gating_func`` (required: 1 softmax, 2 sigmoid),
  the ``exp_probs_b`` selection bias (required), the chosen weights renormalised; experts sized by
  ``feed_forward_length`` (``expert_feed_forward_length`` is required and not used by the graph);
  no shared expert; ``output.weight`` required.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from torch import Tensor, nn

from ggufswap.runtime.models._moe_hparams import Gating
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.attention import attend
from ggufswap.runtime.models.blocks.decoder import DecoderStack, TransformerBlock
from ggufswap.runtime.models.blocks.moe import RoutedExperts
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables, RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import (
    TensorSpec,
    WeightProvider,
    linear,
    refuse_weight_scales,
)
from ggufswap.runtime.models.hparams import Arch, HParams, KeyReader
from ggufswap.runtime.models.kv_cache import KVCache
from ggufswap.shards.keys import Keys, TensorNames

KEYS: Final = (Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, Keys.LLM.EXPERT_GATING_FUNC)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_minimax_m2::load_arch_hparams: ``expert_feed_forward_length`` (required) and
    the gating function (build_moe_ffn aborts on any but the ones it knows; the decoder
    implements softmax and sigmoid). The graph always renormalises the chosen weights."""
    reader.get_int(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)  # required; the experts take n_ff
    key = Keys.LLM.EXPERT_GATING_FUNC.format(reader.arch)
    gating = reader.get_int(Keys.LLM.EXPERT_GATING_FUNC, 0)
    if gating not in tuple(Gating):
        reader.problems.append(
            f"{key} = {gating}: the reference decoder implements softmax (1) and sigmoid (2) "
            "(llama.cpp's build_moe_ffn aborts when the key is absent)"
        )
        gating = Gating.SIGMOID
    return {"gating": Gating(gating), "expert_weights_norm": True}


class NormedAttention(nn.Module):
    """Grouped-query attention whose Q and K are RMS-normed across all heads at once."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights, self.layer = config, weights, layer
        d, hd, tn = config.n_embd, config.head_dim, TensorNames
        q_dim, kv_dim = config.n_head * hd, config.n_head_kv * hd
        self.wq = spec.need(tn.ATTN_Q.format(layer, "weight"), (q_dim, d))
        self.wk = spec.need(tn.ATTN_K.format(layer, "weight"), (kv_dim, d))
        self.wv = spec.need(tn.ATTN_V.format(layer, "weight"), (kv_dim, d))
        self.wo = spec.need(tn.ATTN_OUT.format(layer, "weight"), (d, q_dim))
        self.q_norm = spec.need(tn.ATTN_Q_NORM.format(layer), (q_dim,))
        self.k_norm = spec.need(tn.ATTN_K_NORM.format(layer), (kv_dim,))

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        c, w = self.config, self.weights
        bsz, seq, _ = x.shape
        q = rms_norm(linear(x, w.matrix(self.wq)), w.weight(self.q_norm), c.norm_eps)
        k = rms_norm(linear(x, w.matrix(self.wk)), w.weight(self.k_norm), c.norm_eps)
        v = linear(x, w.matrix(self.wv)).view(bsz, seq, c.n_head_kv, c.head_dim)
        q = rope.rotate(q.view(bsz, seq, c.n_head, c.head_dim))  # [B, T, H, hd]
        k = rope.rotate(k.view(bsz, seq, c.n_head_kv, c.head_dim))
        y = attend(q, k, v, layer=self.layer, scale=c.attn_scale, mask=mask, cache=cache)
        return linear(y, w.matrix(self.wo))  # [B, T, D]


class BiasedExperts(RoutedExperts):
    """build_moe_ffn with the selection bias required (created without TENSOR_NOT_REQUIRED)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__(config, weights, layer, spec)
        self.bias = spec.need(TensorNames.FFN_EXP_PROBS_B.format(layer), (config.n_expert,))


class MiniMaxBlock(TransformerBlock):
    """Pre-norm attention (Q/K normed across heads) and routed experts."""

    attention_cls: ClassVar[type[nn.Module]] = NormedAttention

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__(config, weights, layer, spec)
        refuse_weight_scales(spec, weights, layer)

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        return BiasedExperts


class MiniMaxM2Transformer(DecoderStack):
    """The minimax-m2 decoder."""

    arch = Arch.MINIMAX_M2
    block = MiniMaxBlock

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        self.rope = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)


ARCHITECTURE = Architecture(
    arch=Arch.MINIMAX_M2, decoder=MiniMaxM2Transformer, read_keys=read_keys, keys=KEYS
)
