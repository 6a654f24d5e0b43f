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
from collections.abc import Mapping
from typing import Any, ClassVar, Final

import torch
from torch import Tensor, nn

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.attention import group_queries, sliding_window_mask
from ggufswap.runtime.models.blocks.decoder import DecoderStack, LayerInputs, TransformerBlock
from ggufswap.runtime.models.blocks.moe import combine_experts
from ggufswap.runtime.models.blocks.rope import RopeTables, rotary
from ggufswap.runtime.models.blocks.weights import Matrix, TensorSpec, WeightProvider, linear
from ggufswap.runtime.models.hparams import (
    ROPE_SCALING_LINEAR,
    ROPE_SCALING_YARN,
    Arch,
    HParams,
    KeyReader,
)
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.shards.keys import Keys, TensorNames

# build_moe_ffn's LLM_FFN_SWIGLU_OAI_MOE constants.
SWIGLU_ALPHA: Final = 1.702
SWIGLU_LIMIT: Final = 7.0
# gpt-oss (llama_model_openai_moe::load_arch_hparams): load_swa_pattern(ml, 2), so by default
# even layers slide and odd ones are global; both use rope.freq_base (rope.freq_base_swa when
# present) and the same scaling.
GPT_OSS_SWA_PERIOD: Final = 2
KEYS: Final = (
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    Keys.LLM.SLIDING_WINDOW,
    Keys.LLM.SLIDING_WINDOW_PATTERN,
    Keys.LLM.ROPE_FREQ_BASE_SWA,
    Keys.LLM.ROPE_SCALING_ATTN_FACTOR,
    Keys.LLM.ROPE_SCALING_ORIG_CTX_LEN,
)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_openai_moe::load_arch_hparams: the required expert width and sliding window,
    the window pattern (period 2 by default: even layers slide), the local RoPE base (default:
    rope.freq_base) and YaRN's context and magnitude (llama_model_base::load_hparams)."""
    n_layer, freq_scale = common["n_layer"], common["rope_freq_scale"]
    out: dict[str, Any] = {
        "n_ff_exp": reader.get_int(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        "sliding_window": reader.get_int(Keys.LLM.SLIDING_WINDOW),
    }
    key = Keys.LLM.SLIDING_WINDOW_PATTERN.format(reader.arch)
    pattern = reader.md.get(key, GPT_OSS_SWA_PERIOD)
    if isinstance(pattern, (list, tuple)):
        out["swa_layers"] = tuple(bool(v) for v in pattern)[:n_layer]
    else:
        out["swa_period"] = reader.get_int(Keys.LLM.SLIDING_WINDOW_PATTERN, GPT_OSS_SWA_PERIOD)
    base = reader.get_float(Keys.LLM.ROPE_FREQ_BASE, 10000.0)
    out["rope_base_local"] = reader.get_float(Keys.LLM.ROPE_FREQ_BASE_SWA, base)
    kind = reader.md.get(Keys.LLM.ROPE_SCALING_TYPE.format(reader.arch), ROPE_SCALING_LINEAR)
    return out | _yarn_cparams(reader, yarn=str(kind) == ROPE_SCALING_YARN, freq_scale=freq_scale)


def _yarn_cparams(reader: KeyReader, *, yarn: bool, freq_scale: float) -> dict[str, Any]:
    """llama_context's YaRN parameters: ext_factor 1 for yarn scaling; attn_factor
    ``get_mscale(factor) / (1 + 0.1 ln factor)`` under YaRN (ggml's rope_yarn multiplies the
    second factor back), times ``rope.scaling.attn_factor``; the original context."""
    factor = 1.0 / freq_scale
    attn_factor = 1.0
    if yarn:
        get_mscale = 0.1 * math.log(factor) + 1.0 if factor > 1.0 else 1.0
        attn_factor = get_mscale / (1.0 + 0.1 * math.log(factor))
    return {
        "rope_ext_factor": 1.0 if yarn else 0.0,
        "rope_attn_factor": attn_factor * reader.get_float(Keys.LLM.ROPE_SCALING_ATTN_FACTOR, 1.0),
        "rope_ctx_orig": reader.get_int(Keys.LLM.ROPE_SCALING_ORIG_CTX_LEN, 0),
    }


def swiglu_oai(gate: Tensor, up: Tensor) -> Tensor:
    """ggml_swiglu_oai: ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)`` and
    ``u = clamp(up, -limit, limit)``."""
    g = gate.clamp(max=SWIGLU_LIMIT)
    u = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return g * torch.sigmoid(SWIGLU_ALPHA * g) * (u + 1)


class SinkAttention(nn.Module):
    """Grouped-query attention with Q/K/V/output biases and one sink logit per head."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
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

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
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
        return combine_experts(flat, top_w, top_i, self.expert).view_as(x)


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


ARCHITECTURE = Architecture(
    arch=Arch.GPT_OSS, decoder=GptOssTransformer, read_keys=read_keys, keys=KEYS
)
