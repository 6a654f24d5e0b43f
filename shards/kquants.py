"""Reference quantizers for ggml's K-quant and IQ4 types, byte-identical to llama.cpp's.

gguf-py can dequantize Q2_K..Q6_K, IQ4_NL and IQ4_XS but not quantize to them. These quantizers
follow ggml's reference code (``ggml/src/ggml-quants.c``: ``quantize_row_q{2..6}_K_ref``,
``quantize_iq4_nl``, ``quantize_iq4_xs``), which is what ``ggml_quantize_chunk`` and so
``llama-quantize`` run for these types when no importance matrix is given; the numpy port
(``shards/_kq_numpy.py``) says how it keeps ggml's bytes. ``tests/test_kquants.py`` compares the
output with bytes ``ggml_quantize_chunk`` wrote (``crosscheck/quant_golden.py``).

The same quantizers exist compiled (``shards/csrc/kquants.c``, the extension
``ggufswap.shards._kquants`` that the install builds): ggml's code statement by statement, 20 to
100 times faster (``bench/quantize.py``). :func:`quantize` uses it when it was built and this
numpy code otherwise; both write the same bytes (``tests/test_kquants.py`` runs both).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, Final

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufswap.shards._kq_numpy import (
    F32,
    Floats,
    Q,
    quantize_iq4_nl,
    quantize_iq4_xs,
    quantize_q2_k,
    quantize_q3_k,
    quantize_q4_k,
    quantize_q5_k,
    quantize_q6_k,
)

_CHUNK_ELEMENTS: Final = 1 << 16  # values per pass: bounds the temporaries, fits in cache


def _load_compiled() -> Any:
    try:
        return importlib.import_module("ggufswap.shards._kquants")
    except ImportError:  # not built (no C compiler): the numpy code below runs
        return None


_COMPILED: Final = _load_compiled()

_QUANTIZERS: Final[dict[GGMLQuantizationType, Callable[[Floats], np.ndarray]]] = {
    Q.Q2_K: quantize_q2_k,
    Q.Q3_K: quantize_q3_k,
    Q.Q4_K: quantize_q4_k,
    Q.Q5_K: quantize_q5_k,
    Q.Q6_K: quantize_q6_k,
    Q.IQ4_NL: quantize_iq4_nl,
    Q.IQ4_XS: quantize_iq4_xs,
}
TYPES: Final = tuple(_QUANTIZERS)
COMPILED_TYPES: Final = (
    frozenset() if _COMPILED is None else frozenset(Q(t) for t in _COMPILED.types())
)


def compiled_available() -> bool:
    """Whether the compiled quantizers (``ggufswap.shards._kquants``) were built."""
    return _COMPILED is not None


def _default_threads(n_values: int) -> int:
    """This process's CPUs, at most 8, and one per 64 Ki values at least."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8, n_values >> 16))


def quantize(
    values: np.ndarray,
    ggml_type: GGMLQuantizationType,
    *,
    compiled: bool | None = None,
    threads: int | None = None,
) -> np.ndarray:
    """Quantize float32 values (any shape; the size a multiple of the block size) to the raw
    bytes ``ggml_quantize_chunk`` writes for ``ggml_type`` without an importance matrix.

    Returns flat uint8. Rows do not matter to these types: blocks never span two rows when the
    row length is a multiple of the block size, which the caller checks. ``compiled``: None uses
    the compiled quantizers where they were built, False the numpy code, True requires the
    compiled ones (RuntimeError where they were not built). ``threads``: how many threads the
    compiled quantizers split the blocks over (default: the process's CPUs, at most 8, none for
    small tensors); the bytes do not depend on it.
    """
    if ggml_type not in _QUANTIZERS:
        names = ", ".join(t.name for t in TYPES)
        raise ValueError(f"no reference quantizer for {ggml_type.name}; these have one: {names}")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    flat = np.ascontiguousarray(values, dtype=F32).reshape(-1)
    if flat.size % block_size:
        raise ValueError(
            f"{ggml_type.name}: {flat.size} values are not a multiple of the block size "
            f"{block_size}"
        )
    blocks = flat.reshape(-1, block_size)
    out = np.empty((blocks.shape[0], type_size), dtype=np.uint8)
    if compiled is None:
        compiled = ggml_type in COMPILED_TYPES
    elif compiled and ggml_type not in COMPILED_TYPES:
        raise RuntimeError(
            f"{ggml_type.name}: the compiled quantizers (ggufswap.shards._kquants) were not built"
        )
    if compiled:
        n_threads = _default_threads(flat.size) if threads is None else threads
        _COMPILED.quantize(int(ggml_type), flat, out, n_threads)
        return out.reshape(-1)
    step = max(1, _CHUNK_ELEMENTS // block_size)
    with np.errstate(all="ignore"):  # lanes that ggml's code skips divide by zero here
        for start in range(0, blocks.shape[0], step):
            out[start : start + step] = _QUANTIZERS[ggml_type](blocks[start : start + step])
    return out.reshape(-1)
