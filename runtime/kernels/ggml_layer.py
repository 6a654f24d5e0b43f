"""One token's attention over an F16 KV cache as ggml computes it, and a whole GeGLU block for one
token in one compiled call (``csrc/ggmlblock.c``, ``csrc/ggmlcall.c``), for decoders with ggml's
numerics.

:func:`flash_attn` is llama.cpp's attention node on the CPU: ``ggml_flash_attn_ext`` of one
token's queries over the keys and values ``lo .. hi - 1`` of an F16 cache, read where the cache
holds them (views, no copy), with the accumulator precision llama.cpp asks for (F32 on mainline's
library; ik_llama.cpp's default on its fork). Its results are ggml's, not torch's: the queries
are rounded to F16 for the dot products, as ggml's kernel does.

:func:`geglu_layer` runs a GeGLU block (gemma3's) for one token in one call: the attention's front
(:func:`~.ggml_block.attn_front`), the token's keys and values written to the caches, ``q`` times
``q_scale`` (llama.cpp's ``ggml_scale`` of ``Qcur`` in gemma3's graph), :func:`flash_attn` and the
tail (:func:`~.ggml_block.geglu_tail`): the bits of those calls one after the other, with one
crossing from Python into C per block instead of three and no torch operation between them.

Each is None where it does not apply (no libggml or no attention in it, a matrix ggml does not
multiply here, inside :func:`~._ggml.float_products`, a cache that is not one sequence's F16
buffers on the CPU): the caller then steps.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import torch

from ggufswap.runtime.kernels import _ggml
from ggufswap.runtime.kernels.ggml_block import F16_VALUES
from ggufswap.runtime.kernels.qmatmul import QuantizedMatrix

__all__ = [
    "Front",
    "LayerWeights",
    "flash_attn",
    "front_args",
    "geglu_layer",
    "layer_weights",
    "tail_weights",
]

_F32: Final = torch.float32
_F16: Final = torch.float16


def layer_library(entry: str = "geglu_layer") -> _ggml.Library | None:
    """The libggml in use whose compiled module has ``entry`` (None: ggml's products are off, or
    the module predates it)."""
    library = _ggml.library()
    if library is None or _ggml.float_only() or not hasattr(library.module, entry):
        return None
    return library


def layer_call(
    entry: str, x: torch.Tensor, front: Front, block: tuple[object, ...]
) -> torch.Tensor | None:
    """``y [1, 1, d]``: one token ``x [1, 1, d]`` through the compiled one-block call ``entry``
    (``front`` as :func:`front_args` made it for ``x``, ``block`` the rest of the block's
    arguments as its maker made them); None where the call does not apply."""
    library = layer_library(entry)
    if library is None:
        return None
    y = torch.empty_like(x)
    getattr(library.module, entry)(
        front.front, front.cache, block, y.data_ptr(), _ggml.threads(), _ggml.SMALL_PRODUCT_BYTES
    )
    return y


def _cache_fits(k: torch.Tensor, v: torch.Tensor, head_dim: int) -> bool:
    """Whether ``k, v`` are one sequence's F16 cache buffers ``[1, Hkv, cap, hd]`` on the CPU."""
    return (
        k.shape == v.shape
        and k.dim() == 4
        and k.shape[0] == 1
        and k.shape[3] == head_dim
        and all(t.dtype is _F16 and t.is_cpu and t.is_contiguous() for t in (k, v))
    )


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: tuple[int, int],
    *,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor | None:
    """``[H * hd]`` float32: one token's queries ``q [H, hd]`` (float32) attending the keys and
    values ``keys = (lo, hi)`` of the F16 caches ``k, v [1, Hkv, cap, hd]`` (query head ``h``
    reads kv head ``h // (H / Hkv)``), scores times ``scale``; or None where ggml's attention
    does not apply here."""
    library = layer_library()
    heads, head_dim = q.shape
    lo, hi = keys
    if (
        library is None
        or not _cache_fits(k, v, head_dim)
        or q.dtype is not _F32
        or not q.is_contiguous()
        or heads % k.shape[1]
        or not 0 <= lo < hi <= k.shape[2]
    ):
        return None
    y = torch.empty(heads * head_dim, dtype=_F32)
    library.module.flash_attn(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        y.data_ptr(),
        head_dim,
        heads,
        k.shape[1],
        k.shape[2],
        lo,
        hi,
        scale,
        softcap,
        _ggml.threads(),
        _ggml.SMALL_PRODUCT_BYTES,
    )
    return y


def _rows(t: torch.Tensor) -> bool:
    return t.dtype is _F32 and t.is_cpu and t.is_contiguous()


class LayerWeights(NamedTuple):
    """A layer call's weights for its attention half, as the C side's ``parse_front`` reads
    them (made and checked once by :func:`layer_weights`; a caller keeps it until the store's
    next commit), and the shapes the per-step arguments must fit."""

    held: tuple[object, ...]
    d: int
    q_dim: int
    n_head_kv: int
    head_dim: int


class Front(NamedTuple):
    """A layer call's attention half for one step, as ``parse_front`` reads it (made and checked
    by :func:`front_args`), and the width of its heads' output (``wo``'s columns)."""

    front: tuple[object, ...]
    cache: tuple[object, ...]
    q_dim: int


