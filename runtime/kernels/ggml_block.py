"""A block's steps around its products in one compiled call each (``csrc/ggmlblock.c``), for
decoders with ggml's numerics: :func:`attn_front` (the attention's norm, q/k/v products, per-head
norms and RoPE) and :func:`geglu_tail` (a GeGLU block's half after attention).

At one token per step a gemma3 block's tail is four products and a dozen row operations (two
post norms, the FFN norm, two residual adds, GELU, its product with ``up``), and each costs its
Python and torch dispatch more than its arithmetic. :func:`geglu_tail` runs all of it in C:

    h = x + post_attn_norm(a @ Wo.T);  f = ffn_norm(h)
    y = h + post_ffw_norm(down(gelu(gate(f)) * up(f)))

with ggml's products (the same graphs as :meth:`~.qmatmul.QuantizedMatrix.linear` and
:func:`~.qmatmul.linear_all` build, so the same bits), ggml's RMS norm times the weight
(``csrc/rownorm.h``, as :func:`.rowops.rms_norm`) and GELU through a table of ggml's F16 values
that the caller gives (the decoders' own :func:`~ggufswap.runtime.models.ggml_numerics.gelu` of
every F16 value): the result is, bit for bit, what those steps compute one by one. The weights
are read where the store holds them, through the matrices the caller passes: a commit changes
what the next call reads, nothing is copied.

:func:`attn_front` likewise gives the bits of the norm (:func:`.rowops.rms_norm`), the one
graph of the three products (:func:`~.qmatmul.linear_all`) and the rotation
(:func:`.rowops.rope`).

Each is None where it does not apply (no libggml or glue, a matrix ggml does not multiply
here, inside :func:`~._ggml.float_products`, rows that are not contiguous float32 on the CPU):
the caller then computes step by step.
"""

from __future__ import annotations

from typing import Final

import torch

from ggufswap.runtime.kernels import _ggml
from ggufswap.runtime.kernels.qmatmul import QuantizedMatrix

__all__ = ["F16_VALUES", "attn_front", "geglu_tail"]

F16_VALUES: Final = 1 << 16  # the table's length: one entry per F16 bit pattern
_F32: Final = torch.float32


def _rows(t: torch.Tensor) -> bool:
    return t.dtype is _F32 and t.is_cpu and t.is_contiguous()


def _library(matrices: tuple[QuantizedMatrix, ...]) -> _ggml.Library | None:
    """The libggml that multiplies every one of ``matrices`` here and now, or None."""
    library = _ggml.library()
    if library is None or _ggml.float_only() or not hasattr(library.module, "geglu_tail"):
        return None
    if all(m.ggml and m.raw.is_contiguous() for m in matrices):
        return library
    return None


def geglu_tail(
    x: torch.Tensor,
    a: torch.Tensor,
    *,
    wo: QuantizedMatrix,
    gate: QuantizedMatrix,
    up: QuantizedMatrix,
    down: QuantizedMatrix,
    norms: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None],
    eps: float,
    gelu_table: torch.Tensor,
) -> torch.Tensor | None:
    """``y [..., d]`` of the block's tail for the residual stream ``x [..., d]`` and the
    attention's heads ``a [..., q_dim]`` (before ``wo``); ``norms``: the post-attention norm's
    weight (or None), the FFN norm's, the post-FFN norm's (or None), each float32 ``[d]``; or
    None where the compiled call does not apply."""
    d, q_dim = wo.shape
    ff = gate.shape[0]
    library = _library((wo, gate, up, down))
    shapes_fit = (
        x.shape[-1] == d
        and a.shape[:-1] == x.shape[:-1]
        and a.shape[-1] == q_dim
        and gate.shape == up.shape == (ff, d)
        and down.shape == (d, ff)
        and gelu_table.shape == (F16_VALUES,)
    )
    vectors = [t for t in norms if t is not None]
    if (
        library is None
        or not shapes_fit
        or not all(_rows(t) for t in (x, a, gelu_table, *vectors))
        or any(t.shape != (d,) for t in vectors)
        or x.numel() == 0
    ):
        return None
    y = torch.empty_like(x)
    library.module.geglu_tail(
        x.data_ptr(),
        a.data_ptr(),
        x.numel() // d,
        d,
        q_dim,
        ff,
        *((m.raw.data_ptr(), int(m.ggml_type)) for m in (wo, gate, up, down)),
        *(0 if t is None else t.data_ptr() for t in norms),
        eps,
        gelu_table.data_ptr(),
        y.data_ptr(),
        _ggml.threads(),
        _ggml.SMALL_PRODUCT_BYTES,
    )
    return y


def attn_front(
    x: torch.Tensor,
    *,
    attn_norm: torch.Tensor,
    qkv: tuple[QuantizedMatrix, QuantizedMatrix, QuantizedMatrix],
    head_norms: tuple[torch.Tensor | None, torch.Tensor | None],
    head_dim: int,
    rope: tuple[torch.Tensor, torch.Tensor, int, bool],
    eps: float,
    kv_f16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``q [B, T, H, hd], k, v [B, T, Hkv, hd]`` of the residual stream ``x [B, T, d]``:
    ``attn_norm(x)`` times each of ``qkv``, ``head_norms`` (q's, k's: float32 ``[hd]``, or
    None) per head, then q and k rotated by ``rope`` = ``(cos, sin [T, n_rot / 2], n_rot,
    neox)``; with ``kv_f16`` k and v rounded to F16 values (``.half().float()``: an F16 KV
    cache's); or None where the compiled call does not apply (``B > 1`` with ``T > 1`` too)."""
    cos, sin, n_rot, neox = rope
    bsz, seq, d = x.shape
    vectors = [attn_norm, *(t for t in head_norms if t is not None)]
    library = _library(qkv)
    rows = [m.shape[0] for m in qkv]
    fits = (
        (bsz == 1 or seq == 1)
        and all(m.shape[1] == d for m in qkv)
        and all(r % head_dim == 0 for r in rows)
        and attn_norm.shape == (d,)
        and all(t.shape == (head_dim,) for t in vectors[1:])
        and cos.shape == sin.shape == (seq, n_rot // 2)
        and 2 <= n_rot <= head_dim
    )
    if library is None or not fits or not all(_rows(t) for t in (x, cos, sin, *vectors)):
        return None
    n = bsz * seq
    q, k, v = (torch.empty(bsz, seq, r // head_dim, head_dim, dtype=_F32) for r in rows)
    step = 1 if seq > 1 else bsz  # rows a position holds, in heads: a token's, or every one's
    library.module.attn_front(
        x.data_ptr(),
        n,
        d,
        attn_norm.data_ptr(),
        *((m.raw.data_ptr(), int(m.ggml_type), m.shape[0]) for m in qkv),
        *(0 if t is None else t.data_ptr() for t in head_norms),
        head_dim,
        n_rot,
        neox,
        cos.data_ptr(),
        sin.data_ptr(),
        step * q.shape[2],
        step * k.shape[2],
        eps,
        kv_f16,
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        _ggml.threads(),
        _ggml.SMALL_PRODUCT_BYTES,
    )
    return q, k, v
