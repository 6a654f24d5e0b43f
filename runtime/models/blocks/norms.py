"""RMS norm as llama.cpp's graphs apply it (``build_norm(..., LLM_NORM_RMS)``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ggufswap.runtime.models.ggml_numerics import ggml_norms_active
from ggufswap.runtime.models.ggml_numerics import rms_norm as ggml_rms_norm


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """llama.cpp's RMS norm over the last dim, in float32, scaled by ``w`` (in a forward of a
    decoder with ggml's numerics: ggml's own rounding, :func:`.ggml_numerics.rms_norm`)."""
    if ggml_norms_active():
        return ggml_rms_norm(x, w, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.to(device=x.device, dtype=torch.float32)).to(x.dtype)
