"""Rename-to-commit latency: a shard is atomically replaced; how long until the runtime commits?

Starts a real runtime and a real agent (inotify, ZeroMQ), then alternates one shard between two
prepared versions by ``os.replace`` and times each rename until the runtime's ``plan.committed``
event for it arrives. Reports p50/p99 over N swaps next to the configured settle window, which is
the floor the agent waits for a shard to be quiet (the ratio column is latency / settle window).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as Q

from ggufswap.shards import Layout, open_shard_set, requantize, tiny_moe, write_model
from ggufswap.sweep.children import Child, CommitEvents, poll_until, status_of

TENSOR = "blk.1.ffn_down_exps.weight"


def _config(work: Path, first: Path, settle_ms: int) -> Path:
    run = work / "run"
    config = work / "config.yaml"
    config.write_text(
        f"""
agent:
  status_endpoint: ipc://{run}/agent.sock
models:
  - name: bench
    runtime: ipc://{run}/rt.sock
    watch: [{{path: {first.parent}}}]
    settle_ms: {settle_ms}
runtime:
  name: bench
  model: {first}
  control_endpoint: ipc://{run}/rt.sock
  events_endpoint: ipc://{run}/events.sock
"""
    )
    return config


def measure(swaps: int, settle_ms: int) -> list[float]:
    work = Path(tempfile.mkdtemp(prefix="ggufswap-latency-"))
    children: list[Child] = []
    events: CommitEvents | None = None
    try:
        model = work / "model"
        model.mkdir()
        first = write_model(tiny_moe(), model, layout=Layout.PER_TENSOR)[0]
        shard = Path(open_shard_set(first).tensors[TENSOR].path)
        versions = [work / "a.gguf", work / "b.gguf"]
        shutil.copy2(shard, versions[0])
        requantize(shard, TENSOR, Q.Q4_0, out=versions[1])
        config = _config(work, first, settle_ms)
        run = work / "run"
        runtime = Child(
            "runtime",
            ["runtime", "--config", str(config), "--mode", "probe"],
            log_path=work / "rt.log",
        )
        children.append(runtime)
        poll_until(lambda: status_of(f"ipc://{run}/rt.sock"), timeout_s=60, what="runtime")
        events = CommitEvents(f"ipc://{run}/events.sock").start()
        agent = Child("agent", ["agent", "--config", str(config)], log_path=work / "agent.log")
        children.append(agent)
        poll_until(lambda: status_of(f"ipc://{run}/agent.sock"), timeout_s=60, what="agent")
        latencies = []
        for i in range(swaps):
            tmp = model / f".swap-{i}.tmp"
            shutil.copy2(versions[(i + 1) % 2], tmp)
            t0 = time.monotonic()
            os.replace(tmp, shard)
            event = events.wait(lambda e: TENSOR in e.changed, after=t0, timeout_s=30)
            if event is None:
                raise RuntimeError(f"swap {i}: no commit within 30 s; see {work}")
            latencies.append(event.received_at - t0)
        return latencies
    finally:
        if events is not None:
            events.close()
        for child in reversed(children):
            child.stop()
        shutil.rmtree(work, ignore_errors=True)


def run(quick: bool) -> list[dict[str, Any]]:
    settle_ms = 50
    latencies = sorted(measure(20 if quick else 60, settle_ms))
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    settle = settle_ms / 1e3
    rows = []
    for label, value in (("p50", p50), ("p99", p99)):
        rows.append(
            {
                "name": f"rename->commit {label}, {len(latencies)} swaps, settle {settle_ms} ms",
                "baseline_s": settle,
                "ours_s": value,
                "ratio": settle / value,
                "target": None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for row in run(args.quick):
        over = row["ours_s"] / row["baseline_s"]
        print(f"{row['name']}: {row['ours_s'] * 1e3:.1f} ms ({over:.2f}x the settle window)")


if __name__ == "__main__":
    main()
