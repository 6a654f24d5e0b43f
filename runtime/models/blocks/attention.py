"""Grouped-query causal self-attention (llama.cpp's ``build_attn`` over ``build_qkv``) and the
sliding-window mask of the local layers.

Call signature of every attention module: ``attn(x [B, T, D], rope, mask, cache) -> [B, T, D]``,
``mask`` a ``[T, S]`` bool (True = may attend) or None for plain causal attention within the
forward; the cache (``KVCache``) holds the keys and values of earlier positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor, nn

from ggufswap.runtime import ggml_flash_attn
from ggufswap.runtime.models.blocks.ggml_steps import block_front
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables
from ggufswap.runtime.models.blocks.weights import TensorSpec, WeightProvider, linear, linears
from ggufswap.runtime.models.ggml_numerics import kv_cache, kv_f16
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.models.kv_cache import KVCache, mask_keys
from ggufswap.shards.keys import TensorNames


def sliding_window_mask(length: int, window: int, device: torch.device) -> Tensor:
    """``[T, T]`` bool, True where query ``i`` may attend key ``j``: ``0 <= i - j < window``."""
    pos = torch.arange(length, device=device)
    dist = pos[:, None] - pos[None, :]  # [T, T]: i - j
    return (dist >= 0) & (dist < window)


class Attention(nn.Module):
    """Grouped-query causal self-attention with optional Q/K biases and per-head Q/K norms."""

    # Whether llama.cpp's graph multiplies q by the attention scale before the scores (gemma3's),
    # not the scores: what a ggml decode step does (:func:`ggml_decode_step`).
    scale_q = False

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights, self.layer = config, weights, layer
        d, hd = config.n_embd, config.head_dim
        q_dim, kv_dim = config.n_head * hd, config.n_head_kv * hd
        tn = TensorNames
        self.wq = spec.need(tn.ATTN_Q.format(layer, "weight"), (q_dim, d))
        self.wk = spec.need(tn.ATTN_K.format(layer, "weight"), (kv_dim, d))
        self.wv = spec.need(tn.ATTN_V.format(layer, "weight"), (kv_dim, d))
        self.wo = spec.need(tn.ATTN_OUT.format(layer, "weight"), (d, q_dim))
        self.bq = spec.maybe(weights, tn.ATTN_Q.format(layer, "bias"), (q_dim,))
        self.bk = spec.maybe(weights, tn.ATTN_K.format(layer, "bias"), (kv_dim,))
        self.bv = spec.maybe(weights, tn.ATTN_V.format(layer, "bias"), (kv_dim,))
        self.bo = spec.maybe(weights, tn.ATTN_OUT.format(layer, "bias"), (d,))
        self.q_norm = spec.maybe(weights, tn.ATTN_Q_NORM.format(layer), (hd,))
        self.k_norm = spec.maybe(weights, tn.ATTN_K_NORM.format(layer), (hd,))

    def _proj(self, x: Tensor, w: str, b: str | None) -> Tensor:
        return linear(x, self.weights.matrix(w), None if b is None else self.weights.weight(b))

    def _norm(self, x: Tensor, name: str | None) -> Tensor:
        return x if name is None else rms_norm(x, self.weights.weight(name), self.config.norm_eps)

    def forward(
        self,
        x: Tensor,
        rope: RopeTables,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Causal attention, or attention under ``mask`` ([T, S] bool, True = may attend). With
        ``cache`` the keys are the cached ones then this forward's (S = cache.length + T)."""
        # x: [B, T, D] -> [B, T, D]
        return self.project(self.heads(x, rope, mask, cache))

    @property
    def head_norms(self) -> tuple[str | None, str | None]:
        """The per-head Q and K norms' tensors (None: the attention has none)."""
        return self.q_norm, self.k_norm

    def normed_heads(
        self, x: Tensor, norm: str, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        """:meth:`heads` of ``rms_norm(x)`` by the tensor ``norm``; in a decoder with ggml's
        numerics the norm, products, head norms and RoPE in one compiled call (the same bits:
        :func:`~.ggml_steps.block_front`) where it applies."""
        # x: [B, T, D] -> [B, T, H * hd]
        c = self.config
        qkv = block_front(self.weights, x, self, norm=norm, rope=rope, eps=c.norm_eps)
        if qkv is None or type(self).heads is not Attention.heads:
            return self.heads(rms_norm(x, self.weights.weight(norm), c.norm_eps), rope, mask, cache)
        q, k, v = qkv  # k, v already as the KV cache holds them
        scale = c.attn_scale
        return attend(
            q,
            k,
            v,
            layer=self.layer,
            scale=scale,
            mask=mask,
            cache=cache,
            held=True,
            scale_q=self.scale_q,
        )

    def project(self, y: Tensor) -> Tensor:
        """The output product of the heads ``y [B, T, H * hd]``: ``[B, T, D]``."""
        return self._proj(y, self.wo, self.bo)

    def heads(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        """:meth:`forward` before the output product: the heads' outputs ``[B, T, H * hd]``."""
        # x: [B, T, D]
        c, (bsz, seq, _) = self.config, x.shape
        w, b = self.weights, self.weights.weight
        q, k, v = linears(  # one ggml call where ggml multiplies all three (x quantized once)
            x,
            [w.matrix(self.wq), w.matrix(self.wk), w.matrix(self.wv)],
            [None if name is None else b(name) for name in (self.bq, self.bk, self.bv)],
        )
        q = q.view(bsz, seq, c.n_head, c.head_dim)  # [B, T, H, hd]
        k = k.view(bsz, seq, c.n_head_kv, c.head_dim)  # [B, T, Hkv, hd]
        v = v.view(bsz, seq, c.n_head_kv, c.head_dim)
        q = rope.rotate(self._norm(q, self.q_norm))
        k = rope.rotate(self._norm(k, self.k_norm))
        scale = c.attn_scale
        return attend(
            q, k, v, layer=self.layer, scale=scale, mask=mask, cache=cache, scale_q=self.scale_q
        )


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    layer: int,
    scale: float,
    mask: Tensor | None,
    cache: KVCache | None,
    held: bool = False,
    scale_q: bool = False,
) -> Tensor:
    """Grouped-query attention of ``q [B, T, H, hd]`` over ``k, v [B, T, Hkv, hd]`` (with the
    cached keys and values first when ``cache``): query head ``h`` reads kv head ``h // (H /
    Hkv)``, without copies of K/V (:func:`grouped_attention`); ``[B, T, H * hd]``. ``held``:
    ``k`` and ``v`` are already as the KV cache holds them (:func:`.ggml_numerics.kv_cache`).

    In a decoder with ggml's numerics and an F16 cache the cache holds F16 tensors (the same
    values: they were rounded to F16), and a decode step's attention is ggml's own
    (:func:`ggml_decode_step`); ``scale_q``: there ``q`` is multiplied by ``scale`` before the
    scores (gemma3's graph in llama.cpp) instead of the scores by ``scale``."""
    bsz, seq, heads, _ = q.shape
    if not held:
        k, v = kv_cache(k, v)  # with ggml numerics: as llama.cpp's cache holds them (F16)
    if cache is not None and kv_f16():
        y = ggml_decode_step(
            q, k, v, layer=layer, scale=scale, mask=mask, cache=cache, scale_q=scale_q
        )
        if y is not None:
            return y
        k, v = k.half(), v.half()  # exact: already F16 values
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H(kv), T, hd]
    if cache is not None:  # the rope tables already carry start_pos = cache.length
        k, v = cache.update(layer, k, v)  # [B, Hkv, S, hd]
        k, v = k.to(q.dtype), v.to(q.dtype)  # an F16 cache's values, exactly
    y = grouped_attention(q, k, v, mask, scale=scale)  # [B, H, T, hd]
    return y.transpose(1, 2).reshape(bsz, seq, heads * v.shape[-1])  # [B, T, H*hd]


