"""Grouped-query attention without copies of K/V (``H`` query heads over ``Hkv`` kv heads).

llama.cpp's attention reads each kv head's keys and values once for the ``H / Hkv`` query heads
that share it; ``repeat_interleave`` of K/V to ``H`` heads would copy the whole cache every step,
which made a decode step's cost grow with the context faster than llama.cpp's.
"""

from __future__ import annotations

import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor

__all__ = ["group_queries", "grouped_attention"]


def group_queries(q: Tensor, n_head_kv: int) -> Tensor:
    """``q [B, H, T, hd]`` as ``[B, Hkv, g*T, hd]``: the ``g = H / Hkv`` query heads that read
    one kv head (query head ``h`` reads kv head ``h // g``) as rows of one query block."""
    bsz, n_head, seq, hd = q.shape
    return q.reshape(bsz, n_head_kv, n_head // n_head_kv * seq, hd)


def grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float
) -> Tensor:
    """Grouped-query attention without copies of K/V: ``q [B, H, T, hd]``, ``k, v [B, Hkv, S,
    hd]``, ``mask [T, S]`` (True = may attend; None = causal); ``[B, H, T, hd]``. A decode step
    (one query) puts the ``H / Hkv`` query heads of each kv head in one block of rows, so each
    K/V is read once per step and the step's cost grows with the context as llama.cpp's does;
    more queries use torch's grouped-query attention (``enable_gqa``, causal without a mask)."""
    bsz, n_head, seq, hd = q.shape
    group = n_head // k.shape[1]
    if group == 1 or seq > 1:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )
    rows = None  # one query attending every key (a decode step within its window): no mask
    if mask is not None and not bool(mask.all()):
        rows = mask.repeat(group, 1)  # [g, S]: the one query position, for each head of a group
    y = F.scaled_dot_product_attention(
        group_queries(q, k.shape[1]), k, v, attn_mask=rows, scale=scale
    )
    return y.reshape(bsz, n_head, seq, hd)
