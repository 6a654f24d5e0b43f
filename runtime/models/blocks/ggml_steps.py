"""A block's steps around its products in one compiled call each, for the decoders with ggml's
numerics (``ggufswap.runtime.kernels.ggml_block``, ``csrc/ggmlblock.c``).

:func:`block_front` is an attention's RMS norm, q/k/v products, per-head norms and RoPE;
:func:`block_tail` a GeGLU block's half after attention. Each gives the bits of the same steps
one by one (``tests/test_ggml_block.py``) and reads the store's weights, looked up once per commit
(its forward views, which a commit clears), so a committed swap is what the next call computes
with; each is None where it does not apply (exact
numerics, biases, SwiGLU's tail, another attention, a matrix ggml does not multiply), and the
caller then steps. :func:`block_layer` and :func:`block_moe_layer` are a whole block's decode step
in one call; :func:`step_layer` and :func:`step_moe_layer` what the same blocks add to a whole
decode step in one call (``ggml_decode.py``), made from the same per-commit arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ggufswap.runtime import (
    QuantizedMatrix,
    ggml_attn_front,
    ggml_geglu_layer,
    ggml_geglu_tail,
    ggml_moe_ffn,
    ggml_moe_layer,
)
from ggufswap.runtime.kernels.ggml_layer import (
    Front,
    LayerWeights,
    front_args,
    layer_weights,
    tail_weights,
)
from ggufswap.runtime.kernels.ggml_moe import moe_args, moe_block_args
from ggufswap.runtime.kernels.ggml_step import StepLayer
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
    from ggufswap.runtime.models.blocks.moe import MoEFeedForward
    from ggufswap.runtime.models.kv_cache import KVCache

__all__ = [
    "StepLayer",
    "block_front",
    "block_layer",
    "block_moe_layer",
    "block_tail",
    "gelu_table",
    "moe_step",
    "step_layer",
    "step_moe_layer",
]


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


@dataclass(frozen=True)
class _Held:
    """What a layer call reads of the store, as its C side takes it (None: the call does not
    apply), made once per commit (kept in the store's forward views, which a commit clears)."""

    value: Any


def _held(weights: GgmlWeights, kind: str, name: str, make: Callable[[], Any]) -> Any:
    return weights.store.views.get(kind, name, _Held, lambda: _Held(make())).value


def _layer_weights(weights: GgmlWeights, attention: Attention, norm: str) -> LayerWeights | None:
    """The attention half's weights for the layer calls, once per commit."""

    def make() -> LayerWeights | None:
        names = (attention.wq, attention.wk, attention.wv)
        found = _operands(weights, "ggml-front", names, (norm, *attention.head_norms))
        attn_norm, q_norm, k_norm = found.vectors
        if found.blocks is None or attn_norm is None:
            return None
        qkv = (found.blocks[0], found.blocks[1], found.blocks[2])
        return layer_weights(attn_norm, qkv, (q_norm, k_norm), attention.config.head_dim)

    held: LayerWeights | None = _held(weights, "ggml-layer-front", attention.wq, make)
    return held


def _front(
    weights: GgmlWeights,
    x: Tensor,
    attention: Attention,
    norm: str,
    step: tuple[RopeTables, tuple[int, int], KVCache],
    *,
    eps: float,
) -> Front | None:
    """A decode step's attention half for the layer calls (:func:`~.ggml_layer.front_args`):
    the front's weights (once per commit), the token's row in ``cache``'s F16 buffers, the keys
    it attends."""
    rope, keys, cache = step
    held = _layer_weights(weights, attention, norm)
    if held is None:
        return None
    end = cache.length + 1
    buffers = cache.room(attention.layer, end)
    if buffers is None:
        like = x.new_empty(1, held.n_head_kv, 1, held.head_dim).half()
        buffers = cache.buffers(attention.layer, end, like, like)
    return front_args(
        x,
        held,
        rope=(rope.cos, rope.sin, rope.n_rot, rope.neox),
        eps=eps,
        cache=(buffers[0], buffers[1], cache.length, keys[0]),
        scales=_scales(attention),
    )


def _plain(weights: object, attention: Attention) -> bool:
    """Whether a block's layer and step calls can take it whatever the step: ggml's weights,
    an attention without biases."""
    biases = (attention.bq, attention.bk, attention.bv, attention.bo)
    return isinstance(weights, GgmlWeights) and all(b is None for b in biases)


def _decoding(weights: object, x: Tensor, attention: Attention, step: tuple[object, ...]) -> bool:
    """Whether a layer call may run: one token in a ggml decoder's forward with an F16 cache,
    an attention without biases, the keys one run (``step``: rope, keys, cache)."""
    rope, keys, cache = step
    return (
        _plain(weights, attention)
        and ggml_norms_active()
        and kv_f16()
        and cache is not None
        and keys is not None
        and x.shape[:2] == (1, 1)
        and isinstance(rope, RopeTables)
    )


def _tail_args(
    weights: GgmlWeights,
    parts: tuple[Attention, FeedForward],
    norms: tuple[str, str | None, str, str | None],
) -> tuple[object, ...] | None:
    """A GeGLU block's tail for the layer calls (:func:`~.ggml_layer.tail_weights`), once per
    commit; ``norms``: the attention, post-attention, FFN and post-FFN norms' tensors."""
    attention, ffn = parts
    attn_norm, post_attn, ffn_norm, post_ffw = norms

    def make() -> tuple[object, ...] | None:
        names = (attention.wo, ffn.gate, ffn.up, ffn.down)
        tail = _operands(weights, "ggml-tail", names, (post_attn, ffn_norm, post_ffw))
        post_a, ffn_n, post_f = tail.vectors
        front = _layer_weights(weights, attention, attn_norm)
        if tail.blocks is None or ffn_n is None or front is None:
            return None
        wo, gate, up, down = tail.blocks
        held = (post_a, ffn_n, post_f)
        return tail_weights((wo, gate, up, down), held, gelu_table(), front.q_dim)

    held: tuple[object, ...] | None = _held(weights, "ggml-layer-tail", attention.wo, make)
    return held


def _scales(attention: Attention) -> tuple[float, float]:
    """``(kq_scale, q_scale)``: the attention's scale on the scores, or on q (gemma3's)."""
    scale = attention.config.attn_scale
    return (1.0, scale) if attention.scale_q else (scale, 1.0)


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
    if not _decoding(weights, x, attention, (rope, keys, cache)) or not ffn.gelu:
        return None
    assert isinstance(weights, GgmlWeights)
    assert keys is not None
    assert cache is not None
    tail_args = _tail_args(weights, parts, norms)
    front = _front(weights, x, attention, norms[0], (rope, keys, cache), eps=eps)
    if front is None or tail_args is None:
        return None
    return ggml_geglu_layer(x, front, tail_args)


def step_layer(
    weights: object,
    parts: tuple[Attention, FeedForward],
    norms: tuple[str, str | None, str, str | None],
    kind: int,
) -> StepLayer | None:
    """A GeGLU block's part of a one-call decode step (:func:`~.ggml_step.step_weights`), of
    ``kind`` (which RoPE and keys it reads), made from what :func:`block_layer` reads (once per
    commit); None where :func:`block_layer` would not apply whatever the step."""
    attention, ffn = parts
    if not _plain(weights, attention) or not ffn.gelu:
        return None
    assert isinstance(weights, GgmlWeights)
    front = _layer_weights(weights, attention, norms[0])
    tail = _tail_args(weights, parts, norms)
    if front is None or tail is None:
        return None
    return StepLayer(front, tail, kind, _scales(attention))


@dataclass(frozen=True)
class _Moe:
    """A MoE FFN's operands as its compiled call takes them (None: it does not apply)."""

    spec: tuple[object, ...] | None


def _moe(weights: GgmlWeights, moe: MoEFeedForward) -> tuple[object, ...] | None:
    """``moe``'s operands for :func:`~.ggml_moe.moe_ffn`, looked up once per commit (kept in the
    store's forward views under its router's name, which a commit clears); None where its
    experts are not stacked SwiGLU ones in their blocks, or it has a shared expert."""

    def make() -> _Moe:
        if moe.per_expert is not None or moe.shared is not None:
            return _Moe(None)
        stacks = tuple(
            weights.experts(n).blocks() for n in (moe.gate_exps, moe.up_exps, moe.down_exps)
        )
        router = weights.weight(moe.router)
        c = moe.config
        if any(s is None for s in stacks):
            return _Moe(None)
        held = tuple(s for s in stacks if s is not None)
        spec = (router, c.n_expert_used, c.norm_topk, c.expert_weights_scale, held)
        return _Moe(moe_args(spec, c.n_embd))

    return weights.store.views.get("ggml-moe", moe.router, _Moe, make).spec


def moe_step(weights: object, moe: MoEFeedForward, f: Tensor) -> Tensor | None:
    """One token's MoE FFN of ``f [1, 1, d]`` (normed) in one compiled call, in a decoder with
    ggml's numerics (:func:`~.ggml_moe.moe_ffn`: ggml's router, softmax, SwiGLU experts and
    weighted sum); None elsewhere (more tokens, exact numerics, a shared expert, experts ggml
    does not multiply): the caller steps."""
    if not isinstance(weights, GgmlWeights) or not ggml_norms_active() or f.shape[:2] != (1, 1):
        return None
    spec = _moe(weights, moe)
    return None if spec is None else ggml_moe_ffn(f, spec, moe.config.n_embd)


def _moe_block(
    weights: GgmlWeights, parts: tuple[Attention, MoEFeedForward], norms: tuple[str, str]
) -> tuple[object, ...] | None:
    """A MoE block's half after attention for the layer calls (:func:`~.ggml_moe.
    moe_block_args`), once per commit; ``norms``: the attention's and the FFN's."""
    attention, moe = parts
    attn_norm, ffn_norm = norms

    def make() -> tuple[object, ...] | None:
        spec = _moe(weights, moe)
        wo = _operands(weights, "ggml-wo", (attention.wo,), (ffn_norm,))
        front = _layer_weights(weights, attention, attn_norm)
        if spec is None or wo.blocks is None or wo.vectors[0] is None or front is None:
            return None
        return moe_block_args(wo.blocks[0], wo.vectors[0], spec, front.q_dim)

    held: tuple[object, ...] | None = _held(weights, "ggml-moe-block", attention.wo, make)
    return held


def block_moe_layer(
    weights: object,
    x: Tensor,
    parts: tuple[Attention, MoEFeedForward],
    norms: tuple[str, str],
    *,
    rope: RopeTables,
    keys: tuple[int, int] | None,
    cache: KVCache | None,
    eps: float,
) -> Tensor | None:
    """A pre-norm block with a MoE FFN (qwen3moe's) for one token in one compiled call, in a
    decoder with ggml's numerics and an F16 cache: the attention as :func:`block_layer`'s, the
    output product, the residual, the FFN norm (``norms``: the attention's and the FFN's),
    :func:`moe_step`'s FFN and the residual, the bits of those steps one after the other. None
    elsewhere: the caller steps."""
    attention = parts[0]
    if not _decoding(weights, x, attention, (rope, keys, cache)):
        return None
    assert isinstance(weights, GgmlWeights)
    assert keys is not None
    assert cache is not None
    block = _moe_block(weights, parts, norms)
    front = _front(weights, x, attention, norms[0], (rope, keys, cache), eps=eps)
    if front is None or block is None:
        return None
    return ggml_moe_layer(x, front, block)


def step_moe_layer(
    weights: object, parts: tuple[Attention, MoEFeedForward], norms: tuple[str, str], kind: int
) -> StepLayer | None:
    """A MoE block's part of a one-call decode step (:func:`~.ggml_step.step_weights`), of
    ``kind``, made from what :func:`block_moe_layer` reads (once per commit); None where
    :func:`block_moe_layer` would not apply whatever the step."""
    attention, _ = parts
    if not _plain(weights, attention):
        return None
    assert isinstance(weights, GgmlWeights)
    front = _layer_weights(weights, attention, norms[0])
    block = _moe_block(weights, parts, norms)
    if front is None or block is None:
        return None
    return StepLayer(front, block, kind, _scales(attention))
