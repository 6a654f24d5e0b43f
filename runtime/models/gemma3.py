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

from ggufswap.runtime.models.hparams import Arch, HParams
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.runtime.models.llama import (
    Attention,
    DecoderStack,
    FeedForward,
    LayerInputs,
    RopeTables,
    RotaryEmbedding,
    WeightProvider,
    _Spec,
    rms_norm,
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


class Gemma3Transformer(DecoderStack):
    """The gemma3 decoder: sliding-window and global layers, each kind with its own RoPE base."""

    arch = Arch.GEMMA3
    block = Gemma3Block

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        self.rope_global = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)
        self.rope_local = RotaryEmbedding(config, base=config.rope_base_local)

    def layer_inputs(
        self, start: int, seq: int, device: torch.device, *, cached: bool
    ) -> list[LayerInputs]:
        """The local layers' window applies only when it is shorter than what they see."""
        local_mask, global_mask = self._masks(start, seq, device, cached=cached)
        return self.by_kind(
            local=(self.rope_local(start, seq, device), local_mask),
            global_=(self.rope_global(start, seq, device), global_mask),
        )

    def _masks(
        self, start_pos: int, seq: int, device: torch.device, *, cached: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """The local (sliding-window) and global layers' masks; None is plain causal."""
        window = self.config.sliding_window
        if not cached:
            if window <= 0:  # no sliding window in the file: every layer is global (llama.cpp)
                return None, None
            # Every key is in this forward: the window depends on T only.
            if seq <= window:
                return None, None  # the window covers the whole sequence: plain causal attention
            return sliding_window_mask(seq, window, device), None
        # The keys are the cached positions then this forward's: queries sit at start_pos ...
        local = attention_mask(start_pos, seq, window=window, device=device)
        return local, attention_mask(start_pos, seq, device=device)
