"""A block's steps around its products in one compiled call each, for the decoders with ggml's
numerics (``ggufswap.runtime.kernels.ggml_block``, ``csrc/ggmlblock.c``).

:func:`block_front` is an attention's RMS norm, q/k/v products, per-head norms and RoPE;
:func:`block_tail` a GeGLU block's half after attention. Each gives the bits of the same steps
one by one (``tests/test_ggml_block.py``) and reads the store's weights, looked up once per commit
(its forward views, which a commit clears), so a committed swap is what the next call computes
with; each is None where it does not apply (exact
numerics, biases, SwiGLU's tail, another attention, a matrix ggml does not multiply), and the
caller then steps.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ggufswap.runtime import QuantizedMatrix, ggml_attn_front, ggml_geglu_layer, ggml_geglu_tail
from ggufswap.runtime.models.blocks.rope import RopeTables
from ggufswap.runtime.models.ggml_numerics import (
    GgmlMatrix,
    GgmlWeights,
    gelu,
    ggml_norms_active,
    kv_cache_name,
    kv_f16,
)

if TYPE_CHECKING:
    from ggufswap.runtime.models.blocks.attention import Attention
    from ggufswap.runtime.models.blocks.ffn import FeedForward
    from ggufswap.runtime.models.kv_cache import KVCache

__all__ = ["block_front", "block_layer", "block_tail", "gelu_table"]


@functools.cache
def gelu_table() -> Tensor:
    """:func:`gelu` of every F16 value, indexed by its bits: ``[65536]`` float32 (what the
    compiled block tail reads for the values between the clamps)."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return gelu(values.float()).contiguous()


@dataclass(frozen=True)
class _Operands:
    """A block's matrices in their blocks (None: one is not a ggml matrix) and its vectors (norm
    weights), as the store holds them until its next commit."""

    blocks: tuple[QuantizedMatrix, ...] | None
    vectors: tuple[Tensor | None, ...]


def _operands(
    weights: GgmlWeights, kind: str, matrices: Sequence[str], vectors: Sequence[str | None]
) -> _Operands:
    """``matrices``' blocks and ``vectors``' tensors, looked up once per commit (kept in the
    store's forward views under ``kind`` and the first matrix's name, which a commit clears: a
    swap is what the next call reads)."""

    def make() -> _Operands:
        found = [weights.matrix(n) for n in matrices]
        blocks = tuple(m.blocks for m in found if isinstance(m, GgmlMatrix))
        held = tuple(None if n is None else weights.weight(n) for n in vectors)
        return _Operands(blocks if len(blocks) == len(found) else None, held)

    return weights.store.views.get(kind, matrices[0], _Operands, make)


def block_tail(
    weights: object,
    x: Tensor,
    a: Tensor,
    attention: Attention,
    ffn: FeedForward,
    *,
    norms: tuple[str | None, str, str | None],
    eps: float,
) -> Tensor | None:
    """A GeGLU block's half after attention in one compiled call, in a decoder with ggml's
    numerics: ``h = x + post_attn_norm(wo(a))``, ``y = h + post_ffw_norm(ffn(ffn_norm(h)))``
    (``norms``: those three norms' tensors, a post norm None where the block has none), the same
    bits as those steps one by one (``ggufswap.runtime.kernels.ggml_block``). None elsewhere
    (exact numerics, a bias, SwiGLU, a matrix ggml does not multiply): the caller steps."""
    if not isinstance(weights, GgmlWeights) or not ggml_norms_active() or not ffn.gelu:
        return None
    if attention.bo is not None:
        return None
    names = (attention.wo, ffn.gate, ffn.up, ffn.down)
    found = _operands(weights, "ggml-tail", names, norms)
    if found.blocks is None:
        return None
    wo, gate, up, down = found.blocks
    post_attn, ffn_norm, post_ffw = found.vectors
    assert ffn_norm is not None, "a block always has its FFN norm"
    return ggml_geglu_tail(
        x,
        a,
        wo=wo,
        gate=gate,
        up=up,
        down=down,
        norms=(post_attn, ffn_norm, post_ffw),
        eps=eps,
        gelu_table=gelu_table(),
    )


