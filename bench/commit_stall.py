"""How long the inference loop stalls to commit a staged 64 MiB tensor, against reloading it
synchronously inside the loop, same tensor, same run.

    python bench/commit_stall.py [--quick]

The model is one Q8_0 tensor of 4096 x 4096 elements: 64 MiB in the float32 compute dtype
(dequantized storage). Each repeat atomically replaces the file with the other of two versions,
submits a plan, waits until the stager has staged it, then times ``at_batch_boundary()``; that is
the stall a serving loop pays. The baseline is what a loop without a stager would pay for the same
change: read the bytes (from the page cache: the file was just written, which flatters the
baseline), dequantize them and copy them into the store's buffer. Both modes are measured:
``stable_pointers=False`` (the commit swaps a pointer to a staged buffer) and ``True`` (the commit
copies the staged values into the live buffer, as CUDA graphs need). Target: a stall >= 50x
shorter than the synchronous reload. ``run(quick)`` returns the rows for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Final

import numpy as np
import structlog
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, PlanState, dequantize
from ggufswap.shards import TensorRecord, read_header, read_tensor_bytes
from ggufswap.shards.writer import RawTensor, write_gguf

TARGET_RATIO: Final = 50.0
NAME: Final = "blk.0.ffn_down.weight"
NE: Final = (4096, 4096)  # 16 Mi elements: 64 MiB as float32
QTYPE: Final = GGMLQuantizationType.Q8_0
WAIT_S: Final = 120.0


def _q8_0_bytes(seed: int) -> np.ndarray:
    """Random Q8_0 blocks with finite fp16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[QTYPE]
    n_blocks = NE[0] * NE[1] // block_size
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scales = rng.uniform(-0.01, 0.01, size=(n_blocks, 1)).astype(np.float16)
    blocks[:, 0:2] = scales.view(np.uint8)
    return blocks.reshape(-1)


def _write(path: Path, seed: int) -> Path:
    return write_gguf(
        path, n_kv=0, kv_bytes=b"", tensors=[RawTensor(NAME, QTYPE, NE, _q8_0_bytes(seed))]
    )


def _replace(model: Path, version: Path) -> TensorRecord:
    """Atomically put ``version`` in place of the model file; return the new record."""
    tmp = model.with_name(f".{model.name}.tmp")
    tmp.write_bytes(version.read_bytes())
    os.replace(tmp, model)
    return read_header(model).tensor_map()[NAME]


def _stalls(model: Path, versions: list[Path], repeats: int, *, stable: bool) -> list[float]:
    """Time ``at_batch_boundary()`` committing a staged replacement, ``repeats`` times."""
    _replace(model, versions[0])
    runtime = HotSwapRuntime.open(model, stable_pointers=stable)
    try:
        pointer = runtime.store.slots[NAME].active.tensor.data_ptr()
        stalls = []
        for i in range(repeats):
            record = _replace(model, versions[(i + 1) % 2])
            ticket = runtime.submit(Plan(f"p{i}", "", (Job(record),)))
            if not runtime.wait_staged(timeout=WAIT_S):
                raise RuntimeError(f"plan {ticket.plan_id} not staged: {ticket.summary()}")
            start = time.perf_counter()
            runtime.at_batch_boundary()
            stalls.append(time.perf_counter() - start)
            if ticket.state is not PlanState.COMMITTED or ticket.changed != (NAME,):
                raise RuntimeError(f"plan {ticket.plan_id} did not commit: {ticket.summary()}")
        moved = runtime.store.slots[NAME].active.tensor.data_ptr() != pointer
        if moved == stable:
            raise RuntimeError(f"stable_pointers={stable} but the buffer moved={moved}")
        return stalls
    finally:
        runtime.close()


def _sync_reloads(model: Path, versions: list[Path], repeats: int) -> list[float]:
    """Time the synchronous reload: read + dequantize + copy into the store's live buffer."""
    _replace(model, versions[0])
    runtime = HotSwapRuntime.open(model)
    try:
        live = runtime.store.slots[NAME].active.tensor
        times = []
        for i in range(repeats):
            record = _replace(model, versions[(i + 1) % 2])
            start = time.perf_counter()
            raw = torch.empty(record.nbytes, dtype=torch.uint8)
            read_tensor_bytes(record, raw.numpy().data)
            values = dequantize(raw, record.ggml_type, record.ne, dtype=live.dtype)
            live.copy_(values.reshape(-1))
            times.append(time.perf_counter() - start)
        return times
    finally:
        runtime.close()


def run(quick: bool) -> list[dict[str, object]]:
    """One row per commit mode: median synchronous reload vs median commit stall."""
    repeats = 5 if quick else 15
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings+
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="ggufswap-bench-") as tmp:
        root = Path(tmp)
        versions = [_write(root / "a.bin", 1), _write(root / "b.bin", 2)]
        model = root / "model.gguf"
        _sync_reloads(model, versions, 1)  # warm up the kernels and the page cache
        baseline = _sync_reloads(model, versions, repeats)
        for stable, mode in ((False, "pointer_swap"), (True, "in_place_copy")):
            ours = _stalls(model, versions, repeats, stable=stable)
            base_s, ours_s = statistics.median(baseline), statistics.median(ours)
            results.append(
                {
                    "name": f"commit_stall.{mode}",
                    "baseline_s": base_s,
                    "ours_s": ours_s,
                    "ratio": base_s / ours_s,
                    "target": TARGET_RATIO,
                    "baseline_best_s": min(baseline),
                    "ours_best_s": min(ours),
                    "repeats": repeats,
                    "tensor_mib": NE[0] * NE[1] * 4 / 2**20,
                }
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    results = run(args.quick)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, 64 MiB float32 tensor")
    print(f"{'mode':<14} {'reload ms':>10} {'stall ms':>10} {'best/best':>10} {'ratio':>9}  target")
    for row in results:
        ratio = float(row["ratio"])  # type: ignore[arg-type]
        best = float(row["baseline_best_s"]) / float(row["ours_best_s"])  # type: ignore[arg-type]
        met = "met" if ratio >= TARGET_RATIO else "MISSED"
        print(
            f"{str(row['name']).removeprefix('commit_stall.'):<14} "
            f"{float(row['baseline_s']) * 1e3:>10.2f} {float(row['ours_s']) * 1e3:>10.3f} "  # type: ignore[arg-type]
            f"{best:>9.1f}x {ratio:>8.1f}x  >= {TARGET_RATIO:.0f}x {met}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
