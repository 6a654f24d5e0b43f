"""Gemma 3 decoder (``general.architecture = gemma3``): llama.cpp's ``llama_model_gemma3``
(``src/models/gemma3.cpp``), its keys and its graph.

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

from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import Tensor, nn

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.attention import Attention, decode_keys, sliding_window_mask
from ggufswap.runtime.models.blocks.decoder import DecoderStack, LayerInputs, StepKind
from ggufswap.runtime.models.blocks.ffn import FeedForward
from ggufswap.runtime.models.blocks.ggml_steps import StepLayer, block_layer, block_tail, step_layer
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables, RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import TensorSpec, WeightProvider
from ggufswap.runtime.models.hparams import Arch, HParams, KeyReader
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.shards.keys import Keys, TensorNames

__all__ = ["ARCHITECTURE", "Gemma3Block", "Gemma3Transformer", "sliding_window_mask"]

# gemma3 (llama_model_gemma3::load_arch_hparams): load_swa_pattern(ml, 6), so by default every 6th
# layer is global and the others slide; local layers use rope.freq_base_swa (default 10000,
# llama_hparams::rope_freq_base_train_swa) without scaling.
GEMMA3_SWA_PERIOD: Final = 6
GEMMA3_ROPE_BASE_LOCAL: Final = 10000.0
# gemma3's attention scale is 1/sqrt(n_embd / n_head) for its 27B size (62 blocks), else
# 1/sqrt(key_length) (llama_model_gemma3::load_arch_hparams).
GEMMA3_27B_LAYERS: Final = 62
KEYS: Final = (
    Keys.LLM.SLIDING_WINDOW,
    Keys.LLM.SLIDING_WINDOW_PATTERN,
    Keys.LLM.ROPE_FREQ_BASE_SWA,
    Keys.LLM.FINAL_LOGIT_SOFTCAPPING,
)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_gemma3::load_arch_hparams: sliding window (absent or 0 = every layer global),
    its pattern, the local RoPE base, soft-capping and the attention scale."""
    n_layer, n_embd, n_head = common["n_layer"], common["n_embd"], common["n_head"]
    out: dict[str, Any] = {
        "sliding_window": reader.get_int(Keys.LLM.SLIDING_WINDOW, 0),
        "final_logit_softcap": reader.get_float(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0),
    }
    if out["sliding_window"] > 0:
        key = Keys.LLM.SLIDING_WINDOW_PATTERN.format(reader.arch)
        pattern = reader.md.get(key, GEMMA3_SWA_PERIOD)
        if isinstance(pattern, (list, tuple)):
            out["swa_layers"] = tuple(bool(v) for v in pattern)[:n_layer]
        else:
            out["swa_period"] = reader.get_int(Keys.LLM.SLIDING_WINDOW_PATTERN, GEMMA3_SWA_PERIOD)
        out["rope_base_local"] = reader.get_float(
            Keys.LLM.ROPE_FREQ_BASE_SWA, GEMMA3_ROPE_BASE_LOCAL
        )
    if n_layer == GEMMA3_27B_LAYERS and n_head > 0:
        out["attention_scale"] = float(n_embd // n_head) ** -0.5  # uint32 division in llama.cpp
    return out


class Gemma3Block(nn.Module):
    """Pre- and post-normed attention and GeGLU FFN, each with a residual."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights = config, weights
        d = (config.n_embd,)
        self.attn_norm = spec.need(TensorNames.ATTN_NORM.format(layer), d)
        self.post_attn_norm = spec.need(TensorNames.ATTN_POST_NORM.format(layer), d)
        self.ffn_norm = spec.need(TensorNames.FFN_NORM.format(layer), d)
        self.post_ffw_norm = spec.need(TensorNames.FFN_POST_NORM.format(layer), d)
        self.attention = Attention(config, weights, layer, spec)
        self.attention.scale_q = True  # llama.cpp: Qcur = ggml_scale(Qcur, f_attention_scale)
        self.feed_forward = FeedForward(config, weights, layer, spec)

    def step_layer(self, kind: int) -> StepLayer | None:
        """This block's part of a one-call decode step in ggml's numerics (of ``kind``: which
        RoPE and keys it reads), or None (:func:`~.ggml_steps.step_layer`)."""
        norms4 = (self.attn_norm, self.post_attn_norm, self.ffn_norm, self.post_ffw_norm)
        return step_layer(self.weights, (self.attention, self.feed_forward), norms4, kind)

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        w, eps = self.weights.weight, self.config.norm_eps
        if cache is not None and x.shape[1] == 1:  # a decode step: in ggml's numerics one call
            keys = decode_keys(mask, cache.length + 1)
            norms4 = (self.attn_norm, self.post_attn_norm, self.ffn_norm, self.post_ffw_norm)
            parts = (self.attention, self.feed_forward)
            y = block_layer(
                self.weights, x, parts, norms4, rope=rope, keys=keys, cache=cache, eps=eps
            )
            if y is not None:
                return y
        a = self.attention.normed_heads(x, self.attn_norm, rope, mask, cache)
        norms = (self.post_attn_norm, self.ffn_norm, self.post_ffw_norm)
        y = block_tail(self.weights, x, a, self.attention, self.feed_forward, norms=norms, eps=eps)
        if y is not None:  # ggml's numerics: the rest in one compiled call, the same bits
            return y
        h = x + rms_norm(self.attention.project(a), w(self.post_attn_norm), eps)
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

    def step_kinds(self) -> list[StepKind] | None:
        """The local blocks' RoPE and window, the global blocks' RoPE and every key (what
        :meth:`layer_inputs` gives a one-token step)."""
        if type(self).layer_inputs is not Gemma3Transformer.layer_inputs:
            return None
        window = max(self.config.sliding_window, 0)
        return self.by_kind(local=(self.rope_local, window), global_=(self.rope_global, 0))

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


ARCHITECTURE = Architecture(
    arch=Arch.GEMMA3, decoder=Gemma3Transformer, read_keys=read_keys, keys=KEYS
)