def block_front(
    weights: object,
    x: Tensor,
    attention: Attention,
    *,
    norm: str,
    rope: RopeTables,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """A block's attention up to its heads' inputs in one compiled call, in a decoder with
    ggml's numerics: ``q, k, v`` of ``norm(x)``, q and k normed per head (where the attention
    has those norms) and rotated, k and v as the forward's KV cache holds them
    (:func:`~.ggml_numerics.kv_cache`: F16 values unless F32): the same bits as those steps one
    by one (``ggufswap.runtime.kernels.ggml_block``). None elsewhere (exact numerics, biases,
    another attention, a matrix ggml does not multiply): the caller steps."""
    if not isinstance(weights, GgmlWeights) or not ggml_norms_active():
        return None
    if not isinstance(rope, RopeTables) or any(
        b is not None for b in (attention.bq, attention.bk, attention.bv)
    ):
        return None
    names = (attention.wq, attention.wk, attention.wv)
    found = _operands(weights, "ggml-front", names, (norm, *attention.head_norms))
    if found.blocks is None:
        return None
    attn_norm, q_norm, k_norm = found.vectors
    assert attn_norm is not None, "an attention always has its norm"
    return ggml_attn_front(
        x,
        attn_norm=attn_norm,
        qkv=(found.blocks[0], found.blocks[1], found.blocks[2]),
        head_norms=(q_norm, k_norm),
        head_dim=attention.config.head_dim,
        rope=(rope.cos, rope.sin, rope.n_rot, rope.neox),
        eps=eps,
        kv_f16=kv_cache_name() == "f16",  # as kv_cache() rounds them in this forward
    )


def block_layer(
    weights: object,
    x: Tensor,
    parts: tuple[Attention, FeedForward],
    norms: tuple[str, str | None, str, str | None],
    *,
    rope: RopeTables,
    keys: tuple[int, int] | None,
    cache: KVCache | None,
    eps: float,
) -> Tensor | None:
    """A GeGLU block's decode step in one compiled call, in a decoder with ggml's numerics and an
    F16 KV cache: :func:`block_front`, the token's keys and values written to ``cache``, ggml's
    attention over the cached ``keys = (lo, end)`` (:func:`~.attention.ggml_decode_step`) and
    :func:`block_tail`, the bits of those steps one after the other; ``norms``: the attention,
    post-attention, FFN and post-FFN norms' tensors. None elsewhere (more than one token, exact
    numerics, an F32 cache, a bias, SwiGLU, a matrix ggml does not multiply): the caller steps."""
    attention, ffn = parts
    if (
        not isinstance(weights, GgmlWeights)
        or not ggml_norms_active()
        or not kv_f16()
        or cache is None
        or keys is None
        or x.shape[:2] != (1, 1)
        or not ffn.gelu
        or not isinstance(rope, RopeTables)
        or any(b is not None for b in (attention.bq, attention.bk, attention.bv, attention.bo))
    ):
        return None
    names = (attention.wq, attention.wk, attention.wv, attention.wo, ffn.gate, ffn.up, ffn.down)
    found = _operands(weights, "ggml-layer", names, (*norms, *attention.head_norms))
    if found.blocks is None:
        return None
    attn_norm, post_attn, ffn_norm, post_ffw, q_norm, k_norm = found.vectors
    assert attn_norm is not None, "an attention always has its norm"
    assert ffn_norm is not None, "a block always has its FFN norm"
    end = cache.length + 1
    like = x.new_empty(1, attention.config.n_head_kv, 1, attention.config.head_dim)
    k_buf, v_buf = cache.buffers(attention.layer, end, like.half(), like.half())
    scale = attention.config.attn_scale
    wq, wk, wv, wo, gate, up, down = found.blocks
    return ggml_geglu_layer(
        x,
        attn_norm=attn_norm,
        qkv=(wq, wk, wv),
        head_norms=(q_norm, k_norm),
        head_dim=attention.config.head_dim,
        rope=(rope.cos, rope.sin, rope.n_rot, rope.neox),
        eps=eps,
        cache=(k_buf, v_buf, cache.length, keys[0]),
        scales=(1.0, scale) if attention.scale_q else (scale, 1.0),
        tail=(wo, gate, up, down),
        norms=(post_attn, ffn_norm, post_ffw),
        gelu_table=gelu_table(),
    )
