"""Gated delta-net linear attention: the recurrent layers of Qwen3-Next and Qwen3.5.

llama.cpp's ``build_layer_attn_linear`` (``src/models/qwen35.cpp``, ``qwen3next.cpp``) over
``llm_build_delta_net_base`` (``delta-net-base.cpp``) and ggml's CPU ``gated_delta_net``:

- ``attn_qkv`` mixes the input into queries, keys (``ssm.group_count`` heads of
  ``ssm.state_size``) and values (``ssm.time_step_rank`` heads), ``attn_gate`` gives ``z``;
- a causal depthwise convolution over time (``ssm_conv1d``, ``ssm.conv_kernel`` taps: the last
  ``kernel - 1`` inputs are the **conv state**), then SiLU; queries and keys L2-normalised;
- per value head, ``beta = sigmoid(ssm_beta x)`` and the decay ``g = softplus(ssm_alpha x +
  ssm_dt.bias) * ssm_a`` (``ssm_a = -exp(A_log)``, stored so by the converter);
- the delta rule on the **recurrent state** ``S`` (``[state, state]`` per value head): ``S *=
  exp(g)``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q / sqrt(state)``;
- ``o`` RMS-normed per head by ``ssm_norm``, times ``silu(z)``, then ``ssm_out``.

Key heads serve several value heads: Qwen3.5's files are laid out for ggml's tiled broadcast
(value head ``h`` reads key head ``h % n_k``), Qwen3-Next's for an interleaved one (``h //
(n_v / n_k)``): :attr:`GatedDeltaNet.tiled`.

The recurrence runs token by token (:func:`delta_rule_recurrent`: decoding, as ggml's fused
kernel runs it), or chunk by chunk (:func:`delta_rule_chunked`: prompts and perplexity, as
llama.cpp's chunked graph); both give the same outputs and state to float rounding. The conv and
recurrent states of a sequence live in its :class:`~.kv_cache.HybridCache`, as keys and values do
for attention layers, and are as much tied to the weights that computed them.
"""

from __future__ import annotations

import math
from typing import ClassVar, Final

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor, nn

from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables
from ggufswap.runtime.models.blocks.weights import TensorSpec, WeightProvider, linear
from ggufswap.runtime.models.hparams import HParams, SSMShape
from ggufswap.runtime.models.kv_cache import HybridCache, KVCache
from ggufswap.shards.keys import TensorNames

TN: Final = TensorNames
# llama.cpp's chunked delta net (build_delta_net_chunking) works in chunks of 64 tokens.
CHUNK: Final = 64


def causal_conv(x: Tensor, state: Tensor | None, kernel: Tensor) -> tuple[Tensor, Tensor]:
    """ggml_ssm_conv over ``state`` then ``x``: ``y[t, c] = sum_k in[t + k, c] kernel[c, k]``;
    returns ``y`` and the new state (the last ``K - 1`` inputs)."""
    # x: [B, T, C]; state: [B, K-1, C]; kernel: [C, K]
    taps = kernel.shape[1]
    if state is None:
        state = x.new_zeros(x.shape[0], taps - 1, x.shape[2])
    full = torch.cat((state.to(x.dtype), x), dim=1)  # [B, K-1+T, C]
    windows = full.unfold(1, taps, 1)  # [B, T, C, K]
    y = (windows * kernel.to(device=x.device, dtype=x.dtype)).sum(-1)
    return y, full[:, full.shape[1] - (taps - 1) :]


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """llama.cpp's ``build_gdn_l2_norm``: ``rms_norm(x, eps / n) / sqrt(n)``, i.e. ``x /
    sqrt(sum(x^2) + eps)`` over the last dim."""
    n = x.shape[-1]
    ones = torch.ones(n, device=x.device, dtype=torch.float32)
    return rms_norm(x, ones, eps / n) * (1.0 / math.sqrt(n))