def decode_keys(mask: Tensor | None, end: int) -> tuple[int, int] | None:
    """The keys ``(lo, end)`` a decode step's one query attends under ``mask [1, end]`` (None:
    every key), where they are one run ending at the query's own; else None."""
    if mask is None:
        return 0, end
    span = _span(mask) if mask.shape == (1, end) else None
    return span if span is not None and span[1] == end else None


def ggml_decode_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    layer: int,
    scale: float,
    mask: Tensor | None,
    cache: KVCache,
    scale_q: bool = False,
) -> Tensor | None:
    """One token's attention as llama.cpp's decode step computes it (a decoder with ggml's
    numerics and an F16 cache): ``k, v [1, 1, Hkv, hd]`` (F16 values) written to the cache,
    then ggml's ``flash_attn_ext`` of ``q [1, 1, H, hd]`` over the cached keys the mask allows
    (:func:`decode_keys`), read where the cache holds them; ``[1, 1, H * hd]``, or None where it
    does not apply (more tokens, keys not one run, no ggml attention here)."""
    bsz, seq, heads, hd = q.shape
    end = cache.length + 1
    keys = decode_keys(mask, end) if bsz == seq == 1 else None
    if keys is None:
        return None
    k16, v16 = (t.transpose(1, 2).half() for t in (k, v))  # [1, Hkv, 1, hd]
    k_buf, v_buf = cache.buffers(layer, end, k16, v16)
    if k_buf.dtype is not torch.float16:
        return None
    k_buf[:, :, cache.length] = k16[:, :, 0]
    v_buf[:, :, cache.length] = v16[:, :, 0]
    rows = q.reshape(heads, hd)
    if scale_q:
        rows, scale = rows * scale, 1.0
    y = ggml_flash_attn(rows.contiguous(), k_buf, v_buf, keys, scale=scale)
    return None if y is None else y.view(1, 1, heads * hd)


