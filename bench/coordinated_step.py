"""What coordination costs a step with nothing staged anywhere: ``at_batch_boundary()`` on a
runtime that is one rank of a gloo group, against the same call without a group (one attribute
check) and against what a step cost before issue 30 (one ``all_gather_object`` of a rank's empty
view at every step, run here as the old code ran it), same ranks, same run.

    python bench/coordinated_step.py [--ranks 2] [--steps 200]

Two serving loops, a forward pass of the tiny model between two calls (the call alone timed):
*lockstep* (the forward is followed by one all-reduce, as a sharded model's forward is a
collective: the ranks are already in step, and what the agreement adds is its own cost) and
*independent* (replicated ranks with no collective of their own: any agreement makes the faster
rank wait for the slower one, so there the figure is mostly the ranks' difference in pace).
The ranks are processes started with
``torch.multiprocessing.spawn`` on this host (gloo over loopback TCP), one torch thread each.
Each rank times its own calls; the script prints rank 0's medians of 5 rounds. Only the CPU and
gloo are measured here.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.coordinated import RankView
from ggufswap.runtime.models import Transformer
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.serving.serve import probe_tokens
from ggufswap.shards import Layout, tiny_dense, write_model

ROUNDS = 5


def _per_call_us(call: Callable[[], object], steps: int, between: Callable[[], object]) -> float:
    """Mean µs of ``call`` over ``steps`` calls, ``between`` run (untimed) after each."""
    spent = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        call()
        spent += time.perf_counter() - started
        between()
    return spent / steps * 1e6


def _gather_every_step(rank: int, ranks: int) -> Callable[[], object]:
    """The step before issue 30: one all-gather of this rank's (empty) view at every call."""
    view = RankView(rank=rank, ballots=())

    def step() -> object:
        views: list[object] = [None] * ranks
        dist.all_gather_object(views, view)
        return views

    return step


def _rank(rank: int, ranks: int, first: str, init: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=ranks,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    alone = HotSwapRuntime.open(first)
    grouped = HotSwapRuntime.open(first, group=True)
    assert alone.shards is not None, "open() keeps the shard set"
    model = Transformer(HParams.from_metadata(alone.shards.metadata), alone.store)
    tokens = probe_tokens(model.config.n_vocab, batch=2, tokens=16)

    def forward() -> None:
        with torch.inference_mode():
            model(tokens)

    flag = torch.zeros(1)

    def lockstep() -> None:
        forward()
        dist.all_reduce(flag)  # a sharded model's forward ends in a collective

    calls = {
        "alone": alone.at_batch_boundary,
        "before": _gather_every_step(rank, ranks),
        "grouped": grouped.at_batch_boundary,
    }
    loops = {"lockstep": lockstep, "independent": forward}
    rows: dict[str, list[float]] = {f"{k}_{loop}": [] for k in calls for loop in loops}
    rows["forward"] = []
    for _ in range(ROUNDS):
        for name, call in calls.items():
            for loop, between in loops.items():
                dist.barrier()
                rows[f"{name}_{loop}"].append(_per_call_us(call, steps, between))
        dist.barrier()
        rows["forward"].append(_per_call_us(forward, steps, lambda: None))
    assert grouped.status()["group"]["gathers"] == 0, "nothing was staged: no gather"
    alone.close()
    grouped.close()
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in rows.items()}
        Path(out).write_text(repr(medians))
    dist.destroy_process_group()


def measure(ranks: int, steps: int) -> dict[str, float]:
    """Rank 0's medians (µs per call): ``alone``, ``grouped``, ``forward``."""
    with tempfile.TemporaryDirectory() as tmp:
        first = write_model(tiny_dense(), tmp, layout=Layout.SINGLE)[0]
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        out = os.path.join(tmp, "result")
        mp.spawn(_rank, args=(ranks, first, init, steps, out), nprocs=ranks)
        medians: dict[str, float] = ast.literal_eval(Path(out).read_text())
    return medians


def run(quick: bool) -> list[dict[str, object]]:
    """The row for ``bench/run_all.py``: the idle step in a serving loop, before (a gather every
    step) against now (the probe); no target. The ranks are spawned from this file run as a
    script (``run_all`` loads it under a name the spawned processes could not import)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "medians")
        steps = "50" if quick else "200"
        command = [sys.executable, __file__, "--steps", steps, "--medians", str(out)]
        subprocess.run(command, check=True, capture_output=True, timeout=600)
        medians = ast.literal_eval(out.read_text())
    return [
        {
            "name": "idle at_batch_boundary, lockstep 2-rank gloo loop: gather vs probe",
            "baseline_s": medians["before_lockstep"] / 1e6,
            "ours_s": medians["grouped_lockstep"] / 1e6,
            "ratio": medians["before_lockstep"] / medians["grouped_lockstep"],
            "target": None,
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--medians", type=Path, help="also write the medians here (for run())")
    args = parser.parse_args()
    medians = measure(args.ranks, args.steps)
    if args.medians is not None:
        args.medians.write_text(repr(medians))
    print(f"ranks={args.ranks} steps={args.steps} (median of {ROUNDS} rounds, rank 0, 1 thread)")
    print(f"{'us per idle at_batch_boundary':34} {'lockstep loop':>14} {'independent':>12}")
    for name, label in (
        ("alone", "no group (baseline)"),
        ("before", "group, before: a gather per step"),
        ("grouped", "group, now: the probe"),
    ):
        lockstep, independent = medians[f"{name}_lockstep"], medians[f"{name}_independent"]
        print(f"{label:34} {lockstep:14.2f} {independent:12.2f}")
    before, now = medians["before_lockstep"], medians["grouped_lockstep"]
    print(f"tiny model forward [2x16]:         {medians['forward']:14.2f}")
    print(f"lockstep loop, before / now:       {before / now:14.1f}x")


if __name__ == "__main__":
    main()
