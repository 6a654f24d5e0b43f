"""Throughput of the torch dequantization kernels against gguf's numpy code, same bytes, same run.

    python bench/dequant.py [--quick] [--types Q8_0 Q4_K ...]

Prints one row per type (a 4096x4096-element tensor, random blocks with finite scales): MB/s of
quantized input and elements/s of ``dequantize`` into a fresh tensor, the ratio of gguf's best time
to ours, and the same for ``dequantize(..., out=)`` into a reused buffer. Best of N interleaved
repeats, torch's default thread count. Targets (ratio >= 10x on the CPU) are marked. F32 has no
meaningful ratio: gguf returns a view of the bytes, ours a copy. ``run(quick)`` returns the rows
(name, baseline_s, ours_s, ratio, target, plus throughput and into-buffer figures) for
``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from ggufswap.runtime.dequant import KERNEL_TYPES, dequantize

TARGET_RATIO = 10.0
TARGET_TYPES = frozenset(
    {
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q6_K,
    }
)
# Byte offsets of the fp16 scale fields, forced finite so both sides do ordinary arithmetic.
_F16_FIELDS = {
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
    GGMLQuantizationType.IQ4_NL: (0,),
    GGMLQuantizationType.IQ4_XS: (0,),
}


def _best_of(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Best-of-``repeats`` seconds of each, interleaved so all see the same machine load."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _random_bytes(ggml_type: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = data.reshape(-1, type_size)
    for off in _F16_FIELDS.get(ggml_type, ()):
        scales = rng.uniform(-1.0, 1.0, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8)
    if ggml_type == GGMLQuantizationType.F16:
        data = rng.standard_normal(size=(rows, cols)).astype(np.float16).view(np.uint8)
    elif ggml_type == GGMLQuantizationType.F32:
        data = rng.standard_normal(size=(rows, cols)).astype(np.float32).view(np.uint8)
    return data


def run(quick: bool, types: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every kernel type (or those named in ``types``); one row per type."""
    rows, cols = (1024, 4096) if quick else (4096, 4096)
    repeats = 3 if quick else 15
    results: list[dict[str, Any]] = []
    for ggml_type in sorted(KERNEL_TYPES, key=lambda t: t.name):
        if types and ggml_type.name not in types:
            continue
        data = _random_bytes(ggml_type, rows, cols)
        raw = torch.from_numpy(data.reshape(-1))
        ne = (cols, rows)
        dequantize(raw, ggml_type, ne)  # warm up lookup tables and the allocator
        into = torch.empty(rows, cols)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            baseline_s, ours_s, into_s = _best_of(
                [
                    partial(quants.dequantize, data, ggml_type),
                    partial(dequantize, raw, ggml_type, ne),
                    partial(dequantize, raw, ggml_type, ne, out=into),
                ],
                repeats,
            )
        results.append(
            {
                "name": f"dequant.{ggml_type.name}",
                "baseline_s": baseline_s,
                "ours_s": ours_s,
                "ratio": baseline_s / ours_s,
                "ours_into_s": into_s,
                "ratio_into": baseline_s / into_s,
                "target": TARGET_RATIO if ggml_type in TARGET_TYPES else None,
                "mb_per_s": data.nbytes / ours_s / 1e6,
                "elements_per_s": rows * cols / ours_s,
            }
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller tensor, fewer repeats")
    parser.add_argument("--types", nargs="*", help="only these GGML type names (e.g. Q8_0 Q4_K)")
    args = parser.parse_args()
    results = run(args.quick, args.types)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("ratio: fresh output tensor (the target); into: dequantize(..., out=) into a reused one")
    header = f"{'type':<8} {'gguf ms':>9} {'ours ms':>9} {'MB/s in':>9} {'Melem/s':>9} {'ratio':>7}"
    print(header + f" {'into ms':>8} {'ratio':>7}  target")
    for row in results:
        target = row["target"]
        mark = ""
        if target is not None:
            ok = float(row["ratio"]) >= float(target)
            mark = f">= {target:.0f}x {'met' if ok else 'MISSED'}"
        print(
            f"{str(row['name']).removeprefix('dequant.'):<8} {row['baseline_s'] * 1e3:>9.2f} "
            f"{row['ours_s'] * 1e3:>9.2f} {row['mb_per_s']:>9.0f} "
            f"{row['elements_per_s'] / 1e6:>9.0f} {row['ratio']:>6.1f}x "
            f"{row['ours_into_s'] * 1e3:>8.2f} {row['ratio_into']:>6.1f}x  {mark}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
