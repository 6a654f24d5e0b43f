"""gpt-oss decoder (``general.architecture = gpt-oss``), built from ``llama``'s blocks.

Follows llama.cpp's ``llama_model_openai_moe`` graph (``src/models/openai-moe.cpp``):

- per block: ``h = x + attn(attn_norm(x))`` then ``out = h + moe(post_attention_norm(h))``;
- attention with Q/K/V/output biases and a learned **sink** per head: a logit that joins every
  query's softmax but attends to nothing (ggml_soft_max_add_sinks), scale ``1/sqrt(n_rot)``;
- even layers (llama.cpp's pattern of 2, or ``attention.sliding_window_pattern``) attend within
  ``attention.sliding_window`` tokens, the others globally; RoPE NEOX with ``rope.freq_base``
  (local layers: ``rope.freq_base_swa`` when present), both scaled alike (YaRN in gpt-oss's files);
- MoE in every block: a biased router, top-k over the router **logits**, softmax over the k chosen
  (llama.cpp's SOFTMAX_WEIGHT gating, not renormalised again), biased experts and the clamped
  SwiGLU ``swiglu_oai`` (alpha 1.702, limit 7);
- ``output.weight`` is required (no tied head).
"""

from __future__ import annotations

import math
from typing import ClassVar, Final

import numpy as np
import torch
from torch import Tensor, nn

from ggufswap.runtime.models.attention import group_queries
from ggufswap.runtime.models.gemma3 import sliding_window_mask
from ggufswap.runtime.models.hparams import Arch, HParams
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.runtime.models.llama import (
    DecoderStack,
    LayerInputs,
    Matrix,
    RopeTables,
    RotaryEmbedding,
    TransformerBlock,
    WeightProvider,
    _Spec,
    linear,
)
from ggufswap.shards.keys import TensorNames

# build_moe_ffn's LLM_FFN_SWIGLU_OAI_MOE constants.
SWIGLU_ALPHA: Final = 1.702
SWIGLU_LIMIT: Final = 7.0
# llama_hparams' YaRN defaults (gpt-oss's loader reads no yarn_beta_* keys).
YARN_BETA_FAST: Final = 32.0
YARN_BETA_SLOW: Final = 1.0


def swiglu_oai(gate: Tensor, up: Tensor) -> Tensor:
    """ggml_swiglu_oai: ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)`` and
    ``u = clamp(up, -limit, limit)``."""
    g = gate.clamp(max=SWIGLU_LIMIT)
    u = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return g * torch.sigmoid(SWIGLU_ALPHA * g) * (u + 1)


class YarnRotaryEmbedding(RotaryEmbedding):
    """RoPE tables as ggml_rope's ``rope_yarn`` computes them. With YaRN (``rope_ext_factor`` 1)
    pair ``i`` mixes the interpolated angle ``freq_scale * theta`` and the original ``theta`` by a
    ramp over the correction dims of the original context, and cos/sin are scaled by
    ``rope_attn_factor * (1 + 0.1 ln(1/freq_scale))``; without, the angle is the interpolated one
    and the scale ``rope_attn_factor``. ``base``: the layer's RoPE base (it sets the dims too)."""

    def __init__(self, config: HParams, *, base: float) -> None:
        self.ext_factor = config.rope_ext_factor
        self.mscale = config.rope_attn_factor
        if self.ext_factor != 0.0:
            self.mscale *= 1.0 + 0.1 * math.log(1.0 / config.rope_freq_scale)
        orig_ctx = config.rope_ctx_orig or config.context_length
        self.corr_dims = yarn_corr_dims(config.n_rot, orig_ctx, base)
        super().__init__(config, base=base, freq_scale=config.rope_freq_scale)

    def _extend(self, n_pos: int) -> None:
        half = self.n_rot // 2
        i = torch.arange(half, dtype=torch.float64)
        theta_extrap = torch.outer(
            torch.arange(n_pos, dtype=torch.float64), self.base ** (-2.0 * i / self.n_rot)
        )  # [P, n_rot/2]
        low, high = self.corr_dims
        ramp = 1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)  # [n_rot/2]
        ramp = ramp * self.ext_factor
        theta = self.freq_scale * theta_extrap * (1.0 - ramp) + theta_extrap * ramp
        cos, sin = theta.cos() * self.mscale, theta.sin() * self.mscale
        self._tables = {torch.device("cpu"): (cos.float(), sin.float())}
        self._n_pos = n_pos