def delta_rule_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The gated delta rule one token at a time (ggml's ``gated_delta_net``). ``q, k, v [B, T,
    H, S]``, ``g, beta [B, T, H]``, ``state [B, H, S, S]`` (``[key dim, value dim]``); returns the
    outputs ``[B, T, H, S]`` and the final state."""
    scale = q.shape[-1] ** -0.5
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        remembered = torch.einsum("bhij,bhi->bhj", state, k[:, t])  # S^T k: [B, H, S]
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhij,bhi->bhj", state, q[:, t]) * scale)
    return torch.stack(outs, dim=1), state


def delta_rule_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The gated delta rule in chunks of ``CHUNK`` tokens (llama.cpp's chunked graph, the WY form
    of the recurrence): within a chunk a triangular solve, between chunks the state. Same
    arguments and results as :func:`delta_rule_recurrent`."""
    bsz, seq, heads, dim = q.shape
    pad = (CHUNK - seq % CHUNK) % CHUNK
    # [B, H, T, S] padded with zeros (g = 0, beta = 0: padded steps change nothing)
    q, k, v = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.transpose(1, 2), (0, pad)) for t in (g, beta))
    n = (seq + pad) // CHUNK
    q = q * dim**-0.5
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, v, k_beta, v_beta = (
        t.reshape(bsz, heads, n, CHUNK, dim) for t in (q, k, v, k_beta, v_beta)
    )
    g = g.reshape(bsz, heads, n, CHUNK).cumsum(-1)  # decay from the chunk's start
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, -math.inf).exp()  # [.., C, C]
    # T = (I + A)^-1 with A the strictly lower part of k_beta k^T decay: forward substitution
    upper = ~lower.tril(-1)  # the diagonal and above
    a = -(k_beta @ k.transpose(-1, -2) * decay).masked_fill(upper, 0.0)
    for i in range(1, CHUNK):
        a[..., i, :i] = a[..., i, :i] + (a[..., i, :i, None] * a[..., :i, :i]).sum(-2)
    t_inv = a + torch.eye(CHUNK, dtype=a.dtype, device=a.device)
    u = t_inv @ v_beta  # [B, H, n, C, S]
    w = t_inv @ (k_beta * g.exp()[..., None])
    out = torch.empty_like(u)
    for c in range(n):
        attn = (q[:, :, c] @ k[:, :, c].transpose(-1, -2) * decay[:, :, c]).masked_fill(~lower, 0.0)
        v_new = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = (q[:, :, c] * g[:, :, c, :, None].exp()) @ state + attn @ v_new
        g_end = g[:, :, c, -1]
        k_decayed = k[:, :, c] * (g_end[..., None] - g[:, :, c]).exp()[..., None]
        state = state * g_end.exp()[..., None, None] + k_decayed.transpose(-1, -2) @ v_new
    out = out.reshape(bsz, heads, n * CHUNK, dim)[:, :, :seq].transpose(1, 2)
    return out, state


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (see the module docstring). Same call as the attention
    modules: ``(x, rope, mask, cache)``; RoPE and masks do not apply, the cache holds its
    states."""

    # Value head h reads key head h % n_k (Qwen3.5's layout); False: h // (n_v / n_k).
    tiled: ClassVar[bool] = True

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        assert config.ssm is not None, "a hybrid model's config carries its SSMShape"
        self.config, self.weights, self.layer = config, weights, layer
        s: SSMShape = config.ssm
        self.s, d = s, config.n_embd
        self.wqkv = spec.need(TN.ATTN_QKV.format(layer), (s.conv_dim, d))
        self.wz = spec.need(TN.ATTN_GATE.format(layer), (s.value_dim, d))
        self.conv = spec.need(TN.SSM_CONV1D.format(layer), (s.conv_dim, s.d_conv))
        self.dt_bias = spec.need(TN.SSM_DT_BIAS.format(layer), (s.n_v_heads,))
        self.a = spec.need(TN.SSM_A.format(layer), (s.n_v_heads,))
        self.norm = spec.need(TN.SSM_NORM.format(layer), (s.head_v,))
        self.out = spec.need(TN.SSM_OUT.format(layer), (d, s.value_dim))
        self.beta_alpha_tensors(spec, layer)

    def beta_alpha_tensors(self, spec: TensorSpec, layer: int) -> None:
        """Qwen3.5: ``ssm_beta`` and ``ssm_alpha``, one row per value head."""
        rows = (self.s.n_v_heads, self.config.n_embd)
        self.wbeta = spec.need(TN.SSM_BETA.format(layer), rows)
        self.walpha = spec.need(TN.SSM_ALPHA.format(layer), rows)

    def beta_alpha(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``beta`` and ``alpha`` logits ``[B, T, n_v]``."""
        w = self.weights.matrix
        return linear(x, w(self.wbeta)), linear(x, w(self.walpha))

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        s, c, w = self.s, self.config, self.weights
        bsz, seq, _ = x.shape
        b, a = self.beta_alpha(x)
        beta = torch.sigmoid(b.float())  # [B, T, n_v]
        alpha = a.float() + w.weight(self.dt_bias).to(x.device, torch.float32)
        g = F.softplus(alpha) * w.weight(self.a).to(x.device, torch.float32)
        conv_state, state = _states(cache, self.layer)
        mixed = linear(x, w.matrix(self.wqkv)).float()  # [B, T, conv_dim]
        mixed, conv_state = causal_conv(mixed, conv_state, w.weight(self.conv))
        mixed = F.silu(mixed)
        q, k, v = mixed.split((s.key_dim, s.key_dim, s.value_dim), dim=-1)
        q = l2_norm(q.unflatten(-1, (s.n_k_heads, s.d_state)), c.norm_eps)
        k = l2_norm(k.unflatten(-1, (s.n_k_heads, s.d_state)), c.norm_eps)
        q, k = self._to_value_heads(q), self._to_value_heads(k)
        v = v.unflatten(-1, (s.n_v_heads, s.head_v))
        if state is None:
            state = x.new_zeros(bsz, s.n_v_heads, s.d_state, s.head_v, dtype=torch.float32)
        rule = delta_rule_recurrent if seq == 1 else delta_rule_chunked
        o, state = rule(q, k, v, g, beta, state=state)  # [B, T, n_v, head_v]
        if isinstance(cache, HybridCache):
            cache.set_recurrent(self.layer, conv_state, state)
        z = linear(x, w.matrix(self.wz)).float().unflatten(-1, (s.n_v_heads, s.head_v))
        o = rms_norm(o, w.weight(self.norm), c.norm_eps) * F.silu(z)
        return linear(o.flatten(-2).to(x.dtype), w.matrix(self.out))  # [B, T, D]

    def _to_value_heads(self, t: Tensor) -> Tensor:
        """``[B, T, n_k, S]`` -> ``[B, T, n_v, S]`` by the file's layout (``tiled``)."""
        ratio = self.s.n_v_heads // self.s.n_k_heads
        if ratio == 1:
            return t
        return t.repeat(1, 1, ratio, 1) if self.tiled else t.repeat_interleave(ratio, dim=2)


def _states(cache: KVCache | None, layer: int) -> tuple[Tensor | None, Tensor | None]:
    """The layer's conv and recurrent states from ``cache`` (None: a fresh sequence)."""
    if cache is None:
        return None, None
    if not isinstance(cache, HybridCache):
        raise TypeError("a hybrid model runs with the HybridCache its new_cache() makes")
    return cache.recurrent(layer)
