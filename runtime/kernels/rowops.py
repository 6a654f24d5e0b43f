"""A decode step's row operations in one compiled call each (``csrc/rowops.c``).

At one token per step a layer's RMS norms and RoPE rotations work on a few hundred values, and
torch's composite ops cost their dispatch, not their arithmetic (``F.rms_norm`` is six ops, a
NEOX rotation a dozen). :func:`rms_norm` and :func:`rope` do each in one pass over contiguous
float32 CPU rows:

- :func:`rms_norm` is ggml's (``ggml_compute_forward_rms_norm_f32`` then the weight's mul):
  the squares summed in double, in order; the same bits as llama.cpp's CPU norm (the decoders
  with ggml's numerics norm with it; the others keep torch's float32 norm);
- :func:`rope` is the float32 arithmetic of ``RopeTables.rotate``'s torch ops, each product and
  sum rounded alike: the same bits.

Both return None where they do not apply (no compiled extension, another device or dtype, a
weight that does not match the row): the caller computes with torch then. Which one runs depends
only on the build and the tensors' kinds, so a process computes the same bits for the same
weights every time.
"""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["available", "rms_norm", "rope"]


def _load() -> ModuleType | None:
    try:
        from ggufswap.runtime.kernels import _rowops  # type: ignore[attr-defined]
    except ImportError:
        return None
    module: ModuleType = _rowops
    return module


_MODULE = _load()
_F32 = torch.float32


def available() -> bool:
    """Whether the extension was built."""
    return _MODULE is not None


def _rows(x: torch.Tensor) -> bool:
    return x.dtype is _F32 and x.is_cpu and x.is_contiguous()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """ggml's RMS norm of each row of ``x [..., n]`` times ``w [n]`` (float32 CPU), or None."""
    n = x.shape[-1]
    if _MODULE is None or not (_rows(x) and _rows(w)) or w.shape != (n,) or x.numel() == 0:
        return None
    y = torch.empty_like(x)
    _MODULE.rms_norm(x.data_ptr(), x.numel() // n, n, w.data_ptr(), eps, y.data_ptr())
    return y


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int, *, neox: bool
) -> torch.Tensor | None:
    """``x [B, T, H, hd]`` rotated by ``cos, sin [T, n_rot/2]`` (NEOX or NORM pairs; dims past
    ``n_rot`` pass), float32 CPU; or None (``B > 1`` with ``T > 1`` included: positions repeat)."""
    if _MODULE is None or x.dim() != 4 or not (_rows(x) and _rows(cos) and _rows(sin)):
        return None
    bsz, seq, heads, hd = x.shape
    repeated = bsz > 1 and seq > 1
    if x.numel() == 0 or repeated or cos.shape != (seq, n_rot // 2) or sin.shape != cos.shape:
        return None
    y = torch.empty_like(x)
    rows = bsz * seq * heads
    step = heads if seq > 1 else rows  # B > 1, T = 1: every row at the one position
    _MODULE.rope(
        x.data_ptr(), rows, step, hd, n_rot, neox, cos.data_ptr(), sin.data_ptr(), y.data_ptr()
    )
    return y
