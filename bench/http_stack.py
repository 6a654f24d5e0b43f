"""The HTTP stack, measured: uvicorn (httptools) + Starlette against aiohttp's web server, serving
the same small completion: a JSON body parsed, handed to a worker thread (the batcher's stand-in:
it answers from a queue, as the inference thread does), and a JSON answer.

    python bench/http_stack.py [--requests 2000]

Prints, per stack: import + bind + first answer (start), requests/s and p50/p99 latency of one
keep-alive client posting back to back, and the server process's RSS; then each as a ratio to
uvicorn's. Each server runs in a process of its own, one at a time. aiohttp is not a dependency
(``pip install aiohttp`` to run this).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time

UVICORN_APP = r"""
import json, queue, threading, sys, time
started = time.monotonic()
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
import asyncio
jobs = queue.Queue()
def worker():
    while True:
        loop, fut, body = jobs.get()
        loop.call_soon_threadsafe(fut.set_result, {"choices": [{"text": body["prompt"][::-1]}]})
threading.Thread(target=worker, daemon=True).start()
async def complete(request):
    body = json.loads(await request.body())
    loop = asyncio.get_running_loop(); fut = loop.create_future()
    jobs.put((loop, fut, body))
    return JSONResponse(await fut)
app = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])
print(f"imported {time.monotonic() - started:.3f}", flush=True)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error", http="httptools")
"""

AIOHTTP_APP = r"""
import json, queue, threading, sys, time
started = time.monotonic()
from aiohttp import web
import asyncio
jobs = queue.Queue()
def worker():
    while True:
        loop, fut, body = jobs.get()
        loop.call_soon_threadsafe(fut.set_result, {"choices": [{"text": body["prompt"][::-1]}]})
threading.Thread(target=worker, daemon=True).start()
async def complete(request):
    body = json.loads(await request.read())
    loop = asyncio.get_running_loop(); fut = loop.create_future()
    jobs.put((loop, fut, body))
    return web.json_response(await fut)
app = web.Application(); app.add_routes([web.post("/v1/completions", complete)])
print(f"imported {time.monotonic() - started:.3f}", flush=True)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(name: str, source: str, requests: int) -> dict[str, float]:
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", source, str(port)], stdout=subprocess.PIPE, text=True
    )
    body = json.dumps({"prompt": "Monday, Tuesday, Wednesday,", "max_tokens": 8}).encode()
    try:
        while True:  # start: process spawned -> first answer
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("POST", "/v1/completions", body=body)
                conn.getresponse().read()
                break
            except OSError:
                time.sleep(0.005)
        start_s = time.monotonic() - started
        latencies = []
        t0 = time.perf_counter()
        for _ in range(requests):
            asked = time.perf_counter()
            conn.request("POST", "/v1/completions", body=body)
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            latencies.append(time.perf_counter() - asked)
        elapsed = time.perf_counter() - t0
        conn.close()
        latencies.sort()
        return {
            "start_s": start_s,
            "rps": requests / elapsed,
            "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
            "rss_mb": rss_mb(proc.pid),
        }
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    results: dict[str, list[dict[str, float]]] = {"uvicorn+starlette": [], "aiohttp": []}
    for _ in range(args.rounds):  # interleaved, so both see the same host
        results["uvicorn+starlette"].append(measure("uvicorn", UVICORN_APP, args.requests))
        results["aiohttp"].append(measure("aiohttp", AIOHTTP_APP, args.requests))
    best = {
        k: {m: (max if m == "rps" else min)(r[m] for r in v) for m in v[0]}
        for k, v in results.items()
    }
    base = best["uvicorn+starlette"]
    for name, figures in best.items():
        ratios = ", ".join(f"{m} x{figures[m] / base[m]:.2f}" for m in figures)
        shown = ", ".join(f"{m} {figures[m]:.3g}" for m in figures)
        print(f"{name:18s} {shown}  ({ratios} of uvicorn+starlette)")


if __name__ == "__main__":
    main()
