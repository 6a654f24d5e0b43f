"""Throughput of the torch dequantization kernels against gguf's numpy code, same bytes, same run.

    python bench/dequant.py [--quick] [--types Q8_0 Q4_K ...] [--threads N] [--rounds 3]

Prints one row per type (a 4096x4096-element tensor, random blocks with finite scales): the ratio
of gguf's time to ours for ``dequantize`` into a fresh tensor (the target) and into a reused
buffer (``out=``), as the median and the minimum over ``--rounds`` rounds; each round takes the
best of N interleaved repeats of the calls, so every ratio compares times taken under the same
machine load. ``floor`` is gguf's time over that of allocating a new tensor of the result's size
(as ``dequantize`` does) and filling it once: the page faults and kernel zeroing every new result
pays, so about the most a decoder into a new tensor can reach there. Torch runs with the
runtime's thread policy (``ggufswap.runtime.threads``: ``--threads``, else ``OMP_NUM_THREADS``,
else one thread per CPU of the affinity mask), printed in the header, so that figures taken on
different days compare. Targets (median ratio >= 10x on the CPU) are marked. F32 has no
meaningful ratio: gguf returns a view of the bytes, ours a copy.

ik_llama.cpp's types have no numpy decoder to compare with: their rows (written by the project's
writer, valid blocks; the row-interleaved ``_R4``/``_R8`` types: ik's own bytes from the golden
files in ``tests/fixtures/ik_golden``, tiled to the size) report GB/s of float32 output and the
ratio of our Q8_0 ``dequantize`` time on the same element count, measured in the same rounds
(``ratio`` > 1: faster than Q8_0). A type the compiled decoder handles (``IQ4_KS``) also reports
the torch kernels' GB/s (``torch GB/s``), measured in the same rounds with the compiled decoder
turned off.
``run(quick)`` returns the rows (name, baseline_s, ours_s, ratio, target, plus the per-round
ratios, the into-buffer and floor figures) for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from ggufswap._logsetup import configure_logging
from ggufswap.runtime.kernels import _compiled, dequant
from ggufswap.runtime.kernels._ik import IK_KERNELS
from ggufswap.runtime.kernels._ik_interleaved import INTERLEAVED
from ggufswap.runtime.kernels.dequant import KERNEL_TYPES, dequantize
from ggufswap.runtime.threads import AppliedThreads, apply_thread_policy, resolve_threads
from ggufswap.shards._synth import synth_ik_tensor
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ik_golden"

TARGET_RATIO = 10.0
ROUNDS = 3
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
    GGMLQuantizationType.IQ1_S: (0,),
    GGMLQuantizationType.IQ2_XXS: (0,),
    GGMLQuantizationType.IQ2_XS: (0,),
    GGMLQuantizationType.IQ2_S: (0,),
    GGMLQuantizationType.IQ3_XXS: (0,),
    GGMLQuantizationType.IQ3_S: (0,),
    GGMLQuantizationType.TQ1_0: (52,),
    GGMLQuantizationType.TQ2_0: (64,),
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
    if ggml_type == GGMLQuantizationType.IQ1_M:  # d: the top nibbles of the scale words at 48
        d = rng.uniform(-1.0, 1.0, size=blocks.shape[0]).astype(np.float16).view(np.uint16)
        for i, byte in enumerate((49, 51, 53, 55)):
            nibble = ((d >> (4 * i)) & 0x0F).astype(np.uint8)
            blocks[:, byte] = (blocks[:, byte] & 0x0F) | (nibble << 4)
    elif ggml_type == GGMLQuantizationType.MXFP4:  # E8M0 scales around 1
        blocks[:, 0] = rng.integers(110, 140, size=blocks.shape[0], dtype=np.uint8)
    if ggml_type == GGMLQuantizationType.F16:
        data = rng.standard_normal(size=(rows, cols)).astype(np.float16).view(np.uint8)
    elif ggml_type == GGMLQuantizationType.F32:
        data = rng.standard_normal(size=(rows, cols)).astype(np.float32).view(np.uint8)
    return data


def fresh_fill(numel: int) -> torch.Tensor:
    """The least a new float32 result of ``numel`` values costs: allocated as ``dequantize``
    allocates one, then written once (torch's fill, over the policy's threads). Every page is
    new, so the kernel zeroes it on first touch; a decoder into a new tensor pays that too."""
    return dequant._empty(numel, torch.float32, torch.device("cpu")).fill_(1.0)


def pin_threads(threads: int | None) -> AppliedThreads:
    """Apply the runtime's thread policy (``threads`` overrides it) as ``ggufswap runtime`` does."""
    return apply_thread_policy(resolve_threads(flag=threads))


