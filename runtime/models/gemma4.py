"""Gemma 4 (``general.architecture = gemma4``): llama.cpp's ``llama_model_gemma4``
(``src/models/gemma4.cpp``), its keys, its graph and its per-layer attention shapes.

- ``attention.sliding_window_pattern`` (per-layer flags, required) marks the sliding-window
  layers (a query sees the last ``attention.sliding_window`` positions): heads of
  ``attention.key_length_swa``, ``rope.dimension_count_swa`` rotated dims, RoPE base
  ``rope.freq_base_swa`` unscaled. The others attend to every earlier position: heads of
  ``attention.key_length``, RoPE base ``rope.freq_base`` (and the file's scaling) with the
  ``rope_freqs`` factors (required: Gemma 4's "proportional" RoPE, whose unrotated pairs have a
  factor of 1e30). ``attention.head_count_kv`` may differ per layer.
- Attention: per-head RMS norms of Q and K (weighted) and of V (unweighted, V being K's
  projection when the layer has no ``attn_v``: Gemma 4 31B's full layers), NEOX RoPE, softmax
  scale 1, then ``post_attention_norm`` before the residual.
- FFN: GeGLU of ``ffn_norm(h)``. Blocks with a router (``ffn_gate_inp``) add routed experts:
  the router reads ``rms_norm(h) / sqrt(n_embd) * ffn_gate_inp.scale``, softmax over every
  expert, top-k renormalised; the experts (GeGLU, stacked or fused ``ffn_gate_up_exps``, each
  output times its ``ffn_down_exps.scale``) read ``pre_ffw_norm_2(h)``; the block's FFN output is
  ``post_ffw_norm_1(mlp) + post_ffw_norm_2(experts)``. Then ``post_ffw_norm`` and the residual,
  times ``layer_output_scale`` when present.
- Embeddings times ``sqrt(n_embd)``, tied output allowed, optional final soft-capping.

Not implemented, refused by name: per-layer embeddings (``embedding_length_per_layer_input`` >
0, Gemma 4 E2B/E4B), layers sharing earlier layers' keys and values
(``attention.shared_kv_layers`` > 0), the fused ``attn_qkv`` form, and the per-tensor weight
scales (``.scale``) llama.cpp's loader reads beside any matrix but the experts' down projection
(``blocks.weights.refuse_weight_scales``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import torch
from torch import Tensor, nn

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.attention import attend, sliding_window_mask
from ggufswap.runtime.models.blocks.decoder import DecoderStack, LayerInputs
from ggufswap.runtime.models.blocks.ffn import FeedForward, geglu
from ggufswap.runtime.models.blocks.moe import WEIGHTS_SUM_MIN, combine_experts
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables, RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import (
    TensorSpec,
    WeightProvider,
    linear,
    refuse_weight_scales,
)
from ggufswap.runtime.models.errors import MissingWeightError
from ggufswap.runtime.models.hparams import Arch, HParams, KeyReader
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.shards.keys import Keys, TensorNames

TN: Final = TensorNames
ROPE_BASE_SWA: Final = 10000.0  # llama_hparams::rope_freq_base_train_swa's default
KEYS: Final = (
    Keys.LLM.SLIDING_WINDOW,
    Keys.LLM.SLIDING_WINDOW_PATTERN,
    Keys.LLM.SHARED_KV_LAYERS,
    Keys.LLM.EMBEDDING_LENGTH_PER_LAYER,
    Keys.LLM.KEY_LENGTH_SWA,
    Keys.LLM.VALUE_LENGTH_SWA,
    Keys.LLM.ROPE_DIMENSION_COUNT_SWA,
    Keys.LLM.ROPE_FREQ_BASE_SWA,
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    Keys.LLM.FINAL_LOGIT_SOFTCAPPING,
)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_gemma4::load_arch_hparams (see the module docstring)."""
    k, a, n_layer = Keys.LLM, reader.arch, common["n_layer"]
    pattern = reader.md.get(k.SLIDING_WINDOW_PATTERN.format(a))
    if not isinstance(pattern, (list, tuple)) or len(pattern) < n_layer:
        reader.problems.append(f"{k.SLIDING_WINDOW_PATTERN.format(a)}: one flag per layer required")
        pattern = [True] * n_layer
    for key, what in (
        (k.SHARED_KV_LAYERS, "layers reusing earlier layers' keys and values (Gemma 4 E2B/E4B)"),
        (k.EMBEDDING_LENGTH_PER_LAYER, "per-layer embeddings (Gemma 4 E2B/E4B)"),
    ):
        default = 0 if key is k.SHARED_KV_LAYERS else None
        value = reader.get_int(key) if default is None else reader.get_int(key, default)
        if value:
            reader.problems.append(
                f"{key.format(a)} = {value}: {what} are not implemented by the reference decoder"
            )
    head_swa = reader.get_int(k.KEY_LENGTH_SWA)
    if reader.get_int(k.VALUE_LENGTH_SWA) != head_swa:
        reader.problems.append("Gemma 4 requires n_embd_head_k_swa == n_embd_head_v_swa")
    head = common["key_length"] or common["n_embd"] // max(common["n_head"], 1)
    full_rot = common["rope_dim"] or head
    kv = reader.md.get(k.HEAD_COUNT_KV.format(a), common["n_head_kv"])
    kv_layers = tuple(int(v) for v in kv)[:n_layer] if isinstance(kv, (list, tuple)) else None
    return {
        "sliding_window": reader.get_int(k.SLIDING_WINDOW),
        "swa_layers": tuple(bool(v) for v in pattern)[:n_layer],
        "head_dim_swa": head_swa,
        "rope_dim_swa": reader.get_int(k.ROPE_DIMENSION_COUNT_SWA, full_rot),
        "n_head_kv_layers": kv_layers,
        "rope_base_local": reader.get_float(k.ROPE_FREQ_BASE_SWA, ROPE_BASE_SWA),
        "n_ff_exp": reader.get_int(k.EXPERT_FEED_FORWARD_LENGTH, 0),
        "final_logit_softcap": reader.get_float(k.FINAL_LOGIT_SOFTCAPPING, 0.0),
        "attention_scale": 1.0,  # f_attention_scale: the Q norm replaces the 1/sqrt(d) scaling
    }


