"""RMS norm as llama.cpp's graphs apply it (``build_norm(..., LLM_NORM_RMS)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor

from ggufswap.runtime import rows_rms_norm
from ggufswap.runtime.models.ggml_numerics import ggml_norms_active
from ggufswap.runtime.models.ggml_numerics import rms_norm as ggml_rms_norm


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """llama.cpp's RMS norm over the last dim, in float32, scaled by ``w`` (in a forward of a
    decoder with ggml's numerics: ggml's own rounding, by the compiled row operation where it
    applies, :func:`~ggufswap.runtime.rows_rms_norm`, else :func:`.ggml_numerics.rms_norm`)."""
    if ggml_norms_active():
        fused = rows_rms_norm(x, w, eps)  # ggml's kernel, the same bits, one call
        return fused if fused is not None else ggml_rms_norm(x, w, eps)
    # F.rms_norm: x * rsqrt(mean(x^2) + eps) * w, the same float32 operations in one call; a
    # weight that broadcasts (one row per head) multiplies after
    wf = w.to(device=x.device, dtype=torch.float32)
    dim = (x.shape[-1],)
    if wf.shape == dim:
        return F.rms_norm(x.float(), dim, wf, eps).to(x.dtype)
    return (F.rms_norm(x.float(), dim, None, eps) * wf).to(x.dtype)
