"""Speed of the reference K-quant/IQ4 quantizers (``shards.kquants``): compiled against numpy.

    python bench/quantize.py [--quick] [--types Q4_K IQ4_XS ...] [--repeats 3] [--cpu N]

The same float32 tensor (4096-value rows of N(0, 0.02): 256 rows, 4 MiB; 64 rows with --quick)
is quantized to each type by the compiled quantizers (``shards/csrc/kquants.c``, ours) and, as
the baseline measured in the same run, by the numpy ones (``compiled=False``: the same bytes);
gguf-py's numpy Q8_0 (a one-pass algorithm, where the K-quants search 16 to 21 candidate scales
per sub-block) is timed beside them for scale. Each figure is the best of ``--repeats``
interleaved runs. All are single-threaded; the process is pinned to one CPU (``--cpu``, default
the first of its affinity mask) while measuring, so figures taken on different days compare.
``ratio`` is numpy seconds / compiled seconds. Without the compiled extension, ours is numpy
(ratio 1). ``run(quick)`` returns the rows for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, quants

from ggufswap.shards import kquants

COLS = 4096


def _best(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def run(
    quick: bool,
    types: list[str] | None = None,
    *,
    repeats: int = 3,
    cpu: int | None = None,
) -> list[dict[str, Any]]:
    """One row per type: numpy seconds, compiled seconds, the ratio, MB/s of input of each and
    of gguf-py's Q8_0."""
    selected = [GGMLQuantizationType[t.upper()] for t in types] if types else list(kquants.TYPES)
    rows = 64 if quick else 256
    x = np.random.default_rng(0).standard_normal((rows, COLS), dtype=np.float32)
    x *= np.float32(0.02)
    before = os.sched_getaffinity(0)
    pinned = min(before) if cpu is None else cpu
    os.sched_setaffinity(0, {pinned})
    try:
        out = []
        for ggml_type in selected:
            q8_s, baseline_s, ours_s = _best(
                [
                    lambda: quants.quantize(x, GGMLQuantizationType.Q8_0),
                    lambda t=ggml_type: kquants.quantize(x, t, compiled=False),
                    lambda t=ggml_type: kquants.quantize(x, t),
                ],
                repeats,
            )
            out.append(
                {
                    "name": f"quantize {ggml_type.name} ({rows}x{COLS})",
                    "baseline_s": baseline_s,
                    "ours_s": ours_s,
                    "ratio": baseline_s / ours_s,
                    "target": None,
                    "ours_mb_s": x.nbytes / ours_s / 1e6,
                    "baseline_mb_s": x.nbytes / baseline_s / 1e6,
                    "q8_0_mb_s": x.nbytes / q8_s / 1e6,
                    "compiled": ggml_type in kquants.COMPILED_TYPES,
                    "cpu": pinned,
                }
            )
        return out
    finally:
        os.sched_setaffinity(0, before)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--types", nargs="+", metavar="TYPE")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", type=int, help="CPU to pin to while measuring")
    args = parser.parse_args()
    results = run(args.quick, args.types, repeats=args.repeats, cpu=args.cpu)
    print(f"numpy {np.__version__}, one thread pinned to CPU {results[0]['cpu']}")
    print(f"{'':32} {'numpy':>12} {'compiled':>12} {'ratio':>8} {'Q8_0 (gguf-py)':>16}")
    for r in results:
        compiled = f"{r['ours_mb_s']:7.2f} MB/s" if r["compiled"] else "  not built"
        print(
            f"{r['name']:32} {r['baseline_mb_s']:7.2f} MB/s {compiled} {r['ratio']:8.2f} "
            f"{r['q8_0_mb_s']:11.1f} MB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
