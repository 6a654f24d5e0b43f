"""What coordination costs a step: ``at_batch_boundary()`` with nothing staged on a runtime that
is one rank of a gloo group (one all-gather per call) against the same call on a runtime without
a group (one attribute check), same ranks, same run; and the tiny model's forward pass beside it.

    python bench/coordinated_step.py [--ranks 2] [--steps 2000]

The ranks are processes started with ``torch.multiprocessing.spawn`` on this host (gloo over
loopback TCP), one torch thread each. Each rank times its own calls; the script prints rank 0's
medians of 5 rounds. Only the CPU and gloo are measured here.
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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models import Transformer
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.serving.serve import probe_tokens
from ggufswap.shards import Layout, tiny_dense, write_model

ROUNDS = 5


def _per_call_us(call: object, steps: int) -> float:
    assert callable(call), "a callable"
    started = time.perf_counter()
    for _ in range(steps):
        call()
    return (time.perf_counter() - started) / steps * 1e6


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

    rows: dict[str, list[float]] = {"alone": [], "grouped": [], "forward": []}
    for _ in range(ROUNDS):
        dist.barrier()
        rows["alone"].append(_per_call_us(alone.at_batch_boundary, steps))
        dist.barrier()
        rows["grouped"].append(_per_call_us(grouped.at_batch_boundary, steps))
        dist.barrier()
        rows["forward"].append(_per_call_us(forward, max(1, steps // 20)))
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
    """The row for ``bench/run_all.py``: coordination is a cost, so there is no target. The
    ranks are spawned from this file run as a script (``run_all`` loads it under a name the
    spawned processes could not import)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "medians")
        steps = "200" if quick else "2000"
        command = [sys.executable, __file__, "--steps", steps, "--medians", str(out)]
        subprocess.run(command, check=True, capture_output=True, timeout=600)
        medians = ast.literal_eval(out.read_text())
    return [
        {
            "name": "at_batch_boundary: no group vs a 2-rank gloo group",
            "baseline_s": medians["alone"] / 1e6,
            "ours_s": medians["grouped"] / 1e6,
            "ratio": medians["alone"] / medians["grouped"],
            "target": None,
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--medians", type=Path, help="also write the medians here (for run())")
    args = parser.parse_args()
    medians = measure(args.ranks, args.steps)
    if args.medians is not None:
        args.medians.write_text(repr(medians))
    alone, grouped, forward = medians["alone"], medians["grouped"], medians["forward"]
    print(f"ranks={args.ranks} steps={args.steps} (median of {ROUNDS} rounds, rank 0, 1 thread)")
    print(f"at_batch_boundary, no group:    {alone:10.2f} us/step (baseline)")
    print(f"at_batch_boundary, gloo group:  {grouped:10.2f} us/step ({grouped / alone:.0f}x)")
    print(f"tiny model forward [2x16]:      {forward:10.2f} us/step")
    print(f"coordination / forward:         {grouped / forward:10.3f}")


if __name__ == "__main__":
    main()
