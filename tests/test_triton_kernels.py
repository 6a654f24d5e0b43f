"""The CUDA kernels of native storage (Triton) compute what decode + matmul computes, and the
dispatch sends each product to the path it should take.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
numpy): the same kernel source, checked here against ``dequantize`` + a float64 product; on a
CUDA host (``make gpu-check``) the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_dequant import random_bytes
from test_ik_types import _golden

from ggufswap.runtime.kernels import QuantizedMatrix, dequantize, gpu
from ggufswap.shards.ggml_types import GGMLType

CUDA = torch.cuda.is_available()
if not CUDA:  # set before the kernels are defined: triton.jit reads it at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

MAINLINE = [
    GGMLType.Q8_0,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
    GGMLType.IQ4_XS,
    GGMLType.MXFP4,
]
IK = {GGMLType.IQ4_K: "iq4_k", GGMLType.IQ4_KS: "iq4_ks", GGMLType.IQ2_KT: "iq2_kt"}
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(scope="module")
def kernels() -> None:
    """The kernels where Triton is installed (the ``gpu`` extra); skipped elsewhere."""
    why = gpu.unavailable()
    if why is not None:
        pytest.skip(why)


def weights(ggml_type: GGMLType) -> tuple[torch.Tensor, tuple[int, int]]:
    """A matrix's GGUF bytes and ``[rows, cols]``: random blocks with finite scales for the
    mainline types (40 rows: a partial tile), ik_llama.cpp's golden rows for its types."""
    if ggml_type in IK:
        g = _golden(IK[ggml_type])
        return torch.from_numpy(g["quant"].copy()), (g["rows"], g["n_per_row"])
    rows, cols = 40, 512
    data = random_bytes(ggml_type, (cols, rows), seed=int(ggml_type))
    if ggml_type is GGMLType.MXFP4:  # E8M0 scales near 1 (2**-10..2**10): sums stay finite
        data.reshape(-1, 17)[:, 0] = np.random.default_rng(0).integers(117, 138, size=rows * 16)
    return torch.from_numpy(data.reshape(-1).copy()), (rows, cols)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("ggml_type", [*MAINLINE, *IK], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3])
def test_kernel_matches_decode_then_matmul(ggml_type: GGMLType, m: int) -> None:
    """For each type, the kernel's x @ W.T equals the product with the decoded weights to
    float32 rounding (a float64 reference, bounded by sum |w| |x|)."""
    raw, (rows, cols) = weights(ggml_type)
    x = torch.from_numpy(np.random.default_rng(m).standard_normal((m, cols)).astype(np.float32))
    w = dequantize(raw, ggml_type, (cols, rows))  # [rows, cols] float32, the CPU kernels
    want = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 2e-6 + 1e-30
    got = gpu.linear(raw.to(DEVICE), ggml_type, (rows, cols), x.to(DEVICE)).cpu()
    assert got.dtype == torch.float32
    assert got.shape == (m, rows)
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item()} > bound"


@pytest.mark.usefixtures("kernels")
def test_quantized_matrix_uses_the_kernel_on_cuda_and_keeps_its_shape() -> None:
    """QuantizedMatrix.linear on a CUDA matrix of a kernel type takes the kernel for a few rows
    ([B, T, cols] in, [B, T, rows] out) and decodes for many; both agree."""
    if not CUDA:
        pytest.skip("needs a CUDA device (the dispatch itself is tested without one below)")
    raw, shape = weights(GGMLType.Q4_K)
    matrix = QuantizedMatrix(raw.cuda(), GGMLType.Q4_K, shape, "blk.0.ffn_down.weight")
    assert matrix.compiled
    x = torch.randn(2, 1, shape[1], device="cuda")
    few = matrix.linear(x, dtype=torch.float32)
    many = matrix.linear(x.expand(2, 16, shape[1]), dtype=torch.float32)[:, :1]
    assert few.shape == (2, 1, shape[0])
    torch.testing.assert_close(few, many, rtol=1e-4, atol=1e-4)


def test_dispatch_sends_kernel_types_on_cuda_to_the_kernel() -> None:
    """A type runs the GPU kernel exactly when it is one of the kernel's types, the matrix is on
    CUDA and Triton is installed; CPU matrices never do (they have the C kernel)."""
    installed = gpu.unavailable() is None
    for ggml_type in GGMLType:
        from_blocks = installed and ggml_type in {*MAINLINE, *IK}
        assert gpu.handles(ggml_type, torch.device("cuda", 0)) is from_blocks, ggml_type
        assert gpu.handles(ggml_type, torch.device("cpu")) is False, ggml_type
        assert gpu.handles(ggml_type, torch.device("cpu"), interpret=True) is from_blocks


def test_cpu_matrices_keep_the_compiled_c_kernel() -> None:
    """On the CPU, whether a matrix runs a compiled kernel is the C kernel's decision alone."""
    from ggufswap.runtime.kernels import _compiled

    raw, shape = weights(GGMLType.Q4_K)
    matrix = QuantizedMatrix(raw, GGMLType.Q4_K, shape, "blk.0.ffn_down.weight")
    assert matrix.compiled is _compiled.handles(GGMLType.Q4_K, shape[1], raw.device)
