"""DeepSeek V2/V3/R1 and Kimi-K2 decoder (``general.architecture = deepseek2``).

Follows llama.cpp's ``llama_model_deepseek2::graph`` (``src/models/deepseek2.cpp``) and its
``build_moe_ffn`` (``src/llama-graph.cpp``):

- multi-head latent attention: ``q`` from ``attn_q`` or ``attn_q_a`` -> ``attn_q_a_norm`` ->
  ``attn_q_b``; ``attn_kv_a_mqa`` gives the compressed latent (RMS-normed by
  ``attn_kv_a_norm``) and one shared rope key. Files with ``attn_k_b`` / ``attn_v_b`` run the
  absorbed form (queries multiplied into the latent space, one shared key/value head: the cache
  holds the latent); files with the older ``attn_kv_b`` decompress per-head keys and values;
- RoPE NORM (adjacent pairs) on the last ``rope.dimension_count`` dims of each query head and on
  the shared rope key, with linear or YaRN scaling, and the softmax scale
  ``mscale^2 / sqrt(head_k)`` llama.cpp applies (``hparams._yarn``);
- blocks ``[0, leading_dense_block_count)`` dense SwiGLU, the others routed experts plus the
  ungated shared experts; routing by softmax or sigmoid, the optional ``exp_probs_b`` bias for
  selection only, group-limited (``expert_group_count`` / ``_used_count``), weights optionally
  renormalised and scaled (``expert_weights_norm`` / ``_scale``);
- NextN/MTP blocks (``nextn_predict_layers``) are never computed (``unused``).

Every weight is read from the provider at forward time, the MLA matrices too: nothing is derived
at load, so a swap of ``attn_kv_b``, ``attn_k_b`` or ``attn_v_b`` is what the next batch uses.
"""

from __future__ import annotations

import math
from typing import Final

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor, nn

from ggufswap.runtime.models import llama as base
from ggufswap.runtime.models.ggml_numerics import GgmlWeights
from ggufswap.runtime.models.hparams import Arch, Gating, HParams, MLAShape
from ggufswap.runtime.models.kv_cache import KVCache
from ggufswap.runtime.models.llama import (
    DecoderStack,
    ExpertStack,
    FeedForward,
    RopeTables,
    RotaryEmbedding,
    TransformerBlock,
    WeightProvider,
    _Spec,
    rms_norm,
)
from ggufswap.shards.keys import TensorNames

TN: Final = TensorNames
# build_moe_ffn clamps the sum of the selected weights to the smallest normal F16 before dividing.
WEIGHTS_SUM_MIN = 6.103515625e-5


