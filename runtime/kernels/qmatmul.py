"""Products with weights still in their GGUF blocks: ggml's kernels, the compiled ones, or
decode + matmul.

A :class:`QuantizedMatrix` is a weight matrix as native storage holds it (its blocks, its type and
its logical shape). ``linear`` multiplies activations by it, by the first of these that runs:

- **ggml's own kernels** (:mod:`._ggml`: a libggml found at run time, ik_llama.cpp's or
  mainline's), for any number of activation rows, on the CPU, for the types that library
  multiplies: the activations are quantized as ggml's CPU backend does (q8_0 / q8_K per weight
  type) and multiplied by integer dot products, what llama.cpp computes, bit for bit, at
  llama.cpp's speed. Not inside :func:`~._ggml.float_products` (a decoder with exact numerics);
- for a few activation rows (decode) on CUDA, for the types :mod:`.gpu` lists, with the Triton
  kernel (:mod:`.triton_qmatmul`): the blocks are decoded in registers, tile by tile;
- for a few activation rows (decode), on the CPU, for the types ``runtime/kernels/csrc/qkernels.c``
  handles, the **compiled float kernel**: each block is decoded into L1 and multiplied there, so
  the product reads the quantized bytes once and never writes the float32 weights (float32
  arithmetic, rows split over torch's thread count);
- otherwise (many rows: prefill and perplexity batches; no compiler at install; another device
  or type) by **decoding** the matrix (the decoded cache's copy where the store keeps one, else a
  scratch buffer, :func:`~ggufswap.runtime.kernels.dequant.dequantize`) and calling ``F.linear``.

The float paths multiply the same decoded values (``gguf.quants``' float32 values, bit for bit) by
the float activations, summed in different orders: they agree to float32 rounding, not bit for
bit; ggml's rounds the activations first (llama.cpp's numerics). Which path runs depends only on
the machine, the build, the libggml found and the tensor's type: a given process always computes
the same bits for the same weights, which is what the exactness guarantee (a swapped model
computes what a fresh load computes) needs. :func:`kernels` names the path in status.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from ggufswap.runtime.kernels import _compiled, _ggml, gpu
from ggufswap.runtime.kernels.dequant import dequantize
from ggufswap.runtime.kernels.scratch import role_scratch
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType, row_nbytes

__all__ = ["QuantizedMatrix", "kernels", "linear_all"]


def kernels() -> str:
    """The kernels native storage's products run on here: ``ggml (ik_llama.cpp)`` / ``ggml``
    (with the float kernels behind them for the other types), ``compiled`` or ``torch``."""
    floats = "compiled" if _compiled.available() else "torch"
    library = _ggml.library()
    return floats if library is None else f"{library.name} + {floats}"


# Activation rows up to which the compiled kernel multiplies from the blocks; from here on,
# decoding the matrix once and a float GEMM is faster (measured on a 2048 x 7168 matrix, one
# thread: Q4_K fused 3.8 / 9.5 / 26.4 / 33.0 ms at 1 / 4 / 8 / 16 rows, decode + F.linear
# 12.5-18.0 / 26.3 / 23.3 ms).
FUSED_MAX_ROWS = 8
# A matrix decoded for a product without the decoded cache is decoded in bands of rows of at most
# this many bytes (the scratch of one tensor role and thread).
SCRATCH_BYTES = 64 << 20


@dataclass(frozen=True, eq=False)
class QuantizedMatrix:
    """A ``[rows, cols]`` weight matrix held as GGUF blocks (``raw``: uint8, exactly its bytes).

    ``name`` is the tensor it belongs to (its role keys the decode scratch of the torch path).
    ``decoded``, when given, returns the matrix decoded (the store's decoded cache): products
    with many activation rows use it instead of decoding into scratch each time.
    """

    raw: torch.Tensor
    ggml_type: GGMLType
    shape: tuple[int, int]
    name: str
    decoded: Callable[[], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        block_size = LAYOUTS[GGMLType(self.ggml_type)].block_size
        rows, cols = self.shape
        expected = rows * row_nbytes(self.ggml_type, cols)
        if cols % block_size or self.raw.dtype != torch.uint8 or self.raw.shape != (expected,):
            raise ValueError(
                f"{self.name}: {self.ggml_type.name} [{rows}, {cols}] needs {expected} bytes "
                f"(uint8, 1-D), found {self.raw.dtype} {tuple(self.raw.shape)}"
            )

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @functools.cached_property
    def _library(self) -> _ggml.Library | None:
        """The libggml that multiplies this matrix (its type, row length and device), if any."""
        library = _ggml.library()
        if library is None or not library.multiplies(
            self.ggml_type, self.shape[1], self.raw.device
        ):
            return None
        return library

    @property
    def ggml_multiplies(self) -> bool:
        """Whether the loaded libggml multiplies this matrix (outside
        :func:`~._ggml.float_products`: :attr:`ggml` says whether it does here, now)."""
        return self._library is not None

    @property
    def ggml(self) -> bool:
        """Whether :meth:`linear` runs ggml's kernels for this matrix (here, now)."""
        return self._library is not None and not _ggml.float_only()

    @property
    def compiled(self) -> bool:
        """Whether :meth:`linear` runs a compiled float kernel for a few activation rows: the C
        kernel on the CPU, the Triton kernel on CUDA (:mod:`.gpu`)."""
        if self.raw.device.type != "cpu":
            return gpu.handles(self.ggml_type, self.raw.device)
        return _compiled.handles(self.ggml_type, self.shape[1], self.raw.device)

    @property
    def multiplies_blocks(self) -> bool:
        """Whether :meth:`linear` multiplies from the blocks for a decode step (ggml's kernels
        or the compiled ones), rather than from a decoded copy."""
        return self.ggml or self.compiled

    def decode(self, dtype: torch.dtype, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of the matrix decoded into this thread's scratch for its role
        (valid until the next matrix of that role is decoded)."""
        rows, cols = self.shape
        stop = rows if stop is None else stop
        row_bytes = self.raw.numel() // rows
        out = role_scratch(self.name, (stop - start, cols), dtype, self.raw.device)
        raw = self.raw[start * row_bytes : stop * row_bytes]
        return dequantize(raw, self.ggml_type, (cols, stop - start), dtype=dtype, out=out)

    def linear(self, x: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
        """``x @ W.T`` on the matrix's device: float32 from ggml's kernels (any number of rows)
        or the compiled kernel (a few activation rows: < ``FUSED_MAX_ROWS``), else in ``dtype``
        (the compute dtype) from the decoded matrix (``decoded``, or this thread's scratch)."""
        rows, cols = self.shape
        library = self._library
        if library is not None and not _ggml.float_only():
            return library.mul_mat(self.raw, self.ggml_type, self.shape, x)
        n = x.numel() // cols
        if self.decoded is not None and (not self.compiled or n >= FUSED_MAX_ROWS):
            w = self.decoded()
            return F.linear(x.to(device=w.device, dtype=w.dtype), w)
        if not self.compiled or n >= FUSED_MAX_ROWS:
            return self._decoded_linear(x, dtype)
        if self.raw.device.type != "cpu":  # the GPU's kernel (Triton), from the blocks
            return gpu.linear(self.raw, self.ggml_type, self.shape, x)
        flat = x.to(device="cpu", dtype=torch.float32).reshape(-1, cols).contiguous()
        out = torch.empty(flat.shape[0], rows, dtype=torch.float32)
        raw = self.raw if self.raw.is_contiguous() else self.raw.contiguous()
        _compiled.module().matmul(
            raw.data_ptr(),
            int(self.ggml_type),
            rows,
            cols,
            flat.data_ptr(),
            flat.shape[0],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out.view(*x.shape[:-1], rows)

    def _decoded_linear(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x @ W.T`` decoding ``W`` into scratch a band of rows at a time (at most
        ``SCRATCH_BYTES`` each), so that no matrix, however large (an output head of a big
        vocabulary), needs its whole float copy."""
        rows, cols = self.shape
        # a multiple of 16 rows: ik's row-interleaved types decode whole groups of 4, 8 or 16
        band = max(16, SCRATCH_BYTES // (cols * dtype.itemsize) // 16 * 16)
        xd = x.to(device=self.raw.device, dtype=dtype)
        if band >= rows:
            return F.linear(xd, self.decode(dtype))
        out = torch.empty(*x.shape[:-1], rows, dtype=dtype, device=self.raw.device)
        for start in range(0, rows, band):
            stop = min(start + band, rows)
            out[..., start:stop] = F.linear(xd, self.decode(dtype, start, stop))
        return out


# The most matrices one ggml call multiplies by the same activations (csrc/ggmlcall.c).
MAX_SHARED = 4


def linear_all(
    x: torch.Tensor, matrices: list[QuantizedMatrix], *, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``[m.linear(x) for m in matrices]``: one ggml call where ggml multiplies every one of them
    (a layer's q, k and v, or gate and up: the activations quantized once), the same values as
    one call each; else each matrix's own :meth:`~QuantizedMatrix.linear`."""
    library = matrices[0]._library if matrices else None
    same = all(m._library is library and m.shape[1] == x.shape[-1] for m in matrices)
    if library is None or not same or len(matrices) > MAX_SHARED or _ggml.float_only():
        return [m.linear(x, dtype=dtype) for m in matrices]
    return library.mul_mats(x, [(m.raw, m.ggml_type, m.shape[0]) for m in matrices])
