"""Pool bytes of a whole-model group round: every tensor swapped in one plan, then restored.

    .venv/bin/python bench/_group_round_memory.py [--model FILE]

The real Gemma 3 270M Q4_K_M when its package is installed (else the tiny dense model), held
dequantized (float32), once on an unbounded pool and once on a pool whose budget is the model's
own bytes (no room for a second copy of anything). Prints the pool's bytes after the load, its
peak while the swap was staged, after the swap's commit and after the restore, and whether the
restore gave every weight back bit for bit. Not a timing benchmark (run_all skips ``_`` files).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import torch
from _real import real_model

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, Pool
from ggufswap.shards import (
    GGMLType,
    Layout,
    TensorRecord,
    open_shard_set,
    read_header,
    requantize,
    tiny_dense,
    write_model,
)
from ggufswap.shards.resplit import split_per_tensor


def variant_type(record: TensorRecord) -> str:
    if record.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) or record.ne[0] % 32:
        return "f16" if record.ggml_type != GGMLType.F16 else "f32"
    return "q4_0" if record.ggml_type == GGMLType.Q8_0 else "q8_0"


def digests(runtime: HotSwapRuntime) -> dict[str, str]:
    return {
        name: hashlib.sha256(
            runtime.store.weight(name).contiguous().view(torch.uint8).numpy()
        ).hexdigest()
        for name in runtime.store.slots
    }


def group_round(first: Path, jobs: list[Job], budget: int | None, root: Path) -> dict[str, object]:
    pools = [Pool("host", torch.device("cpu"), budget=budget)]
    runtime = HotSwapRuntime.open(first, pools=pools, allowed_roots=[str(root)])
    try:
        pool = runtime.store.pools["host"]
        loaded, before = pool.used, digests(runtime)
        pool.peak = pool.used
        t0 = time.perf_counter()
        swapped = runtime.apply(Plan("every-tensor", runtime.model_name, tuple(jobs)), timeout=3600)
        t1 = time.perf_counter()
        after_swap, peak_swap = pool.used, pool.peak
        restore = tuple(Job(r) for r in open_shard_set(first).tensors.values())
        restored = runtime.apply(Plan("restore", runtime.model_name, restore), timeout=3600)
        t2 = time.perf_counter()
        return {
            "budget": budget,
            "loaded": loaded,
            "peak": max(peak_swap, pool.peak),
            "after_swap": after_swap,
            "after_restore": pool.used,
            "changed": len(swapped.changed),
            "restore_read": restored.bytes_read,
            "exact": digests(runtime) == before,
            "swap_s": round(t1 - t0, 2),
            "restore_s": round(t2 - t1, 2),
        }
    finally:
        runtime.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: the real Gemma, or tiny)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="group-round-") as tmp:
        work = Path(tmp)
        model = args.model or real_model()
        if model is None:
            print("the real model is not installed: using the tiny dense model", file=sys.stderr)
            model = Path(write_model(tiny_dense(), work / "tiny", layout=Layout.SINGLE)[0])
        first = split_per_tensor(model, work / "model")[0]
        jobs = []
        for name, record in open_shard_set(first).tensors.items():
            out = work / "variants" / f"{name}.gguf"
            out.parent.mkdir(exist_ok=True)
            requantize(record.path, name, variant_type(record), out=out)
            jobs.append(Job(read_header(out).tensor_map()[name]))
        unbounded = group_round(first, jobs, None, work)
        print("unbounded pool:", unbounded, flush=True)
        loaded = int(unbounded["loaded"])  # type: ignore[call-overload]
        print("budget = loaded:", group_round(first, jobs, loaded, work), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
