"""One token through a MoE FFN of stacked SwiGLU experts, and through a whole pre-norm block with
one, each in one compiled call (``csrc/ggmlmoe.c``, ``csrc/ggmlblock.c``), for decoders with
ggml's numerics: llama.cpp's ``build_moe_ffn`` as its graph computes it on the CPU.

:func:`moe_ffn`: ``probs = soft_max(router @ f)`` (ggml's ``mul_mat`` and ``soft_max`` nodes),
the ``k`` experts of the largest probabilities, largest first, their weights divided by their
sum (summed in double, as ``ggml_sum_rows``) where the model normalises them, times the model's
scale; the experts' ``down(silu(gate(f)) * up(f))`` in one ggml graph (``mul_mat_id``, ``silu``,
``mul``), the outputs times their weights added in slot order (``ggml_mul`` then one
``ggml_add`` per slot). The results are ggml's own: its SIMD ``expf`` in the softmax and SiLU,
not torch's, so they differ from the torch steps' (``blocks/moe.py``) in the last bits.

:func:`moe_layer`: a qwen3moe-style block for one token: the attention
(:func:`~.ggml_layer.geglu_layer`'s front, cache write and :func:`~.ggml_layer.flash_attn`), the
output product, the residual, the FFN norm, :func:`moe_ffn` and the residual: the bits of those
steps one after the other.

Each is None where it does not apply (no libggml or no such nodes in it, a stack or matrix ggml
does not multiply here, inside :func:`~._ggml.float_products`, more than one token): the caller
then steps. Weights are read where the store holds them.
"""

from __future__ import annotations

from typing import Final

import torch

from ggufswap.runtime.kernels import _ggml
from ggufswap.runtime.kernels.experts import QuantizedExperts
from ggufswap.runtime.kernels.ggml_layer import Front, layer_call, layer_library
from ggufswap.runtime.kernels.qmatmul import QuantizedMatrix
from ggufswap.shards.ggml_types import GGMLType

__all__ = [
    "MAX_USED",
    "MoeSpec",
    "moe_args",
    "moe_block_args",
    "moe_ffn",
    "moe_layer",
]

MAX_USED: Final = 64  # experts a token may use here (csrc/ggmlcall.h's MAX_USED)
_F32: Final = torch.float32

# (router [E, d] float32, experts used, normalise the weights, their scale, (gate, up, down))
MoeSpec = tuple[torch.Tensor, int, bool, float, tuple[QuantizedExperts, ...]]


def moe_args(moe: MoeSpec, d: int) -> tuple[object, ...] | None:
    """``moe`` = (router, k, norm, scale, (gate, up, down)) as the C side's ``parse_moe`` reads
    it, for activations of width ``d`` (made and checked once: a caller keeps it until the
    store's next commit); None where the experts do not fit."""
    router, k, norm, scale, stacks = moe
    if len(stacks) != 3:
        return None
    gate, up, down = stacks
    n_expert, ff = gate.shape[0], gate.shape[1]
    fits = (
        router.shape == (n_expert, d)
        and router.dtype is _F32
        and router.is_cpu
        and router.is_contiguous()
        and 1 <= k <= min(n_expert, MAX_USED)
        and gate.shape == up.shape == (n_expert, ff, d)
        and down.shape == (n_expert, d, ff)
        and all(s.ggml_multiplies and s.raw.is_contiguous() for s in stacks)
    )
    if not fits:
        return None
    return (
        (router.data_ptr(), int(GGMLType.F32), n_expert),
        k,
        norm,
        scale,
        tuple((s.raw.data_ptr(), int(s.ggml_type)) for s in stacks),
        ff,
    )


def _one_token(t: torch.Tensor, d: int) -> bool:
    return t.numel() == d and t.dtype is _F32 and t.is_cpu and t.is_contiguous()


def moe_ffn(f: torch.Tensor, moe: tuple[object, ...], d: int) -> torch.Tensor | None:
    """The MoE FFN of one token's normed activations ``f [..., d]`` (one row): ``[..., d]``, or
    None where the call does not apply; ``moe`` as :func:`moe_args` made it for ``d``."""
    library = layer_library("moe_layer")
    if library is None or not _one_token(f, d):
        return None
    y = torch.empty_like(f)
    library.module.moe_ffn(
        f.data_ptr(), d, moe, y.data_ptr(), _ggml.threads(), _ggml.SMALL_PRODUCT_BYTES
    )
    return y


def moe_block_args(
    wo: QuantizedMatrix, ffn_norm: torch.Tensor, moe: tuple[object, ...], q_dim: int
) -> tuple[object, ...] | None:
    """A MoE block's half after attention as :func:`moe_layer` passes it (made and checked
    once): ``wo`` (``[d, q_dim]``, ggml's), the FFN norm's weight, ``moe`` as :func:`moe_args`
    made it; None where they do not fit."""
    d = wo.shape[0]
    fits = (
        wo.shape == (d, q_dim)
        and wo.ggml_multiplies
        and wo.raw.is_contiguous()
        and _one_token(ffn_norm, d)
    )
    if not fits:
        return None
    return ((wo.raw.data_ptr(), int(wo.ggml_type)), ffn_norm.data_ptr(), moe)


def moe_layer(x: torch.Tensor, front: Front, block: tuple[object, ...]) -> torch.Tensor | None:
    """``y [1, 1, d]``: one token ``x [1, 1, d]`` through a pre-norm block with a MoE FFN;
    ``front`` as :func:`~.ggml_layer.front_args` made it for ``x``, ``block`` as
    :func:`moe_block_args` made it; None where the call does not apply."""
    return layer_call("moe_layer", x, front, block)
