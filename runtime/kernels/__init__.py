"""ggufswap.runtime.kernels: dequantization and quantized products, dispatched by type and CPU.

- :mod:`.dequant` decodes GGUF blocks to floats (:func:`dequantize`): the compiled decoder where
  the install built it (:mod:`._compiled`, ``csrc/qkernels.c``), else the torch kernels of
  :mod:`._mainline` and :mod:`._iq` (over their shared :mod:`._base`), :mod:`._ik` and
  :mod:`._ik_interleaved` for ik_llama.cpp's types;
- :mod:`.qmatmul` multiplies activations by weights still in their blocks
  (:class:`QuantizedMatrix`): through ggml's own kernels where a libggml is found at run time
  (:mod:`._ggml`, ``csrc/ggmlcall.c``), else the compiled float kernels, else decoding into
  per-role scratch (:mod:`.scratch`);
- :mod:`.rowops` computes a decode step's RMS norms and RoPE rotations in one compiled call
  each (``csrc/rowops.c``; None where it does not apply: the caller's torch ops then);
- :mod:`.experts` multiplies a MoE layer's routed experts in one call per projection
  (:class:`QuantizedExperts`: ggml's ``mul_mat_id``; :func:`grouped` for any stack).

This package imports torch, the GGML type tables of :mod:`ggufswap.shards` and the runtime's
error classes, never the rest of the core: the core calls it.
"""

from __future__ import annotations

from ggufswap.runtime.kernels._ggml import describe as ggml_describe
from ggufswap.runtime.kernels._ggml import float_products
from ggufswap.runtime.kernels._ggml import library as ggml_library
from ggufswap.runtime.kernels._ggml import select as ggml_select
from ggufswap.runtime.kernels.dequant import KERNEL_TYPES, decode_rows, dequantize, has_kernel
from ggufswap.runtime.kernels.experts import QuantizedExperts, grouped, routed_all
from ggufswap.runtime.kernels.ggml_block import attn_front as ggml_attn_front
from ggufswap.runtime.kernels.ggml_block import geglu_tail as ggml_geglu_tail
from ggufswap.runtime.kernels.ggml_layer import flash_attn as ggml_flash_attn
from ggufswap.runtime.kernels.ggml_layer import front_args as ggml_front_args
from ggufswap.runtime.kernels.ggml_layer import geglu_layer as ggml_geglu_layer
from ggufswap.runtime.kernels.ggml_moe import moe_ffn as ggml_moe_ffn
from ggufswap.runtime.kernels.ggml_moe import moe_layer as ggml_moe_layer
from ggufswap.runtime.kernels.qmatmul import QuantizedMatrix, kernels, linear_all
from ggufswap.runtime.kernels.rowops import rms_norm as rows_rms_norm
from ggufswap.runtime.kernels.rowops import rope as rows_rope
from ggufswap.runtime.kernels.scratch import role_scratch

__all__ = [
    "KERNEL_TYPES",
    "QuantizedExperts",
    "QuantizedMatrix",
    "decode_rows",
    "dequantize",
    "float_products",
    "ggml_attn_front",
    "ggml_describe",
    "ggml_flash_attn",
    "ggml_front_args",
    "ggml_geglu_layer",
    "ggml_geglu_tail",
    "ggml_library",
    "ggml_moe_ffn",
    "ggml_moe_layer",
    "ggml_select",
    "grouped",
    "has_kernel",
    "kernels",
    "linear_all",
    "role_scratch",
    "routed_all",
    "rows_rms_norm",
    "rows_rope",
]
