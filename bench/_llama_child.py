"""llama.cpp's side of bench/llama_ratio.py: one measurement in a fresh process of the cross-check
venv (llama-cpp-python and numpy only; it never imports ggufswap).

    python _llama_child.py '{"what": "decode", "path": ..., "threads": 1, ...}'

Prints one JSON line (wall seconds, and the process's CPU seconds as ``*_cpu_s``). ``what``:

- ``decode``: greedy decode of ``steps`` tokens after ``prompt``; seconds per step (median);
- ``eval``: logits of every position of ``prompt`` (one batch, ``logits_all``); seconds;
- ``growth``: seconds per decode step after a context of ``context`` tokens (median of ``steps``);
- ``first``: nothing to measure here: the parent times this process from start to first logits.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
from llama_cpp import Llama


def _load(job: dict[str, Any], *, n_ctx: int, logits_all: bool = False) -> Llama:
    threads = int(job["threads"])
    return Llama(
        job["path"],
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def _last_logits(llm: Llama) -> np.ndarray:
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def _steps(llm: Llama, steps: int) -> tuple[list[float], list[float]]:
    """Greedy decode steps after what was evaluated: wall and CPU seconds each."""
    took, cpu = [], []
    token = int(np.argmax(_last_logits(llm)))
    for _ in range(steps):
        started, started_cpu = time.perf_counter(), time.process_time()
        llm.eval([token])
        token = int(np.argmax(_last_logits(llm)))
        took.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return took, cpu


def main() -> int:
    job = json.loads(sys.argv[1])
    prompt = [int(t) for t in job.get("prompt", [2])]
    what = job["what"]
    out: dict[str, Any] = {}
    if what == "decode":
        llm = _load(job, n_ctx=len(prompt) + int(job["steps"]) + 8)
        llm.eval(prompt)
        took, cpu = _steps(llm, int(job["steps"]))
        out["step_s"], out["step_cpu_s"] = float(np.median(took)), float(np.median(cpu))
    elif what == "eval":
        llm = _load(job, n_ctx=len(prompt), logits_all=True)
        started, started_cpu = time.perf_counter(), time.process_time()
        llm.eval(prompt)
        out["eval_s"] = time.perf_counter() - started
        out["eval_cpu_s"] = time.process_time() - started_cpu
    elif what == "growth":
        context = int(job["context"])
        llm = _load(job, n_ctx=context + int(job["steps"]) + 8)
        llm.eval([prompt[i % len(prompt)] for i in range(context)])
        took, cpu = _steps(llm, int(job["steps"]))
        out["step_s"], out["step_cpu_s"] = float(np.median(took)), float(np.median(cpu))
    elif what == "first":
        llm = _load(job, n_ctx=64)
        llm.eval(prompt)
        out["logit"] = float(_last_logits(llm)[0])
    else:
        raise SystemExit(f"unknown measurement {what!r}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