class YarnRotaryEmbedding(RotaryEmbedding):
    """ggml's ``rope_yarn`` tables over ``n_rot`` dims: theta mixes the interpolated
    (``freq_scale``) and extrapolated angles along the correction ramp when ``ext_factor`` != 0,
    and cos/sin carry the magnitude ``attn_factor`` (times ``1 + 0.1 ln(1/freq_scale)`` under
    YaRN)."""

    def __init__(self, config: HParams, n_rot: int) -> None:
        self.config = config
        super().__init__(config, n_rot=n_rot, freq_scale=config.rope_freq_scale)

    def _extend(self, n_pos: int) -> None:
        c, n = self.config, self.n_rot
        pair = torch.arange(0, n // 2, dtype=torch.float64)  # i0 / 2
        theta_extrap = torch.outer(
            torch.arange(n_pos, dtype=torch.float64), c.rope_base ** (-2.0 * pair / n)
        )  # [P, n/2]
        theta = theta_extrap * c.rope_freq_scale
        mscale = c.rope_attn_factor
        if c.rope_ext_factor != 0.0:
            low, high = _yarn_corr_dims(c, n)
            y = (pair - low) / max(0.001, high - low)
            ramp = (1.0 - y.clamp(0.0, 1.0)) * c.rope_ext_factor
            theta = theta * (1.0 - ramp) + theta_extrap * ramp
            mscale *= 1.0 + 0.1 * math.log(1.0 / c.rope_freq_scale)
        cos, sin = (theta.cos() * mscale).float(), (theta.sin() * mscale).float()
        self._tables = {torch.device("cpu"): (cos, sin)}
        self._n_pos = n_pos


def _yarn_corr_dims(c: HParams, n_dims: int) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the dims where the ramp between extrapolation and interpolation
    starts and ends."""
    n_ctx_orig = c.rope_ctx_orig or c.context_length

    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(c.rope_base))

    start = math.floor(corr_dim(c.yarn_beta_fast))
    end = math.ceil(corr_dim(c.yarn_beta_slow))
    return max(0.0, start), min(n_dims - 1.0, end)


def head_linear(x: Tensor, w: Tensor | ExpertStack) -> Tensor:
    """Per-head ``x[..., h, :] @ w[h].T``: ``x [..., H, K]``, ``w [H, N, K]`` -> ``[..., H, N]``,
    in ``w``'s device and dtype, back in ``x``'s. With ggml's numerics ``w`` is the per-head
    matrices (ggml's batched product: each head's rows rounded for its type)."""
    if not isinstance(w, Tensor):
        return torch.stack([base.linear(x[..., h, :], w[h]) for h in range(w.shape[0])], dim=-2)
    xw = x.to(device=w.device, dtype=w.dtype)
    y = torch.einsum("...hk,hnk->...hn", xw, w)
    return y.to(device=x.device, dtype=x.dtype)


def _heads(weights: WeightProvider, name: str) -> Tensor | ExpertStack:
    """``attn_k_b`` / ``attn_v_b``: the stacked tensor, or with ggml's numerics its per-head
    matrices."""
    return weights.experts(name) if isinstance(weights, GgmlWeights) else weights.weight(name)


class LatentAttention(nn.Module):
    """Multi-head latent attention in either file form (see the module docstring)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        assert config.mla is not None, "deepseek2 configs carry their MLAShape"
        self.config, self.weights, self.layer = config, weights, layer
        m: MLAShape = config.mla
        self.m, d, h = m, config.n_embd, config.n_head
        need = spec.need
        if m.q_lora_rank > 0:
            self.wq_a: str | None = need(TN.ATTN_Q_A.format(layer), (m.q_lora_rank, d))
            self.q_a_norm = need(TN.ATTN_Q_A_NORM.format(layer), (m.q_lora_rank,))
            self.wq = need(TN.ATTN_Q_B.format(layer), (h * m.head_k, m.q_lora_rank))
            spec.refuse(weights, [TN.ATTN_Q.format(layer, "weight")], "q_lora_rank > 0")
        else:
            self.wq_a, self.q_a_norm = None, ""
            self.wq = need(TN.ATTN_Q.format(layer, "weight"), (h * m.head_k, d))
            names = (TN.ATTN_Q_A.format(layer), TN.ATTN_Q_B.format(layer))
            spec.refuse(weights, names, "q_lora_rank is 0")
        self.wkv_a = need(TN.ATTN_KV_A_MQA.format(layer), (m.kv_lora_rank + m.n_rot, d))
        self.kv_a_norm = need(TN.ATTN_KV_A_NORM.format(layer), (m.kv_lora_rank,))
        split = (TN.ATTN_K_B.format(layer), TN.ATTN_V_B.format(layer))
        if m.split:
            self.wk_b = need(split[0], (h, m.kv_lora_rank, m.nope))
            self.wv_b = need(split[1], (h, m.head_v, m.kv_lora_rank))
            spec.refuse(weights, [TN.ATTN_KV_B.format(layer)], "attention.key_length_mla is set")
        else:
            self.wkv_b = need(TN.ATTN_KV_B.format(layer), (h * (m.nope + m.head_v), m.kv_lora_rank))
            spec.refuse(weights, split, "attention.key_length_mla is not set")
        self.wo = need(TN.ATTN_OUT.format(layer, "weight"), (d, h * m.head_v))

    def _query(self, x: Tensor) -> Tensor:
        # x: [B, T, D] -> [B, T, H, head_k]
        w, c = self.weights, self.config
        if self.wq_a is not None:
            x = rms_norm(base.linear(x, w.matrix(self.wq_a)), w.weight(self.q_a_norm), c.norm_eps)
        return base.linear(x, w.matrix(self.wq)).unflatten(-1, (c.n_head, self.m.head_k))

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        m, c, w = self.m, self.config, self.weights
        q = self._query(x)
        q_nope, q_pe = q[..., : m.nope], rope.rotate(q[..., m.nope :])  # [B, T, H, nope / rot]
        kv = base.linear(x, w.matrix(self.wkv_a))  # [B, T, rank + rot]
        latent = rms_norm(kv[..., : m.kv_lora_rank], w.weight(self.kv_a_norm), c.norm_eps)
        k_pe = rope.rotate(kv[..., None, m.kv_lora_rank :])  # [B, T, 1, rot]
        if m.split:
            y = self._absorbed(q_nope, q_pe, latent, k_pe, mask=mask, cache=cache)  # [B, T, H, v]
        else:
            y = self._decompressed(q_nope, q_pe, latent, k_pe, mask=mask, cache=cache)
        return base.linear(y.flatten(-2), w.matrix(self.wo))  # [B, T, D]

    def _absorbed(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        latent: Tensor,
        k_pe: Tensor,
        *,
        mask: Tensor | None,
        cache: KVCache | None,
    ) -> Tensor:
        """attn_k_b turns the queries into latent queries; one key/value head (the latent and
        the rope key) serves every query head; attn_v_b decompresses each head's output."""
        rank, w = self.m.kv_lora_rank, self.weights
        q_lat = head_linear(q_nope, _heads(w, self.wk_b))  # [B, T, H, rank]
        q = torch.cat((q_lat, q_pe), dim=-1).transpose(1, 2)  # [B, H, T, rank + rot]
        k = torch.cat((latent[:, :, None], k_pe), dim=-1).transpose(1, 2)  # [B, 1, T, rank+rot]
        if cache is not None:  # the values are the keys' latent part: cache nothing twice
            k, _ = cache.update(self.layer, k, k[..., :0])
        v = k[..., :rank]  # [B, 1, S, rank]
        heads = q.shape[1]
        y = F.scaled_dot_product_attention(
            q,
            k.expand(-1, heads, -1, -1),
            v.expand(-1, heads, -1, -1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.config.attn_scale,
        )  # [B, H, T, rank]
        return head_linear(y.transpose(1, 2), _heads(w, self.wv_b))  # [B, T, H, v]

    def _decompressed(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        latent: Tensor,
        k_pe: Tensor,
        *,
        mask: Tensor | None,
        cache: KVCache | None,
    ) -> Tensor:
        """attn_kv_b decompresses the latent into per-head keys and values (multi-head
        attention, as llama.cpp runs files without attn_k_b / attn_v_b)."""
        m, heads = self.m, q_nope.shape[2]
        kv = base.linear(latent, self.weights.matrix(self.wkv_b))  # [B, T, H * (nope + v)]
        kv = kv.unflatten(-1, (heads, m.nope + m.head_v))
        k = torch.cat((kv[..., : m.nope], k_pe.expand(-1, -1, heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [B, H, T, head_k]
        k, v = k.transpose(1, 2), kv[..., m.nope :].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.config.attn_scale
        )  # [B, H, T, v]
        return y.transpose(1, 2)


class RoutedExperts(nn.Module):
    """build_moe_ffn as deepseek2 and glm4moe call it, plus the shared experts (see the module
    docstring; glm4moe's shared experts are optional, its exp_probs_b required)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.config, self.weights = config, weights
        d, n_exp, ff = config.n_embd, config.n_expert, config.n_ff_exp
        self.router = spec.need(TN.FFN_GATE_INP.format(layer), (n_exp, d))
        bias = TN.FFN_EXP_PROBS_B.format(layer)
        required = config.rules.glm  # glm4moe creates exp_probs_b without TENSOR_NOT_REQUIRED
        self.bias = spec.need(bias, (n_exp,)) if required else spec.maybe(weights, bias, (n_exp,))
        self.gate_exps = spec.need_experts(TN.FFN_GATE_EXPS.format(layer), (n_exp, ff, d))
        self.up_exps = spec.need_experts(TN.FFN_UP_EXPS.format(layer), (n_exp, ff, d))
        self.down_exps = spec.need_experts(TN.FFN_DOWN_EXPS.format(layer), (n_exp, d, ff))
        sh, a = config.n_ff_shexp, config.arch.value
        names = [t.format(layer) for t in (TN.FFN_GATE_SHEXP, TN.FFN_UP_SHEXP, TN.FFN_DOWN_SHEXP)]
        self.shared: tuple[str, ...] | None = None
        if config.has_shared_expert:
            shapes = ((sh, d), (sh, d), (d, sh))
            self.shared = tuple(spec.need(n, s) for n, s in zip(names, shapes, strict=True))
        else:
            spec.refuse(weights, names, f"{a}: expert_shared_count is 0")
        spec.refuse(weights, [TN.FFN_GATE_INP_SHEXP.format(layer)], f"{a}'s shared experts")

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k expert weights and ids per token: ``([N, k] float32, [N, k] int64)``."""
        # x: [N, D]
        c = self.config
        logits = base.linear(x, self.weights.weight(self.router)).float()  # [N, E]
        probs = logits.softmax(-1) if c.gating is Gating.SOFTMAX else logits.sigmoid()
        chosen = probs
        if self.bias is not None:  # selection only: the weights stay unbiased
            chosen = probs + self.weights.weight(self.bias).to(probs.device, torch.float32)
        if c.n_expert_groups > 1:
            chosen = _best_groups(chosen, c.n_expert_groups, c.n_group_used)
        top_i = chosen.topk(c.n_expert_used, dim=-1).indices  # [N, k]
        top_w = probs.gather(-1, top_i)
        if c.norm_topk:
            top_w = top_w / top_w.sum(-1, keepdim=True).clamp(min=WEIGHTS_SUM_MIN)
        if c.expert_weights_scale != 1.0:
            top_w = top_w * c.expert_weights_scale
        return top_w, top_i

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, T, D]
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        top_w, top_i = self.route(flat)  # [N, k]
        out = torch.zeros_like(flat)
        w = self.weights.experts
        for e in top_i.unique().tolist():  # ascending expert order: deterministic sums
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            gate, up, down = w(self.gate_exps)[e], w(self.up_exps)[e], w(self.down_exps)[e]
            y = base.swiglu(flat[rows], gate, up, down) * top_w[rows, slot, None].to(flat.dtype)
            out.index_add_(0, rows, y)
        if self.shared is not None:
            gate, up, down = (self.weights.matrix(name) for name in self.shared)
            out = out + base.swiglu(flat, gate, up, down)
        return out.view_as(x)


def _best_groups(scores: Tensor, n_groups: int, n_used: int) -> Tensor:
    """Keep the experts of the ``n_used`` groups whose two best scores sum highest; the others
    become -inf (build_moe_ffn's group-limited routing)."""
    # scores: [N, E]
    groups = scores.unflatten(-1, (n_groups, -1))  # [N, G, E/G]
    group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [N, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(-1, group_scores.topk(n_used, dim=-1).indices, True)
    return groups.masked_fill(~keep[..., None], -math.inf).flatten(-2)


def lead_dense_ffn(config: HParams, layer: int) -> type[nn.Module]:
    """The FFN of ``layer`` in deepseek2 and glm4moe: dense SwiGLU in the
    ``leading_dense_block_count`` first blocks, routed experts after."""
    return FeedForward if layer < config.n_layer_dense_lead else RoutedExperts


class Deepseek2Block(TransformerBlock):
    """Pre-norm latent attention, then a dense or routed FFN, each with a residual."""

    attention_cls = LatentAttention

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        return lead_dense_ffn(self.config, layer)


class Deepseek2Transformer(DecoderStack):
    """The deepseek2 decoder: latent attention, YaRN RoPE on its rope dims only."""

    arch = Arch.DEEPSEEK2
    block = Deepseek2Block

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        assert config.mla is not None, "deepseek2 configs carry their MLAShape"
        self.rope = YarnRotaryEmbedding(config, config.mla.n_rot)
