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

from collections.abc import Iterable

from torch import Tensor, nn

from ggufswap.runtime.models.deepseek2 import RoutedExperts
from ggufswap.runtime.models.errors import HParamsError
from ggufswap.runtime.models.hparams import Arch, HParams
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.runtime.models.llama import (
    Attention,
    FeedForward,
    RopeTables,
    RotaryEmbedding,
    WeightProvider,
    _check,
    _Spec,
    embed,
    lm_head,
    output_name,
    rms_norm,
)
from ggufswap.shards.keys import TensorNames


class Glm4MoeBlock(nn.Module):
    """Pre-norm attention, then a dense or routed FFN normed by attn_post_norm."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.config, self.weights = config, weights
        d = (config.n_embd,)
        self.attn_norm = spec.need(TensorNames.ATTN_NORM.format(layer), d)
        self.ffn_norm = spec.need(TensorNames.ATTN_POST_NORM.format(layer), d)
        self.attention = Attention(config, weights, layer, spec)
        dense = layer < config.n_layer_dense_lead
        ffn_cls = FeedForward if dense else RoutedExperts
        self.feed_forward: nn.Module = ffn_cls(config, weights, layer, spec)

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        w, eps = self.weights.weight, self.config.norm_eps
        h = x + self.attention(rms_norm(x, w(self.attn_norm), eps), rope, mask, cache)
        return h + self.feed_forward(rms_norm(h, w(self.ffn_norm), eps))


class Glm4MoeTransformer(nn.Module):
    """The glm4moe decoder. ``forward(tokens [B, T]) -> logits [B, T, V]`` (float32)."""

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__()
        if config.arch is not Arch.GLM4MOE:
            raise HParamsError(f"Glm4MoeTransformer runs glm4moe, not {config.arch.value}")
        self.config, self.weights = config, weights
        self.n_trunk = config.n_layer - config.n_layer_nextn  # NextN blocks are not run
        spec = _Spec()
        self.tok_embd = spec.need(TensorNames.TOKEN_EMBD, (config.n_vocab, config.n_embd))
        self.norm = spec.need(TensorNames.OUTPUT_NORM, (config.n_embd,))
        self.output = spec.need(output_name(config, weights), (config.n_vocab, config.n_embd))
        self.layers = nn.ModuleList(
            Glm4MoeBlock(config, weights, i, spec) for i in range(self.n_trunk)
        )
        self.rope = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)
        self.required = dict(spec.required)  # every tensor a forward reads, with its shape
        _check(weights, spec, shapes=check_shapes)

    def forward(
        self, tokens: Tensor, *, start_pos: int = 0, cache: KVCache | None = None
    ) -> Tensor:
        """Logits of ``tokens`` at positions ``start_pos ..``; with ``cache`` they also attend to
        the cached positions (``start_pos`` must be ``cache.length``) and are appended to it."""
        # tokens: [B, T] int64 -> logits: [B, T, V] float32
        w, seq = self.weights.weight, tokens.shape[1]
        x = embed(tokens, self.weights, self.tok_embd)  # [B, T, D]
        rope = self.rope(start_pos, seq, tokens.device)
        mask = None
        if cache is not None:
            cache.check_continues(start_pos, seq)
            mask = attention_mask(start_pos, seq, device=tokens.device)
        for layer in self.layers:
            x = layer(x, rope, mask, cache)
        if cache is not None:
            cache.advance(seq)
        x = rms_norm(x, w(self.norm), self.config.norm_eps)
        return lm_head(x, self.weights.matrix(self.output))  # [B, T, V]

    def unused(self, names: Iterable[str]) -> list[str]:
        """The tensors among ``names`` no forward reads (the NextN blocks'), sorted."""
        return sorted(set(names) - set(self.required))

    def new_cache(self, *, max_len: int) -> KVCache:
        """An empty cache for one sequence of up to ``max_len`` positions (it grows past them)."""
        return KVCache(n_layer=self.n_trunk, max_len=max_len)
