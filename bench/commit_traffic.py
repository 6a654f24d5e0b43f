"""Commits under traffic: submit -> committed of a one-tensor plan while one client posts 8-token
completions back to back, as a ratio against the same with no client (idle), on the same server.

    python bench/commit_traffic.py [--plans 20]

The bound (issue 29): a commit waits at most for the longest request in flight (no request starts
while a plan is in flight) plus the staging; the figures print the longest request beside it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, PlanState
from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.daemon import served_model
from ggufswap.runtime.serving.generate import Batcher, BatcherOptions
from ggufswap.runtime.serving.http import CompletionServer, HttpOptions
from ggufswap.shards import read_header, requantize, tiny_dense, write_model

TENSOR = "blk.0.attn_q.weight"


def post(port: int) -> float:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "The cat sat on the mat.", "max_tokens": 8, "temperature": 0}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    assert conn.getresponse().status == 200
    conn.close()
    return time.monotonic() - started


def commits(runtime: HotSwapRuntime, first: Path, n: int, tag: str) -> list[float]:
    waits = []
    for i in range(n):
        requantize(first, TENSOR, "q4_0" if i % 2 == 0 else "q8_0")
        record = read_header(first).tensor_map()[TENSOR]
        submitted = time.monotonic()
        ticket = runtime.submit(Plan(f"{tag}-{i}", "", (Job(record),)))
        assert ticket.wait(60) is PlanState.COMMITTED, ticket.reasons
        waits.append(time.monotonic() - submitted)
        time.sleep(0.05)
    return waits


def measure(plans: int) -> tuple[list[float], list[float], list[float]]:
    """submit -> committed idle, then under traffic, and the traffic's request latencies."""
    torch.set_num_threads(1)
    (first,) = write_model(tiny_dense(n_vocab=2048, context_length=512), tempfile.mkdtemp())
    runtime = HotSwapRuntime.open(first)
    assert runtime.shards is not None
    model = served_model(runtime)  # what the runtime serves (numerics: auto)
    batcher = Batcher(runtime, model, GgufTokenizer.from_file(first), options=BatcherOptions())
    server = CompletionServer.serving(batcher, runtime, options=HttpOptions(port=0)).start()
    stop, done = threading.Event(), threading.Event()
    loop = threading.Thread(target=batcher.run, args=(stop,))
    loop.start()
    latencies: list[float] = []

    def client() -> None:
        while not done.is_set():
            latencies.append(post(server.port))

    try:
        idle = commits(runtime, Path(first), plans, "idle")
        poster = threading.Thread(target=client)
        poster.start()
        busy = commits(runtime, Path(first), plans, "busy")
        done.set()
        poster.join()
    finally:
        stop.set()
        loop.join()
        server.close()
        runtime.close()
    return idle, busy, latencies


def p99(values: list[float]) -> float:
    return sorted(values)[max(0, int(len(values) * 0.99) - 1)]


def run(quick: bool) -> list[dict[str, object]]:
    """One row: p99 submit -> committed under traffic against idle."""
    idle, busy, latencies = measure(6 if quick else 20)
    return [
        {
            "name": "commit under traffic (p99 submit -> committed)",
            "baseline_s": p99(idle),
            "ours_s": p99(busy),
            "ratio": p99(busy) / p99(idle),
            "target": f"<= longest request ({max(latencies):.3f} s) + 0.1 s",
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=20)
    args = parser.parse_args()
    idle, busy, latencies = measure(args.plans)
    print(f"load: {os.getloadavg()[0]:.2f} (1 min); {args.plans} plans each")
    print(
        f"idle:    submit -> committed p50 {statistics.median(idle) * 1e3:.1f} ms, "
        f"p99 {p99(idle) * 1e3:.1f} ms"
    )
    print(
        f"traffic: submit -> committed p50 {statistics.median(busy) * 1e3:.1f} ms, "
        f"p99 {p99(busy) * 1e3:.1f} ms (x{p99(busy) / p99(idle):.2f} of idle); "
        f"{len(latencies)} requests, longest {max(latencies) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
