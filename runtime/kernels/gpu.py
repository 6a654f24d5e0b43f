"""Which quantized products run on the GPU from the blocks, and how to call them.

The CUDA path of :class:`~ggufswap.runtime.kernels.qmatmul.QuantizedMatrix`: for a few activation
rows on a CUDA tensor of a type in :data:`triton_qmatmul.TYPES <.triton_qmatmul.TYPES>`, the
Triton kernel multiplies from the GGUF blocks; everything else decodes and calls ``F.linear``.
Triton is an optional dependency (``pip install ggufswap[gpu]``; CUDA builds of torch bring
it): without it every product on the GPU decodes first, and :func:`unavailable` says why.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

from ggufswap.shards.ggml_types import GGMLType

__all__ = ["handles", "linear", "unavailable"]


@lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'ggufswap[gpu]')"
    try:
        from ggufswap.runtime.kernels import triton_qmatmul  # noqa: F401 (the import is the check)
    except Exception as exc:  # noqa: BLE001 (an incompatible triton fails at import many ways)
        return f"triton does not import: {type(exc).__name__}: {exc}"
    return None


def kernel_types() -> frozenset[GGMLType]:
    """The types the GPU kernel multiplies from their blocks (empty without Triton)."""
    if unavailable() is not None:
        return frozenset()
    from ggufswap.runtime.kernels.triton_qmatmul import TYPES

    return TYPES


def handles(ggml_type: int, device: torch.device, *, interpret: bool = False) -> bool:
    """Whether a product with a matrix of ``ggml_type`` on ``device`` runs the GPU kernel (a
    CUDA device; with ``interpret``, Triton's interpreter on the CPU, for the tests)."""
    on_device = device.type == "cuda" or (interpret and device.type == "cpu")
    return on_device and ggml_type in kernel_types()


def linear(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, int], x: torch.Tensor
) -> torch.Tensor:
    """``x @ W.T`` in float32 from ``W``'s blocks (``raw``, 1-D uint8 on the GPU)."""
    from ggufswap.runtime.kernels.triton_qmatmul import matmul

    return matmul(raw, GGMLType(ggml_type), shape, x.to(raw.device))