def yarn_corr_dims(n_dims: int, orig_ctx: int, base: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims in float32: the pairs below ``low`` keep their angle, those above
    ``high`` are interpolated."""
    f32 = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        num = f32(n_dims) * np.log(f32(orig_ctx) / (f32(n_rot) * f32(2) * f32(math.pi)))
        return f32(num / (f32(2) * np.log(f32(base))))

    low = max(0.0, float(np.floor(corr_dim(YARN_BETA_FAST))))
    high = min(float(n_dims - 1), float(np.ceil(corr_dim(YARN_BETA_SLOW))))
    return low, high


def rotary(config: HParams, base: float) -> RotaryEmbedding:
    """The RoPE tables of one kind of layer: YaRN when the file says so, else linear (with
    ``rope.scaling.attn_factor`` as ggml's ``attn_factor`` when it is not 1)."""
    if config.rope_ext_factor != 0.0 or config.rope_attn_factor != 1.0:
        return YarnRotaryEmbedding(config, base=base)
    return RotaryEmbedding(config, base=base, freq_scale=config.rope_freq_scale)


class SinkAttention(nn.Module):
    """Grouped-query attention with Q/K/V/output biases and one sink logit per head."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.config, self.weights, self.layer = config, weights, layer
        d, hd, tn = config.n_embd, config.head_dim, TensorNames
        q_dim, kv_dim = config.n_head * hd, config.n_head_kv * hd
        self.wq = spec.need(tn.ATTN_Q.format(layer, "weight"), (q_dim, d))
        self.wk = spec.need(tn.ATTN_K.format(layer, "weight"), (kv_dim, d))
        self.wv = spec.need(tn.ATTN_V.format(layer, "weight"), (kv_dim, d))
        self.wo = spec.need(tn.ATTN_OUT.format(layer, "weight"), (d, q_dim))
        self.bq = spec.maybe(weights, tn.ATTN_Q.format(layer, "bias"), (q_dim,))
        self.bk = spec.maybe(weights, tn.ATTN_K.format(layer, "bias"), (kv_dim,))
        self.bv = spec.maybe(weights, tn.ATTN_V.format(layer, "bias"), (kv_dim,))
        self.bo = spec.need(tn.ATTN_OUT.format(layer, "bias"), (d,))
        self.sinks = spec.need(tn.ATTN_SINKS.format(layer), (config.n_head,))

    def _proj(self, x: Tensor, w: str, b: str | None) -> Tensor:
        return linear(x, self.weights.matrix(w), None if b is None else self.weights.weight(b))

    def forward(self, x: Tensor, rope: RopeTables, mask: Tensor, cache: KVCache | None) -> Tensor:
        """``mask``: ``[T, S]`` bool, True where a query may attend a key."""
        # x: [B, T, D]
        c, (bsz, seq, _) = self.config, x.shape
        q = self._proj(x, self.wq, self.bq).view(bsz, seq, c.n_head, c.head_dim)
        k = self._proj(x, self.wk, self.bk).view(bsz, seq, c.n_head_kv, c.head_dim)
        v = self._proj(x, self.wv, self.bv).view(bsz, seq, c.n_head_kv, c.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (rope.rotate(q), rope.rotate(k), v))  # [B,H,T,hd]
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # [B, Hkv, S, hd]
        grouped = group_queries(q.float(), c.n_head_kv)  # [B, Hkv, g*T, hd]: no K/V copies
        scores = (grouped @ k.float().transpose(-1, -2)) * c.attn_scale  # [B, Hkv, g*T, S]
        scores = scores.view(bsz, c.n_head, seq, -1).masked_fill(~mask, float("-inf"))
        sink = self.weights.weight(self.sinks).to(scores.device, torch.float32)
        sink = sink.view(1, -1, 1, 1).expand(bsz, -1, seq, 1)  # [B, H, T, 1]
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]  # the sink drops out
        y = group_queries(probs, c.n_head_kv) @ v.float()  # [B, Hkv, g*T, hd]
        y = y.view(bsz, c.n_head, seq, -1).to(x.dtype).transpose(1, 2)
        y = y.reshape(bsz, seq, c.n_head * c.head_dim)
        return self._proj(y, self.wo, self.bo)  # [B, T, D]


class BiasedMoE(nn.Module):
    """Biased router -> top-k logits -> softmax over them -> biased experts with swiglu_oai."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.config, self.weights = config, weights
        tn, d, n_exp, ff = TensorNames, config.n_embd, config.n_expert, config.n_ff_exp
        self.router = spec.need(tn.FFN_GATE_INP.format(layer), (n_exp, d))
        self.router_b = spec.need(tn.FFN_GATE_INP_BIAS.format(layer), (n_exp,))
        self.gate = spec.need_experts(tn.FFN_GATE_EXPS.format(layer), (n_exp, ff, d))
        self.up = spec.need_experts(tn.FFN_UP_EXPS.format(layer), (n_exp, ff, d))
        self.down = spec.need_experts(tn.FFN_DOWN_EXPS.format(layer), (n_exp, d, ff))
        self.gate_b = spec.need_experts(tn.FFN_GATE_EXPS_BIAS.format(layer), (n_exp, ff))
        self.up_b = spec.need_experts(tn.FFN_UP_EXPS_BIAS.format(layer), (n_exp, ff))
        self.down_b = spec.need_experts(tn.FFN_DOWN_EXPS_BIAS.format(layer), (n_exp, d))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k expert weights and ids per token: ``([N, k] float32, [N, k] int64)``."""
        # x: [N, D]
        w = self.weights.weight
        logits = linear(x, w(self.router), w(self.router_b)).float()  # [N, E]
        top_logits, top_i = logits.topk(self.config.n_expert_used, dim=-1)  # [N, k]
        return top_logits.softmax(dim=-1), top_i

    def expert(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` applied to rows ``x``."""
        w = self.weights.experts
        gate = _biased(x, w(self.gate)[e], w(self.gate_b)[e])
        up = _biased(x, w(self.up)[e], w(self.up_b)[e])
        return _biased(swiglu_oai(gate, up), w(self.down)[e], w(self.down_b)[e])

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, T, D]
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        top_w, top_i = self.route(flat)  # [N, k]
        out = torch.zeros_like(flat)
        for e in top_i.unique().tolist():  # ascending expert order: deterministic sums
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            y = self.expert(flat[rows], e) * top_w[rows, slot, None].to(flat.dtype)
            out.index_add_(0, rows, y)
        return out.view_as(x)


def _biased(x: Tensor, w: Matrix, b: Tensor | Matrix) -> Tensor:
    """``x @ w.T + b`` (an expert's bias row)."""
    assert isinstance(b, Tensor), "expert biases are plain F32 rows"
    return linear(x, w, b)


class GptOssBlock(TransformerBlock):
    """Attention with sinks, then the biased MoE normed by post_attention_norm."""

    ffn_norm_name: ClassVar[str] = TensorNames.ATTN_POST_NORM
    attention_cls = SinkAttention

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        return BiasedMoE


class GptOssTransformer(DecoderStack):
    """The gpt-oss decoder: sliding-window and global layers, each kind with its own RoPE."""

    arch = Arch.GPT_OSS
    block = GptOssBlock

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        local_base = config.rope_base_local or config.rope_base
        self.rope_global = rotary(config, config.rope_base)
        self.rope_local = rotary(config, local_base)

    def layer_inputs(
        self, start: int, seq: int, device: torch.device, *, cached: bool
    ) -> list[LayerInputs]:
        """Sink attention always takes a mask: windowed in the local layers."""
        window = self.config.sliding_window
        local_mask = _mask(start, seq, window, device, cached=cached)
        global_mask = _mask(start, seq, 0, device, cached=cached)
        return self.by_kind(
            local=(self.rope_local(start, seq, device), local_mask),
            global_=(self.rope_global(start, seq, device), global_mask),
        )


def _mask(start: int, seq: int, window: int, device: torch.device, *, cached: bool) -> Tensor:
    """``[T, S]`` bool, True where a query may attend a key (causal; within ``window`` tokens
    when > 0): over the cached positions and this forward's, or over this forward's alone."""
    if cached:
        mask = attention_mask(start, seq, window=window, device=device)
        if mask is not None:
            return mask
    if window > 0:
        return sliding_window_mask(seq, window, device)
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