def group_queries(q: Tensor, n_head_kv: int) -> Tensor:
    """``q [B, H, T, hd]`` as ``[B, Hkv, g*T, hd]``: the ``g = H / Hkv`` query heads that read
    one kv head (query head ``h`` reads kv head ``h // g``) as rows of one query block."""
    bsz, n_head, seq, hd = q.shape
    return q.reshape(bsz, n_head_kv, n_head // n_head_kv * seq, hd)


def grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float
) -> Tensor:
    """Grouped-query attention without copies of K/V: ``q [B, H, T, hd]``, ``k, v [B, Hkv, S,
    hd]``, ``mask [T, S]`` (True = may attend; None = causal); ``[B, H, T, hd]``.

    llama.cpp's attention reads each kv head's keys and values once for the ``H / Hkv`` query
    heads that share it; ``repeat_interleave`` of K/V to ``H`` heads would copy the whole cache
    every step (a decode step's cost then grows with the context faster than llama.cpp's). A
    decode step (one query) puts the query heads of each kv head in one block of rows, so each
    K/V is read once per step, and a local layer's step reads its window only (:func:`_window`);
    more queries use torch's grouped-query attention (``enable_gqa``, causal without a mask)."""
    bsz, n_head, seq, _ = q.shape
    group = n_head // k.shape[1]
    if seq > 1 or (mask is not None and mask.dim() != 2):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )
    rows = None  # one query attending every key (a decode step within its window): no mask
    if mask is not None:
        k, v, rows = _window(k, v, mask)
        rows = None if rows is None else rows.repeat(group, 1)  # [g, S]: each head of a group
    y = F.scaled_dot_product_attention(
        group_queries(q, k.shape[1]), k, v, attn_mask=rows, scale=scale
    )
    return y.reshape(bsz, n_head, seq, v.shape[-1])


