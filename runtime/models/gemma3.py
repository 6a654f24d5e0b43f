"""Gemma 3 decoder (``general.architecture = gemma3``), built from ``model``'s blocks.

Follows llama.cpp's ``gemma3-iswa`` graph:

- token embeddings multiplied by ``sqrt(n_embd)``;
- per block: ``h = x + post_attention_norm(attn(attn_norm(x)))`` then
  ``out = h + post_ffw_norm(geglu(ffn_norm(h)))``; per-head RMS norms on Q and K before RoPE;
- five layers of every six attend within a sliding window of ``attention.sliding_window`` tokens
  with RoPE base 10000; every sixth layer is global with ``rope.freq_base`` (and linear
  ``rope.scaling.factor`` when present);
- RoPE NEOX, attention scale ``1/sqrt(key_length)``, tied output head unless ``output.weight``
  is in the file, optional final logit soft-capping.

llama.cpp's converter stores Gemma's norm weights with the ``+1`` already added, so every norm is
the plain ``x * w`` RMS norm.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

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
    rope_freqs_of,
)
from ggufswap.shards.keys import TensorNames


def sliding_window_mask(length: int, window: int, device: torch.device) -> Tensor:
    """``[T, T]`` bool, True where query ``i`` may attend key ``j``: ``0 <= i - j < window``."""
    pos = torch.arange(length, device=device)
    dist = pos[:, None] - pos[None, :]  # [T, T]: i - j
    return (dist >= 0) & (dist < window)


class Gemma3Block(nn.Module):
    """Pre- and post-normed attention and GeGLU FFN, each with a residual."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.config, self.weights = config, weights
        d = (config.n_embd,)
        self.local = config.is_local_layer(layer)
        self.attn_norm = spec.need(TensorNames.ATTN_NORM.format(layer), d)
        self.post_attn_norm = spec.need(TensorNames.ATTN_POST_NORM.format(layer), d)
        self.ffn_norm = spec.need(TensorNames.FFN_NORM.format(layer), d)
        self.post_ffw_norm = spec.need(TensorNames.FFN_POST_NORM.format(layer), d)
        self.attention = Attention(config, weights, layer, spec)
        self.feed_forward = FeedForward(config, weights, layer, spec)

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        w, eps = self.weights.weight, self.config.norm_eps
        a = self.attention(rms_norm(x, w(self.attn_norm), eps), rope, mask, cache)
        h = x + rms_norm(a, w(self.post_attn_norm), eps)
        f = self.feed_forward(rms_norm(h, w(self.ffn_norm), eps))
        return h + rms_norm(f, w(self.post_ffw_norm), eps)


class Gemma3Transformer(nn.Module):
    """The gemma3 decoder. ``forward(tokens [B, T]) -> logits [B, T, V]`` (float32)."""

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__()
        if config.arch is not Arch.GEMMA3:
            raise HParamsError(f"Gemma3Transformer runs gemma3, not {config.arch.value}")
        self.config, self.weights = config, weights
        spec = _Spec()
        rope_freqs_of(config, weights, spec)  # refused: gemma3's loader has no rope_freqs
        self.tok_embd = spec.need(TensorNames.TOKEN_EMBD, (config.n_vocab, config.n_embd))
        self.norm = spec.need(TensorNames.OUTPUT_NORM, (config.n_embd,))
        self.output = spec.need(output_name(config, weights), (config.n_vocab, config.n_embd))
        self.layers = nn.ModuleList(
            Gemma3Block(config, weights, i, spec) for i in range(config.n_layer)
        )
        self.rope_global = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)
        self.rope_local = RotaryEmbedding(config, base=config.rope_base_local)
        self.required = dict(spec.required)  # every tensor a forward reads, with its shape
        _check(weights, spec, shapes=check_shapes)

    def forward(
        self, tokens: Tensor, *, start_pos: int = 0, cache: KVCache | None = None
    ) -> Tensor:
        """Logits of ``tokens`` at positions ``start_pos ..``; with ``cache`` they also attend to
        the cached positions (``start_pos`` must be ``cache.length``) and are appended to it."""
        # tokens: [B, T] int64 -> logits: [B, T, V] float32
        c, w, seq = self.config, self.weights.weight, tokens.shape[1]
        x = embed(tokens, self.weights, self.tok_embd, c.embed_scale)  # [B, T, D]
        rope_global = self.rope_global(start_pos, seq, tokens.device)
        rope_local = self.rope_local(start_pos, seq, tokens.device)
        local_mask, global_mask = self._masks(start_pos, seq, tokens.device, cache)
        for layer in self.layers:
            assert isinstance(layer, Gemma3Block), "layers holds Gemma3Blocks only"
            if layer.local:
                x = layer(x, rope_local, local_mask, cache)
            else:
                x = layer(x, rope_global, global_mask, cache)
        if cache is not None:
            cache.advance(seq)
        x = rms_norm(x, w(self.norm), c.norm_eps)
        return lm_head(x, self.weights.matrix(self.output), c.final_logit_softcap)  # [B, T, V]

    def _masks(
        self, start_pos: int, seq: int, device: torch.device, cache: KVCache | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The local (sliding-window) and global layers' masks; None is plain causal."""
        window = self.config.sliding_window
        if cache is None:
            if window <= 0:  # no sliding window in the file: every layer is global (llama.cpp)
                return None, None
            # Every key is in this forward: the window depends on T only.
            if seq <= window:
                return None, None  # the window covers the whole sequence: plain causal attention
            return sliding_window_mask(seq, window, device), None
        cache.check_continues(start_pos, seq)
        # The keys are the cached positions then this forward's: queries sit at start_pos ...
        local = attention_mask(start_pos, seq, window=window, device=device)
        return local, attention_mask(start_pos, seq, device=device)

    def new_cache(self, *, max_len: int) -> KVCache:
        """An empty cache for one sequence of up to ``max_len`` positions (it grows past them)."""
        return KVCache(n_layer=self.config.n_layer, max_len=max_len)
