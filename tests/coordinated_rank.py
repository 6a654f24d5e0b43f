"""One rank of the coordinated-commit test, started by ``torch.distributed.run`` (gloo, CPU).

Every rank opens the same tiny model with a coordinated runtime and runs the same serving loop:
``at_batch_boundary()``, then one forward pass of the probe batch, recording ``(step,
weight_version, logits digest)``. The leader (rank 0) submits the manifest's plans one at a time,
each once the previous one has ended, and tells the others when to stop (a broadcast per step:
the loop's own business, not the runtime's). The rank named ``--tight-rank`` gets a pool with
little room beyond what it loaded, so a plan that grows the model fails there only. Each rank
writes ``rank-N.json``: its records, the outcome of every plan, and its status.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, Pool, Storage
from ggufswap.runtime.models import Transformer
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.serving.serve import logits_digest, probe_tokens
from ggufswap.shards import read_header

MAX_STEPS = 20_000  # a loop that never ends fails instead of hanging
WATCHDOG_S = float(os.environ.get("RANK_WATCHDOG_S", "200"))


def build_plan(entry: dict[str, object]) -> Plan:
    files = entry["files"]
    assert isinstance(files, dict), "files: {tensor: path}"
    jobs = tuple(Job(read_header(path).tensor_map()[name]) for name, path in files.items())
    return Plan(str(entry["plan_id"]), "", jobs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--plans", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tight-rank", type=int, default=-1)
    parser.add_argument("--headroom", type=int, default=0)
    args = parser.parse_args()
    # A hung rank dies, saying where (rank 0 first: its traceback is the telling one).
    faulthandler.dump_traceback_later(WATCHDOG_S + 15 * int(os.environ["RANK"]), exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    manifest = json.loads(Path(args.plans).read_text())
    pool = Pool("host", torch.device("cpu"))
    runtime = HotSwapRuntime.open(
        args.model,
        pools=[pool],
        storage=Storage.NATIVE,
        allowed_roots=[os.path.dirname(args.model), os.path.dirname(manifest["store"])],
        group=True,
    )
    if rank == args.tight_rank:  # this rank's pool is too small for a plan that grows the model
        pool.budget = pool.used + args.headroom
    assert runtime.shards is not None, "open() keeps the shard set"
    model = Transformer(HParams.from_metadata(runtime.shards.metadata), runtime.store)
    tokens = probe_tokens(model.config.n_vocab, batch=2, tokens=16)  # fresh_digest's probe
    plans = [build_plan(entry) for entry in manifest["plans"]] if rank == 0 else []
    records: list[list[object]] = []
    current = None
    step = 0
    while True:
        version = runtime.at_batch_boundary()
        with torch.inference_mode():
            records.append([step, version, logits_digest(model(tokens))])
        done = torch.zeros(1, dtype=torch.int32)
        if rank == 0 and (current is None or current.state.final):
            if plans:
                current = runtime.submit(plans.pop(0))
            else:
                done[0] = 1
        dist.broadcast(done, 0)
        if done.item():
            break
        step += 1
        assert step < MAX_STEPS, f"rank {rank}: no end after {MAX_STEPS} steps"
    outcomes = {}
    for entry in manifest["plans"]:
        ticket = runtime.ticket(str(entry["plan_id"]))
        outcomes[str(entry["plan_id"])] = (
            None
            if ticket is None
            else {"state": ticket.state.value, "reasons": [str(r) for r in ticket.reasons]}
        )
    status = runtime.status()
    runtime.close()
    Path(args.out, f"rank-{rank}.json").write_text(
        json.dumps({"records": records, "outcomes": outcomes, "group": status["group"]})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