def _window(k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """One query's keys under ``mask [1, S]``: where the keys it may attend are one run (a
    sliding window), that run alone and no mask, so a decode step of a local layer reads its
    window, not the whole cache (llama.cpp's SWA cache holds the window only); else all, masked."""
    span = _span(mask)
    if span is None:
        return k, v, mask
    lo, hi = span
    if (lo, hi) == (0, k.shape[2]):
        return k, v, None
    return k[:, :, lo:hi], v[:, :, lo:hi], None


# A copy of the mask last asked about and its run of keys: the layers of a kind share one mask
# per step, so a step reads each mask once. Matched by content (a copy, compared with
# torch.equal), not identity: a buffer reused and written in place is read again (inference
# tensors, what a served step makes, keep no version counter).
_LAST_SPAN: list[tuple[Tensor, tuple[int, int] | None]] = []


def _span(mask: Tensor) -> tuple[int, int] | None:
    """``(lo, hi)`` where the keys ``mask [1, S]`` allows are the one run ``lo .. hi - 1``;
    None where they are not one run (or none)."""
    marked = mask_keys(mask)
    if marked is not None:
        return marked
    last = _LAST_SPAN[0] if _LAST_SPAN else None
    if (
        last is not None
        and last[0].shape == mask.shape
        and last[0].device == mask.device
        and torch.equal(last[0], mask)
    ):
        return last[1]
    keep = mask[0].nonzero().flatten()
    span = None
    if keep.numel():
        lo, hi = int(keep[0]), int(keep[-1]) + 1
        span = (lo, hi) if hi - lo == keep.numel() else None
    _LAST_SPAN[:] = [(mask.clone(), span)]
    return span


class GatedAttention(nn.Module):
    """Qwen3-Next / Qwen3.5 full attention: ``attn_q`` gives each head its query and an output
    gate (``[q, gate]`` per head), per-head Q/K RMS norms (required), RoPE, grouped-query
    attention, then the output times ``sigmoid(gate)`` before ``attn_output``."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights, self.layer = config, weights, layer
        d, hd = config.n_embd, config.head_dim
        q_dim, kv_dim = config.n_head * hd, config.n_head_kv * hd
        tn = TensorNames
        self.wq = spec.need(tn.ATTN_Q.format(layer, "weight"), (2 * q_dim, d))
        self.wk = spec.need(tn.ATTN_K.format(layer, "weight"), (kv_dim, d))
        self.wv = spec.need(tn.ATTN_V.format(layer, "weight"), (kv_dim, d))
        self.wo = spec.need(tn.ATTN_OUT.format(layer, "weight"), (d, q_dim))
        self.q_norm = spec.need(tn.ATTN_Q_NORM.format(layer), (hd,))
        self.k_norm = spec.need(tn.ATTN_K_NORM.format(layer), (hd,))

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        c, w = self.config, self.weights
        bsz, seq, _ = x.shape
        qg, k, v = linears(x, [w.matrix(self.wq), w.matrix(self.wk), w.matrix(self.wv)])
        qg = qg.view(bsz, seq, c.n_head, 2 * c.head_dim)
        q, gate = qg[..., : c.head_dim], qg[..., c.head_dim :]  # [B, T, H, hd] each
        k = k.view(bsz, seq, c.n_head_kv, c.head_dim)
        v = v.view(bsz, seq, c.n_head_kv, c.head_dim)
        q = rope.rotate(rms_norm(q, w.weight(self.q_norm), c.norm_eps))
        k = rope.rotate(rms_norm(k, w.weight(self.k_norm), c.norm_eps))
        y = attend(q, k, v, layer=self.layer, scale=c.attn_scale, mask=mask, cache=cache)
        y = y * torch.sigmoid(gate.reshape(bsz, seq, -1))
        return linear(y, w.matrix(self.wo))  # [B, T, D]