def layer_weights(
    attn_norm: torch.Tensor,
    qkv: tuple[QuantizedMatrix, QuantizedMatrix, QuantizedMatrix],
    head_norms: tuple[torch.Tensor | None, torch.Tensor | None],
    head_dim: int,
) -> LayerWeights | None:
    """The attention half's weights: ``attn_norm``'s, the ``qkv`` matrices (ggml's, in their
    blocks), ``head_norms`` (q's, k's, or None); None where they do not fit a layer call."""
    d = attn_norm.shape[0]
    rows = [m.shape[0] for m in qkv]
    vectors = [attn_norm, *(t for t in head_norms if t is not None)]
    fits = (
        attn_norm.shape == (d,)
        and all(m.shape[1] == d for m in qkv)
        and rows[0] % head_dim == 0
        and rows[1] == rows[2]
        and rows[1] % head_dim == 0
        and rows[0] % rows[1] == 0
        and all(t.shape == (head_dim,) for t in vectors[1:])
        and all(m.ggml_multiplies and m.raw.is_contiguous() for m in qkv)
        and all(_rows(t) for t in vectors)
    )
    if not fits:
        return None
    held = (
        attn_norm.data_ptr(),
        *((m.raw.data_ptr(), int(m.ggml_type), m.shape[0]) for m in qkv),
        *(0 if t is None else t.data_ptr() for t in head_norms),
        head_dim,
    )
    return LayerWeights(held, d, rows[0], rows[1] // head_dim, head_dim)


def front_args(
    x: torch.Tensor,
    weights: LayerWeights,
    *,
    rope: tuple[torch.Tensor, torch.Tensor, int, bool],
    eps: float,
    cache: tuple[torch.Tensor, torch.Tensor, int, int],
    scales: tuple[float, float],
) -> Front | None:
    """A layer call's attention half for one token ``x [1, 1, d]`` with ``weights``, or None
    where it does not fit: ``rope = (cos, sin [1, n_rot / 2], n_rot, neox)``, the token's keys
    and values written at ``pos`` of the F16 caches, attending keys ``lo .. pos``: ``cache =
    (k, v [1, Hkv, cap, hd], pos, lo)``; ``scales = (kq_scale, q_scale)``."""
    k_cache, v_cache, pos, lo = cache
    cos, sin, n_rot, neox = rope
    hd = weights.head_dim
    fits = (
        x.shape == (1, 1, weights.d)
        and _cache_fits(k_cache, v_cache, hd)
        and k_cache.shape[1] == weights.n_head_kv
        and 0 <= lo <= pos < k_cache.shape[2]
        and cos.shape == sin.shape == (1, n_rot // 2)
        and 2 <= n_rot <= hd
        and _rows(x)
        and _rows(cos)
        and _rows(sin)
    )
    if not fits:
        return None
    kq_scale, q_scale = scales
    front = (
        x.data_ptr(),
        weights.d,
        weights.held,
        n_rot,
        neox,
        cos.data_ptr(),
        sin.data_ptr(),
        eps,
    )
    held = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2], pos, lo)
    return Front(front, (*held, kq_scale, q_scale, 0.0), weights.q_dim)


def tail_weights(
    tail: tuple[QuantizedMatrix, QuantizedMatrix, QuantizedMatrix, QuantizedMatrix],
    norms: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None],
    gelu_table: torch.Tensor,
    q_dim: int,
) -> tuple[object, ...] | None:
    """A GeGLU block's tail as :func:`geglu_layer` passes it (made and checked once; a caller
    keeps it until the store's next commit): ``tail = (wo, gate, up, down)``, ``norms``: the
    post-attention, FFN and post-FFN norms' weights (a post norm None where the block has none),
    ``gelu_table`` as :func:`~.ggml_block.geglu_tail` takes it, ``q_dim`` ``wo``'s columns;
    None where they do not fit."""
    wo, gate, up, down = tail
    d = wo.shape[0]
    vectors = [t for t in norms if t is not None]
    fits = (
        wo.shape == (d, q_dim)
        and gate.shape == up.shape
        and gate.shape[1] == d
        and down.shape == (d, gate.shape[0])
        and gelu_table.shape == (F16_VALUES,)
        and all(m.ggml_multiplies and m.raw.is_contiguous() for m in tail)
        and all(_rows(t) and t.shape == (d,) for t in vectors)
        and _rows(gelu_table)
    )
    if not fits:
        return None
    return (
        *((m.raw.data_ptr(), int(m.ggml_type)) for m in tail),
        gate.shape[0],
        *(0 if t is None else t.data_ptr() for t in norms),
        gelu_table.data_ptr(),
    )


def geglu_layer(x: torch.Tensor, front: Front, tail: tuple[object, ...]) -> torch.Tensor | None:
    """``y [1, 1, d]``: one token ``x [1, 1, d]`` through a GeGLU block: ``front`` as
    :func:`front_args` made it for ``x``, ``tail`` as :func:`tail_weights` made it. None where
    the call does not apply."""
    return layer_call("geglu_layer", x, front, tail)
