"""Throughput of the Ray sweep (``ggufswap sweep --ray``): 3 workers against 1 worker.

    python bench/sweep_ray.py [--quick] [--workers 3] [--ctx 64] [--chunks 4]

A tiny dense llama (the project's writer), the Python LICENSE as text, a recipe of 12 rounds (6
with --quick), on a private local Ray cluster of this machine. The same sweep runs once over 1
worker (the baseline) and once over N workers (default 3), each worker one torch thread pinned to
its own CPU of the affinity mask (modulo the CPU count). Timed: from the first round handed out
to the last one recorded (the worker start-up and the baseline, which each worker computes on
its node before the first round, are excluded). ``ratio`` is 1-worker seconds / N-worker
seconds. On a machine with fewer CPUs than workers the ratio is bounded by the CPU count (and by
other jobs): the CPU count is printed with it. ``run(quick)`` returns the row for
``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from ggufswap.shards import tiny_dense, write_model
from ggufswap.sweep.ray_driver import RayOptions, WorkerInfo, run_ray_sweep
from ggufswap.sweep.recipe import Recipe, Round
from ggufswap.sweep.sweep import SweepOptions


def _recipe(quick: bool) -> Recipe:
    quants = ["q4_0", "q8_0"] if quick else ["q4_0", "q5_1", "q8_0"]
    return Recipe.from_document(
        {
            "quants": quants,
            "tensors": [{"match": r"^blk\.\d+\.(attn_q|ffn_up)\.weight$"}],
        }
    )


def _text() -> str:
    return (Path(sysconfig.get_path("stdlib")) / "LICENSE.txt").read_text(encoding="utf-8")


def _timed_sweep(
    model: Path, out: Path, recipe: Recipe, options: SweepOptions, workers: int
) -> tuple[float, int]:
    """Seconds from the first round handed out to the last recorded, and the rounds."""
    first: list[float] = []
    last: list[float] = []

    def dispatched(worker: WorkerInfo, r: Round) -> None:
        if not first:
            first.append(time.perf_counter())

    def recorded(rounds: Iterator[Round], total: int) -> Iterator[Round]:
        for r in rounds:
            yield r
            last[:] = [time.perf_counter()]

    report = run_ray_sweep(
        model,
        text=_text(),
        recipe=recipe,
        out_dir=out,
        options=options,
        ray_options=RayOptions(address=None, workers=workers, threads=1, pin_cpus=True),
        progress=recorded,
        on_dispatch=dispatched,
    )
    if report.refused or len(report.recorded) != report.rounds_planned:
        raise RuntimeError(f"the sweep over {workers} worker(s) did not record every round")
    return last[0] - first[0], len(report.recorded)


def run(
    quick: bool, *, workers: int = 3, ctx: int = 64, chunks: int | None = None
) -> list[dict[str, Any]]:
    cpus = len(os.sched_getaffinity(0))
    options = SweepOptions(n_ctx=ctx, max_chunks=chunks or (3 if quick else 6))
    recipe = _recipe(quick)
    with tempfile.TemporaryDirectory(prefix="ggufswap-bench-ray-") as tmp:
        root = Path(tmp)
        model = write_model(tiny_dense(), root / "model")[0]
        ray.init(
            address="local",  # a new local cluster, never one `ray start` left behind
            num_cpus=workers,
            include_dashboard=False,
            logging_level="warning",
            log_to_driver=False,
        )
        try:
            one_s, rounds = _timed_sweep(model, root / "one", recipe, options, 1)
            many_s, _ = _timed_sweep(model, root / "many", recipe, options, workers)
        finally:
            ray.shutdown()
    return [
        {
            "name": f"ray sweep {workers} workers / 1 ({rounds} rounds, {cpus} CPUs)",
            "baseline_s": one_s,
            "ours_s": many_s,
            "ratio": one_s / many_s,
            "target": None,
            "rounds": rounds,
            "workers": workers,
            "cpus": cpus,
        }
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--chunks", type=int)
    args = parser.parse_args()
    (row,) = run(args.quick, workers=args.workers, ctx=args.ctx, chunks=args.chunks)
    print(f"{row['cpus']} CPUs in this process's affinity mask; one torch thread per worker")
    print(
        f"{row['rounds']} rounds; 1 worker: {row['rounds'] / row['baseline_s']:.3f} rounds/s; "
        f"{row['workers']} workers: {row['rounds'] / row['ours_s']:.3f} rounds/s; "
        f"ratio {row['workers']} ÷ 1 = {row['ratio']:.2f}"
        + (f" (bounded by the {row['cpus']} CPUs)" if row["cpus"] < row["workers"] else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
