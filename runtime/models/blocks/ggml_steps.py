"""A block's steps around its products in one compiled call each, for the decoders with ggml's
numerics (``ggufswap.runtime.kernels.ggml_block``, ``csrc/ggmlblock.c``).

:func:`block_front` is an attention's RMS norm, q/k/v products, per-head norms and RoPE;
:func:`block_tail` a GeGLU block's half after attention. Each gives the bits of the same steps
one by one (``tests/test_ggml_block.py``) and reads the weights from the store at the call, so a
committed swap is what the next call computes with; each is None where it does not apply (exact
numerics, biases, SwiGLU's tail, another attention, a matrix ggml does not multiply), and the
caller then steps.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ggufswap.runtime import ggml_attn_front, ggml_geglu_tail
from ggufswap.runtime.models.blocks.rope import RopeTables
from ggufswap.runtime.models.ggml_numerics import (
    GgmlMatrix,
    GgmlWeights,
    gelu,
    ggml_norms_active,
    kv_cache_name,
)

if TYPE_CHECKING:
    from ggufswap.runtime.models.blocks.attention import Attention
    from ggufswap.runtime.models.blocks.ffn import FeedForward

__all__ = ["block_front", "block_tail", "gelu_table"]


@functools.cache
def gelu_table() -> Tensor:
    """:func:`gelu` of every F16 value, indexed by its bits: ``[65536]`` float32 (what the
    compiled block tail reads for the values between the clamps)."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return gelu(values.float()).contiguous()


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
    matrices = [weights.matrix(n) for n in (attention.wo, ffn.gate, ffn.up, ffn.down)]
    blocks = [m.blocks for m in matrices if isinstance(m, GgmlMatrix)]
    if len(blocks) != len(matrices):
        return None
    wo, gate, up, down = blocks
    vectors = tuple(None if n is None else weights.weight(n) for n in norms)
    post_attn, ffn_norm, post_ffw = vectors
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
    by one
    (``ggufswap.runtime.kernels.ggml_block``). None elsewhere (exact numerics, biases, another
    attention, a matrix ggml does not multiply): the caller steps."""
    if not isinstance(weights, GgmlWeights) or not ggml_norms_active():
        return None
    if not isinstance(rope, RopeTables) or any(
        b is not None for b in (attention.bq, attention.bk, attention.bv)
    ):
        return None
    matrices = [weights.matrix(n) for n in (attention.wq, attention.wk, attention.wv)]
    blocks = [m.blocks for m in matrices if isinstance(m, GgmlMatrix)]
    if len(blocks) != len(matrices):
        return None
    q_norm, k_norm = (None if n is None else weights.weight(n) for n in attention.head_norms)
    return ggml_attn_front(
        x,
        attn_norm=weights.weight(norm),
        qkv=(blocks[0], blocks[1], blocks[2]),
        head_norms=(q_norm, k_norm),
        head_dim=attention.config.head_dim,
        rope=(rope.cos, rope.sin, rope.n_rot, rope.neox),
        eps=eps,
        kv_f16=kv_cache_name() == "f16",  # as kv_cache() rounds them in this forward
    )