def layer_config(config: HParams, layer: int) -> HParams:
    """The config of one layer: its head width, rotated dims and key/value heads."""
    swa = config.is_local_layer(layer)
    kv = config.n_head_kv if config.n_head_kv_layers is None else config.n_head_kv_layers[layer]
    head = config.head_dim_swa if swa and config.head_dim_swa else config.head_dim
    rot = config.rope_dim_swa if swa and config.rope_dim_swa else config.n_rot
    return dataclasses.replace(config, key_length=head, rope_dim=rot, n_head_kv=kv)


class Gemma4Attention(nn.Module):
    """Q/K/V-normed grouped-query attention (V = K's projection without ``attn_v``)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights, self.layer = config, weights, layer
        d, hd = config.n_embd, config.head_dim
        q_dim, kv_dim = config.n_head * hd, config.n_head_kv * hd
        self.wq = spec.need(TN.ATTN_Q.format(layer, "weight"), (q_dim, d))
        self.wk = spec.need(TN.ATTN_K.format(layer, "weight"), (kv_dim, d))
        self.wv = spec.maybe(weights, TN.ATTN_V.format(layer, "weight"), (kv_dim, d))
        self.wo = spec.need(TN.ATTN_OUT.format(layer, "weight"), (d, q_dim))
        self.q_norm = spec.need(TN.ATTN_Q_NORM.format(layer), (hd,))
        self.k_norm = spec.need(TN.ATTN_K_NORM.format(layer), (hd,))
        fused = TN.ATTN_QKV.format(layer)
        spec.refuse(weights, [fused], "gemma4's fused attn_qkv form is not implemented")

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        c, w = self.config, self.weights
        (bsz, seq, _), hd = x.shape, c.head_dim
        q = linear(x, w.matrix(self.wq)).view(bsz, seq, c.n_head, hd)
        k = linear(x, w.matrix(self.wk)).view(bsz, seq, c.n_head_kv, hd)
        v = k if self.wv is None else linear(x, w.matrix(self.wv)).view(bsz, seq, c.n_head_kv, hd)
        q = rope.rotate(rms_norm(q, w.weight(self.q_norm), c.norm_eps))
        k = rope.rotate(rms_norm(k, w.weight(self.k_norm), c.norm_eps))
        v = rms_norm(v, torch.ones(hd), c.norm_eps)
        y = attend(q, k, v, layer=self.layer, scale=c.attn_scale, mask=mask, cache=cache)
        return linear(y, w.matrix(self.wo))  # [B, T, D]


class Gemma4Experts(nn.Module):
    """The routed half of a Gemma 4 MoE block (see the module docstring)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights = config, weights
        d, n_exp, ff = config.n_embd, config.n_expert, config.n_ff_exp
        self.router = spec.need(TN.FFN_GATE_INP.format(layer), (n_exp, d))
        self.router_scale = spec.need(TN.FFN_GATE_INP_SCALE.format(layer), (d,))
        self.gate_up: str | None = spec.maybe(
            weights, TN.FFN_GATE_UP_EXPS.format(layer), (n_exp, 2 * ff, d)
        )
        if self.gate_up is None:
            self.gate_exps = spec.need_experts(TN.FFN_GATE_EXPS.format(layer), (n_exp, ff, d))
            self.up_exps = spec.need_experts(TN.FFN_UP_EXPS.format(layer), (n_exp, ff, d))
        self.down_exps = spec.need_experts(TN.FFN_DOWN_EXPS.format(layer), (n_exp, d, ff))
        self.down_scale = spec.maybe(weights, TN.FFN_DOWN_EXPS_SCALE.format(layer), (n_exp,))
        # 1.0f / sqrtf((float) n_embd), in float as ggml_scale takes it
        self.logit_scale = float(np.float32(1.0) / np.sqrt(np.float32(d)))

    def route(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """``([N, k], [N, k])`` from the block's attention output ``h`` ``[N, D]``."""
        w, c = self.weights.weight, self.config
        tmp = rms_norm(h, torch.ones(c.n_embd), c.norm_eps) * self.logit_scale
        tmp = tmp * w(self.router_scale).to(tmp.device, torch.float32)
        probs = linear(tmp, w(self.router)).float().softmax(dim=-1)  # [N, E]
        top_w, top_i = probs.topk(c.n_expert_used, dim=-1)
        return top_w / top_w.sum(-1, keepdim=True).clamp(min=WEIGHTS_SUM_MIN), top_i

    def expert(self, x: Tensor, e: int) -> Tensor:
        """GeGLU expert ``e`` on rows ``x``, times its ``ffn_down_exps.scale``."""
        w = self.weights.experts
        down = w(self.down_exps)[e]
        if self.gate_up is None:
            y = geglu(x, w(self.gate_exps)[e], w(self.up_exps)[e], down)
        else:  # one product, then the gate's rows and the up's rows
            gu = linear(x, w(self.gate_up)[e])
            ff = gu.shape[-1] // 2
            y = linear(
                torch.nn.functional.gelu(gu[..., :ff], approximate="tanh") * gu[..., ff:], down
            )
        if self.down_scale is not None:
            y = y * self.weights.weight(self.down_scale)[e].to(y.device, y.dtype)
        return y

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        # x (pre_ffw_norm_2(h)), h: [B, T, D]
        flat = x.reshape(-1, x.shape[-1])
        top_w, top_i = self.route(h.reshape(-1, h.shape[-1]))
        return combine_experts(flat, top_w, top_i, self.expert).view_as(x)


class Gemma4Block(nn.Module):
    """Attention with its post-norm, the dense GeGLU (and experts), the post-FFN norm."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights = config, weights
        d = (config.n_embd,)
        self.attn_norm = spec.need(TN.ATTN_NORM.format(layer), d)
        self.post_attn_norm = spec.need(TN.ATTN_POST_NORM.format(layer), d)
        self.ffn_norm = spec.need(TN.FFN_NORM.format(layer), d)
        self.post_ffw_norm = spec.need(TN.FFN_POST_NORM.format(layer), d)
        self.out_scale = spec.maybe(weights, TN.LAYER_OUT_SCALE.format(layer), (1,))
        self.attention = Gemma4Attention(layer_config(config, layer), weights, layer, spec)
        self.mlp = FeedForward(config, weights, layer, spec)
        refuse_weight_scales(spec, weights, layer, read=("ffn_down_exps",))
        self.experts: Gemma4Experts | None = None
        moe_norms = [TN.FFN_PRE_NORM_2, TN.FFN_POST_NORM_1, TN.FFN_POST_NORM_2]
        if weights.has(TN.FFN_GATE_INP.format(layer)):  # has_expert: the router decides
            self.experts = Gemma4Experts(config, weights, layer, spec)
            self.pre_norm_2, self.post_norm_1, self.post_norm_2 = (
                spec.need(t.format(layer), d) for t in moe_norms
            )
        else:
            spec.refuse(weights, [t.format(layer) for t in moe_norms], "no router in this block")

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        w, eps = self.weights.weight, self.config.norm_eps
        a = self.attention(rms_norm(x, w(self.attn_norm), eps), rope, mask, cache)
        h = x + rms_norm(a, w(self.post_attn_norm), eps)
        f = self.mlp(rms_norm(h, w(self.ffn_norm), eps))
        if self.experts is not None:
            routed = self.experts(rms_norm(h, w(self.pre_norm_2), eps), h)
            f = rms_norm(f, w(self.post_norm_1), eps) + rms_norm(routed, w(self.post_norm_2), eps)
        out = h + rms_norm(f, w(self.post_ffw_norm), eps)
        return out if self.out_scale is None else out * w(self.out_scale).to(out.dtype)


class Gemma4Transformer(DecoderStack):
    """The gemma4 decoder: sliding-window and full layers, each kind with its own heads and
    RoPE; the full layers' ``rope_freqs`` read at every forward (a swap is the next batch's)."""

    arch = Arch.GEMMA4
    block = Gemma4Block

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        full = [i for i in range(self.n_trunk) if not config.is_local_layer(i)]
        if full and self.rope_freqs is None:
            raise MissingWeightError(
                f"{TN.ROPE_FREQS}: missing; gemma4's full-attention layers {full} rotate by its "
                "factors (llama.cpp creates it as required)"
            )
        swa_rot = config.rope_dim_swa or config.n_rot
        self.rope_local = RotaryEmbedding(config, base=config.rope_base_local, n_rot=swa_rot)
        self.rope = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)

    def layer_inputs(
        self, start: int, seq: int, device: torch.device, *, cached: bool
    ) -> list[LayerInputs]:
        """Sliding layers: their window and RoPE; full layers: causal, RoPE with the factors."""
        window = self.config.sliding_window
        if cached:
            local_mask = attention_mask(start, seq, window=window, device=device)
            global_mask = attention_mask(start, seq, device=device)
        else:
            local_mask = sliding_window_mask(seq, window, device) if seq > window else None
            global_mask = None
        factors = None if self.rope_freqs is None else self.weights.weight(self.rope_freqs)
        full = self.rope(start, seq, device, factors=factors)
        return self.by_kind(
            local=(self.rope_local(start, seq, device), local_mask), global_=(full, global_mask)
        )


ARCHITECTURE = Architecture(
    arch=Arch.GEMMA4, decoder=Gemma4Transformer, read_keys=read_keys, keys=KEYS
)