def run(
    quick: bool,
    types: list[str] | None = None,
    *,
    threads: int | None = None,
    rounds: int = ROUNDS,
) -> list[dict[str, Any]]:
    """Measure every kernel type (or those named in ``types``); one row per type.

    Runs under the thread policy (``threads`` overrides it) and restores torch's intra-op count
    afterwards, for the benchmarks that ``bench/run_all.py`` runs next.
    """
    size, repeats = ((1024, 4096), 3) if quick else ((4096, 4096), 9)
    before = torch.get_num_threads()
    applied = pin_threads(threads)
    try:
        return [
            _measure(ggml_type, size, repeats=repeats, rounds=rounds, applied=applied)
            for ggml_type in sorted(
                KERNEL_TYPES - IK_KERNELS.keys() - INTERLEAVED.keys(), key=lambda t: t.name
            )
            if not types or ggml_type.name in types
        ] + [
            _measure_ik(ggml_type, size, repeats=repeats, rounds=rounds, applied=applied)
            for ggml_type in sorted(IK_KERNELS.keys() | INTERLEAVED.keys(), key=lambda t: t.name)
            if not types or ggml_type.name in types
        ]
    finally:
        torch.set_num_threads(before)


def _measure(
    ggml_type: GGMLQuantizationType,
    size: tuple[int, int],
    *,
    repeats: int,
    rounds: int,
    applied: AppliedThreads,
) -> dict[str, Any]:
    rows, cols = size
    data = _random_bytes(ggml_type, rows, cols)
    raw = torch.from_numpy(data.reshape(-1))
    ne = (cols, rows)
    dequantize(raw, ggml_type, ne)  # warm up lookup tables and the allocator
    into = torch.empty(rows, cols)
    times = []  # (baseline, ours, into, floor) per round
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(rounds):
            times.append(
                _best_of(
                    [
                        partial(quants.dequantize, data, ggml_type),
                        partial(dequantize, raw, ggml_type, ne),
                        partial(dequantize, raw, ggml_type, ne, out=into),
                        partial(fresh_fill, rows * cols),
                    ],
                    repeats,
                )
            )
    ratios = [base / ours for base, ours, _, _ in times]
    ratios_into = [base / ours_into for base, _, ours_into, _ in times]
    ratios_floor = [base / floor for base, _, _, floor in times]
    median_round = sorted(range(rounds), key=lambda i: ratios[i])[(rounds - 1) // 2]
    baseline_s, ours_s, into_s, floor_s = times[median_round]
    return {
        "name": f"dequant.{ggml_type.name}",
        "baseline_s": baseline_s,
        "ours_s": ours_s,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratios": ratios,
        "ours_into_s": into_s,
        "ratio_into": statistics.median(ratios_into),
        "ratio_into_min": min(ratios_into),
        "floor_s": floor_s,
        "ratio_floor": statistics.median(ratios_floor),
        "target": TARGET_RATIO if ggml_type in TARGET_TYPES else None,
        "mb_per_s": data.nbytes / ours_s / 1e6,
        "elements_per_s": rows * cols / ours_s,
        "threads": applied.intra_op,
        "thread_source": applied.policy.source.value,
    }


def _golden_tiled(ggml_type: GGMLType, rows: int, cols: int) -> np.ndarray:
    """ik's bytes of a row-interleaved type from its golden file, tiled to ``rows x cols``: each
    group's block columns repeated (its row headers kept), then the groups repeated."""
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    entry = next(e for e in manifest["types"].values() if e["code"] == int(ggml_type))
    data = (GOLDEN / entry["file"]).read_bytes()
    g_rows, g_cols, ilv = entry["rows"], entry["n_per_row"], entry["interleave"]
    layout = LAYOUTS[ggml_type]
    quant = np.frombuffer(data, np.uint8, g_rows * entry["bytes_per_row"], 64)
    groups = quant.reshape(g_rows // ilv, -1)
    head = ilv * layout.row_meta
    blocks = np.tile(groups[:, head:], (1, cols // g_cols))
    tiled = np.concatenate((groups[:, :head], blocks), axis=1)
    return np.tile(tiled, (rows // g_rows, 1)).reshape(-1)


def _measure_ik(
    ggml_type: GGMLType,
    size: tuple[int, int],
    *,
    repeats: int,
    rounds: int,
    applied: AppliedThreads,
) -> dict[str, Any]:
    """An ik_llama.cpp type against our own Q8_0 decoder on as many elements (no numpy code)."""
    rows, cols = size
    ne = (cols, rows)
    if ggml_type in INTERLEAVED:
        raw = torch.from_numpy(_golden_tiled(ggml_type, rows, cols))
    else:
        raw = torch.from_numpy(synth_ik_tensor(np.random.default_rng(0), ggml_type, ne, std=1.0))
    q8 = torch.from_numpy(_random_bytes(GGMLQuantizationType.Q8_0, rows, cols).reshape(-1))
    dequantize(raw, ggml_type, ne)  # warm up lookup tables and the allocator
    into = torch.empty(rows, cols)
    compiled = _compiled.handles(ggml_type, cols, raw.device)

    def torch_only() -> None:
        with _compiled.disabled():
            dequantize(raw, ggml_type, ne)

    times = [
        _best_of(
            [
                partial(dequantize, q8, GGMLQuantizationType.Q8_0, ne),
                partial(dequantize, raw, ggml_type, ne),
                partial(dequantize, raw, ggml_type, ne, out=into),
                *([torch_only] if compiled else []),
            ],
            repeats,
        )
        for _ in range(rounds)
    ]
    ratios = [t[0] / t[1] for t in times]
    ratios_into = [t[0] / t[2] for t in times]
    median_round = sorted(range(rounds), key=lambda i: ratios[i])[(rounds - 1) // 2]
    baseline_s, ours_s, into_s = times[median_round][:3]
    torch_s = statistics.median(t[3] for t in times) if compiled else ours_s
    return {
        "name": f"dequant.{ggml_type.name}",
        "baseline": "Q8_0 (ours)",
        "baseline_s": baseline_s,
        "ours_s": ours_s,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratios": ratios,
        "ours_into_s": into_s,
        "ratio_into": statistics.median(ratios_into),
        "ratio_into_min": min(ratios_into),
        "target": None,
        "gb_per_s": rows * cols * 4 / ours_s / 1e9,
        "kernel": "compiled" if compiled else "torch",
        "torch_gb_per_s": rows * cols * 4 / torch_s / 1e9,
        "mb_per_s": raw.numel() / ours_s / 1e6,
        "elements_per_s": rows * cols / ours_s,
        "threads": applied.intra_op,
        "thread_source": applied.policy.source.value,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller tensor, fewer repeats")
    parser.add_argument("--types", nargs="*", help="only these GGML type names (e.g. Q8_0 Q4_K)")
    parser.add_argument(
        "--threads", type=int, metavar="N", help="torch threads (default: the runtime's policy)"
    )
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, metavar="N", help="rounds per type (median, min)"
    )
    args = parser.parse_args()
    configure_logging(level="warning")  # the policy's log line would interleave with the table
    results = run(args.quick, args.types, threads=args.threads, rounds=args.rounds)
    policy = resolve_threads(flag=args.threads)
    print(
        f"torch {torch.__version__}, {policy.threads} thread(s) of {policy.cpus} CPU(s): "
        f"{policy.reason}"
    )
    print(
        f"ratio = gguf time / ours; median and min over {args.rounds} rounds, each the best of "
        "interleaved repeats; fresh: a new output tensor (the target), into: out= a reused one"
    )
    print(
        "floor: a new tensor of the same size allocated as dequantize does and filled once (its "
        "pages' first-touch faults and zeroing), about the most a new-tensor decoder can reach"
    )
    header = f"{'type':<8} {'gguf ms':>8} {'ours ms':>8} {'Melem/s':>8} {'fresh med':>9} {'min':>6}"
    header += f" {'into ms':>8} {'into med':>8} {'min':>6} {'floor ms':>8} {'floor':>6}"
    print(header + "  rounds (fresh)  target")
    for row in (r for r in results if "baseline" not in r):
        target = row["target"]
        mark = ""
        if target is not None:
            ok = float(row["ratio"]) >= float(target)
            mark = f">= {target:.0f}x {'met' if ok else 'MISSED'}"
        rounds = " ".join(f"{r:.1f}" for r in row["ratios"])
        print(
            f"{str(row['name']).removeprefix('dequant.'):<8} {row['baseline_s'] * 1e3:>8.2f} "
            f"{row['ours_s'] * 1e3:>8.2f} {row['elements_per_s'] / 1e6:>8.0f} "
            f"{row['ratio']:>8.1f}x {row['ratio_min']:>5.1f}x "
            f"{row['ours_into_s'] * 1e3:>8.2f} {row['ratio_into']:>7.1f}x "
            f"{row['ratio_into_min']:>5.1f}x {row['floor_s'] * 1e3:>8.2f} "
            f"{row['ratio_floor']:>5.1f}x  {rounds:<14}  {mark}"
        )
    ik_rows = [r for r in results if "baseline" in r]
    if ik_rows:
        print(
            "\nik_llama.cpp types (no numpy decoder): ratio = our Q8_0 time / this type's time, "
            "same elements, same rounds; GB/s of float32 output"
        )
        print(
            f"{'type':<10} {'Q8_0 ms':>8} {'ours ms':>8} {'GB/s':>6} {'ratio':>6} {'min':>6}"
            f"  {'kernel':<8} {'torch GB/s':>10}"
        )
        for row in ik_rows:
            print(
                f"{str(row['name']).removeprefix('dequant.'):<10} {row['baseline_s'] * 1e3:>8.2f} "
                f"{row['ours_s'] * 1e3:>8.2f} {row['gb_per_s']:>6.2f} {row['ratio']:>5.2f}x "
                f"{row['ratio_min']:>5.2f}x  {row['kernel']:<8} {row['torch_gb_per_s']:>10.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
