"""A decoder's whole decode step in one compiled call (``csrc/ggmlstep.c``), for decoders with
ggml's numerics: every block as :func:`~.ggml_layer.geglu_layer` (a GeGLU block) or
:func:`~.ggml_moe.moe_layer` (a block with a MoE FFN) computes it, one after the other, then the
final RMS norm and the output head's product, the bits of those calls one by one (the head:
:meth:`~.qmatmul.QuantizedMatrix.linear`'s graph).

A step crosses from Python into C once instead of once a block plus the norm and the head. What
it reads of the store comes in :class:`StepWeights`, made once per commit by
:func:`step_weights` (a caller keeps it until the store's next commit: a swap is what the next
call reads); what changes from step to step (the token's embedding, its position, the RoPE rows
and first keys of each kind of block, the caches' buffers: :func:`step_caches`, remade when a
cache grows) comes with the call.

Each is None where it does not apply (no libggml or no attention in it, a matrix ggml does not
multiply here, inside :func:`~._ggml.float_products`, caches that are not one sequence's F16
buffers on the CPU): the caller then steps block by block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

import torch

from ggufswap.runtime.kernels import _ggml
from ggufswap.runtime.kernels.ggml_layer import LayerWeights, layer_library
from ggufswap.runtime.kernels.qmatmul import QuantizedMatrix

__all__ = [
    "RopeRow",
    "StepLayer",
    "StepWeights",
    "available",
    "decode_step",
    "rope_row",
    "step_caches",
    "step_weights",
]

_F32: Final = torch.float32
_F16: Final = torch.float16
ENTRY: Final = "decode_step"
# Kinds of blocks a step tells apart by their RoPE and keys (csrc/ggmlstep.c's MAX_KINDS).
MAX_KINDS: Final = 4


class StepLayer(NamedTuple):
    """One block of a step: its attention half's weights (:func:`~.ggml_layer.layer_weights`),
    its tail (:func:`~.ggml_layer.tail_weights`, or a MoE block's
    :func:`~.ggml_moe.moe_block_args`), which kind of block it is (its RoPE and keys)
    and its scales ``(kq_scale, q_scale)``."""

    front: LayerWeights
    tail: tuple[object, ...]
    kind: int
    scales: tuple[float, float]


class StepWeights(NamedTuple):
    """What a step reads of the store, as the C side takes it: per block ``(held, tail, kind,
    kq_scale, q_scale)``, the head ``(out_norm, w, type, rows)``; and what the per-step
    arguments must fit (each block's KV heads and head size, the row width, the kinds)."""

    layers: tuple[tuple[object, ...], ...]
    head: tuple[int, int, int, int]
    heads: tuple[tuple[int, int], ...]
    d: int
    kinds: tuple[int, ...]


def _rows(t: torch.Tensor) -> bool:
    return t.dtype is _F32 and t.is_cpu and t.is_contiguous()


def available() -> bool:
    """Whether a step can be one call here and now (a libggml whose glue has it, and not inside
    :func:`~._ggml.float_products`)."""
    return layer_library(ENTRY) is not None


def step_weights(
    layers: Sequence[StepLayer], out_norm: torch.Tensor, head: QuantizedMatrix
) -> StepWeights | None:
    """A step's weights from its blocks', the final norm's weight and the head (ggml's, in its
    blocks); None where they do not fit one call."""
    if not layers:
        return None
    d = layers[0].front.d
    n_kinds = 1 + max(layer.kind for layer in layers)
    fits = (
        all(layer.front.d == d and layer.kind >= 0 for layer in layers)
        and n_kinds <= MAX_KINDS
        and out_norm.shape == (d,)
        and _rows(out_norm)
        and head.shape[1] == d
        and head.ggml_multiplies
        and head.raw.is_contiguous()
    )
    if not fits:
        return None
    return StepWeights(
        layers=tuple((layer.front.held, layer.tail, layer.kind, *layer.scales) for layer in layers),
        head=(out_norm.data_ptr(), head.raw.data_ptr(), int(head.ggml_type), head.shape[0]),
        heads=tuple((layer.front.n_head_kv, layer.front.head_dim) for layer in layers),
        d=d,
        kinds=tuple(layer.kind for layer in layers),
    )


def step_caches(
    weights: StepWeights, buffers: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[tuple[int, int, int], ...] | None:
    """Each block's F16 caches ``(k, v [1, Hkv, cap, hd])`` as a step takes them (their
    addresses and capacity; remade when a cache's buffers are made or grown), or None where
    one is not a sequence's F16 buffers on the CPU for that block."""
    if len(buffers) != len(weights.heads):
        return None
    out = []
    for (k, v), (n_head_kv, head_dim) in zip(buffers, weights.heads, strict=True):
        fits = (
            k.shape == v.shape
            and k.dim() == 4
            and k.shape[0] == 1
            and k.shape[1] == n_head_kv
            and k.shape[3] == head_dim
            and all(t.dtype is _F16 and t.is_cpu and t.is_contiguous() for t in (k, v))
        )
        if not fits:
            return None
        out.append((k.data_ptr(), v.data_ptr(), k.shape[2]))
    return tuple(out)


RopeRow = tuple[int, int, int, bool, int]  # cos, sin (addresses), n_rot, neox, first key


def rope_row(
    cos: torch.Tensor, sin: torch.Tensor, n_rot: int, neox: bool, lo: int
) -> RopeRow | None:
    """A kind's :data:`RopeRow` from its RoPE row ``cos, sin [1, n_rot / 2]`` (float32 CPU
    rows, kept alive by the caller through the call), or None where they are not such rows."""
    fits = cos.shape == sin.shape == (1, n_rot // 2) and _rows(cos) and _rows(sin)
    return (cos.data_ptr(), sin.data_ptr(), n_rot, neox, lo) if fits else None


def decode_step(
    x: torch.Tensor,
    weights: StepWeights,
    ropes: Sequence[RopeRow],
    caches: tuple[tuple[int, int, int], ...],
    *,
    pos: int,
    eps: float,
    x_scale: float = 1.0,
) -> torch.Tensor | None:
    """``logits [1, 1, V]`` (float32, before any soft-capping) of one token ``x [1, 1, d]`` (its
    embedding, times ``x_scale`` in float32 before the first block: ``x`` is not written) at
    position ``pos``: every block, the final norm and the head in one call. ``ropes``: per kind
    of block, the addresses of the RoPE rows of ``pos`` (``n_rot / 2`` float32 each, alive
    through the call: :func:`rope_row`, or a table's rows) and the first key it attends (the
    last is ``pos``); ``caches`` as :func:`step_caches` made them, the token's keys and values
    written at ``pos``. None where the call does not apply."""
    library = layer_library(ENTRY)
    fits = (
        library is not None
        and x.shape == (1, 1, weights.d)
        and _rows(x)
        and len(ropes) == 1 + max(weights.kinds)
    )
    if not fits:
        return None
    assert library is not None
    logits = torch.empty(1, 1, weights.head[3], dtype=_F32)
    library.module.decode_step(
        weights.layers,
        (x.data_ptr(), weights.d, pos, eps, tuple(ropes), x_scale),
        caches,
        weights.head,
        logits.data_ptr(),
        _ggml.threads(),
        _ggml.SMALL_PRODUCT_BYTES,
    )
    return logits
