"""One rank of the coordinated-commit tests, started by ``torch.distributed.run`` (gloo, CPU).

Every rank opens the same tiny model with a coordinated runtime and runs the same serving loop:
``at_batch_boundary()``, then one forward pass of the probe batch, recording ``(step,
weight_version, logits digest)``. The leader (rank 0) submits the manifest's plans one at a time,
each once the previous one has ended, and tells the others when to stop (a broadcast per step:
the loop's own business, not the runtime's). Faults, each on one rank:

- ``--tight-rank``: a pool with little room beyond what it loaded, so a plan that grows the
  model fails there only;
- ``--stall-rank``: the rank's stager holds the first plan (a disk that does not answer) until
  the leader has seen it decided, so only the group's vote deadline can end it;
- ``--kill-rank`` with ``--kill-step``: the rank kills itself (SIGKILL) at that step, while the
  group is idle; the loop then runs without its own per-step broadcast, so the runtime's
  collective is the one that finds the loss.

Every rank also tries ``submit()`` at the start; a follower records its refusal. Each rank writes
``rank-N.json``: its records, the outcome of every plan, its status, and the error that ended it.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, Pool, RuntimeLibraryError, Storage
from ggufswap.runtime.coordinated import GroupOptions
from ggufswap.runtime.errors import RankLost
from ggufswap.runtime.serving.daemon import served_model
from ggufswap.runtime.serving.serve import logits_digest, probe_tokens
from ggufswap.shards import read_header

MAX_STEPS = 20_000  # a loop that never ends fails instead of hanging
WATCHDOG_S = float(os.environ.get("RANK_WATCHDOG_S", "200"))
KILLED_AT = "killed-at"  # the file the killed rank writes its time of death to


def build_plan(entry: dict[str, object]) -> Plan:
    files = entry["files"]
    assert isinstance(files, dict), "files: {tensor: path}"
    jobs = tuple(Job(read_header(path).tensor_map()[name]) for name, path in files.items())
    return Plan(str(entry["plan_id"]), "", jobs)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--plans", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tight-rank", type=int, default=-1)
    parser.add_argument("--headroom", type=int, default=0)
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--vote-timeout", type=float, default=60.0)
    return parser.parse_args()


def stall_first_plan(runtime: HotSwapRuntime) -> threading.Event:
    """Hold the stager on its first plan until the returned event is set."""
    release = threading.Event()
    stage = runtime._stager.stage
    first = True

    def stalled(plan: Plan) -> Any:
        nonlocal first
        if first:
            first = False
            release.wait(WATCHDOG_S)
        return stage(plan)

    runtime._stager.stage = stalled  # type: ignore[method-assign]
    return release


def main() -> None:
    args = parse()
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
        group=GroupOptions(vote_timeout_s=args.vote_timeout),
    )
    if rank == args.tight_rank:  # this rank's pool is too small for a plan that grows the model
        pool.budget = pool.used + args.headroom
    release = stall_first_plan(runtime) if rank == args.stall_rank else None
    plans = [build_plan(entry) for entry in manifest["plans"]]
    result: dict[str, Any] = {"follower_submit": None, "error": None}
    if rank != 0 and plans:
        try:
            runtime.submit(plans[0])
        except RuntimeLibraryError as exc:
            result["follower_submit"] = str(exc)
    try:
        result["records"] = serve(runtime, plans if rank == 0 else [], args, release, result)
    except RankLost as exc:
        result["error"] = {"message": str(exc), "lost": list(exc.lost), "at": time.time()}
        Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
        os._exit(3)  # the group is gone: no orderly shutdown of the process group
    outcomes = {}
    for entry in manifest["plans"]:
        ticket = runtime.ticket(str(entry["plan_id"]))
        outcomes[str(entry["plan_id"])] = (
            None
            if ticket is None
            else {"state": ticket.state.value, "reasons": [str(r) for r in ticket.reasons]}
        )
    result |= {"outcomes": outcomes, "group": runtime.status()["group"]}
    runtime.close()
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def serve(
    runtime: HotSwapRuntime,
    plans: list[Plan],
    args: argparse.Namespace,
    release: threading.Event | None,
    result: dict[str, Any],
) -> list[list[object]]:
    """The serving loop; its records. Rank 0 submits ``plans`` one after the other and notes
    when the first one ended (``first_plan_s``: seconds from its submission)."""
    rank = dist.get_rank()
    model = served_model(runtime)  # as fresh_digest builds it
    tokens = probe_tokens(model.config.n_vocab, batch=2, tokens=16)  # fresh_digest's probe
    records: list[list[object]] = []
    current, submitted = None, 0.0
    for step in range(MAX_STEPS):
        version = runtime.at_batch_boundary()
        with torch.inference_mode():
            records.append([step, version, logits_digest(model(tokens))])
        if args.kill_rank >= 0:  # no broadcast of the loop's own: the runtime finds the loss
            if rank == args.kill_rank and step == args.kill_step:
                Path(args.out, KILLED_AT).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            continue
        # [done, release]: the leader says when to stop, and when the stalled plan has ended
        flags = torch.zeros(2, dtype=torch.int32)
        if rank == 0 and (current is None or current.state.final):
            if current is not None and "first_plan_s" not in result:
                result["first_plan_s"] = time.monotonic() - submitted
                flags[1] = 1
            if plans:
                current, submitted = runtime.submit(plans.pop(0)), time.monotonic()
            else:
                flags[0] = 1
        dist.broadcast(flags, 0)
        if flags[1].item() and release is not None:
            release.set()
        if flags[0].item():
            return records
    raise AssertionError(f"rank {rank}: no end after {MAX_STEPS} steps")


if __name__ == "__main__":
    main()
