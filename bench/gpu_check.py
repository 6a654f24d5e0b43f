"""The GPU host's end-to-end check (``make gpu-check``): what a GPU user meets, in a few minutes.

    python bench/gpu_check.py [--device cuda|cpu] [--quick] [--json FILE] [--check NAME ...]

Each check prints ``PASS``, ``FAIL`` or ``SKIP`` with its figures; the exit code is 1 when one
fails. On a CUDA device:

- **parity**: six presets x dequantized/native storage, logits of a load on the GPU pool against a
  load on the CPU: max |delta| and top-1 agreement (native storage runs the Triton kernels for
  the experts' products);
- **swap**: three tensors swapped on the GPU (dequantized storage, stable pointers): the commit's
  stall, logits bit for bit a fresh GPU load's, every buffer's pointer unchanged;
- **oom**: the GPU filled, torch's cached blocks included, until not even the allocator's
  smallest block can be had, so an expert family's growth no longer fits (no budget: the
  allocator itself refuses): the family falls back to host memory and the plan commits, with a
  fresh load's logits; ``torch.cuda.memory_allocated`` back at its baseline after each return;
- **graph**: a CUDA graph captured on the dense model, replayed after an in-place commit: the
  replay gives the new weights' logits (eager), not the old ones;
- **speed**: one decode step of a generated qwen3moe (Q4_K/Q6_K, 32 experts, 142 MB) in native
  storage against dequantized float32 (target >= 0.7), and each kernel type's product from its
  blocks against decode + ``F.linear`` on a 4096 x 4096 matrix.

Without CUDA it is a dry run on the CPU: parity (CPU against CPU), swap and speed run their code
at small sizes, and the device-only checks say SKIP. Every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, PlanState, Pool, SlotState, Storage
from ggufswap.runtime.kernels import dequantize, gpu
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.serving.serve import probe_tokens
from ggufswap.shards import (
    Layout,
    ModelSpec,
    open_shard_set,
    read_header,
    requantize,
    tiny_dense,
    tiny_moe,
    write_model,
)
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.keys import Arch
from ggufswap.shards.presets import tiny_deepseek2, tiny_glm4moe, tiny_gpt_oss, tiny_llama3

CPU = torch.device("cpu")
PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "dense": tiny_dense,
    "moe": tiny_moe,
    "deepseek2": tiny_deepseek2,
    "glm4moe": tiny_glm4moe,
    "llama3": tiny_llama3,
    "gpt_oss": tiny_gpt_oss,
}
SWAPS = {  # tensor -> the type its swap brings (tiny_moe)
    "blk.1.ffn_down_exps.weight": GGMLType.Q4_0,
    "blk.2.attn_q.weight": GGMLType.Q5_0,
    "output.weight": GGMLType.Q4_1,
}
GROW = "blk.1.ffn_down_exps.weight"
FAMILY = tuple(f"blk.1.{r}.weight" for r in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    figures: dict[str, Any] = field(default_factory=dict)
    why: str = ""

    def line(self) -> str:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        why = f" ({self.why})" if self.why else ""
        return f"{self.status:4} {self.name}: {shown}{why}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def open_model(
    path: Path, device: torch.device, storage: Storage, **options: Any
) -> tuple[HotSwapRuntime, Any]:
    """A runtime on a pool of ``device`` (host memory as the fallback) and its decoder."""
    pools = [Pool("dev", device), Pool("host", CPU)] if device.type != "cpu" else None
    runtime = HotSwapRuntime.open(
        path, storage=storage, pools=pools, allowed_roots=[str(path.parent)], **options
    )
    assert runtime.shards is not None, "open() keeps the shard set"
    return runtime, build_model(HParams.from_metadata(runtime.shards.metadata), runtime.store)


def logits_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens).float()


def plan_for(path: Path, names: list[str], plan_id: str) -> Plan:
    """A plan loading ``names`` from the per-tensor shards as they are on disk now."""
    records = open_shard_set(path).tensors
    jobs = tuple(Job(read_header(records[n].path).tensor_map()[n]) for n in names)
    return Plan(plan_id, "", jobs)


def put(shard: Path, source: Path) -> None:
    tmp = shard.with_name(f".{shard.name}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, shard)


# -- parity --------------------------------------------------------------------------------------


def check_parity(root: Path, device: torch.device) -> Result:
    worst, agree, total, rows = 0.0, 0, 0, []
    for name, preset in PRESETS.items():
        path = write_model(preset(), root / f"parity-{name}")[0]
        for storage in (Storage.DEQUANTIZED, Storage.NATIVE):
            cpu_rt, cpu_model = open_model(path, CPU, storage)
            dev_rt, dev_model = open_model(path, device, storage)
            try:
                tokens = probe_tokens(cpu_model.config.n_vocab, batch=2, tokens=16)
                want = logits_of(cpu_model, tokens)
                got = logits_of(dev_model, tokens.to(device)).cpu()
            finally:
                cpu_rt.close()
                dev_rt.close()
            delta = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
            same = int((got.argmax(-1) == want.argmax(-1)).sum())
            worst, agree, total = max(worst, delta), agree + same, total + want[..., 0].numel()
            rows.append(f"{name}/{storage.value}:{delta:.2e}")
    top1 = 100.0 * agree / total
    ok = worst <= 1e-4 and top1 >= 99.0
    figures = {"max_rel_delta": worst, "top1_pct": top1, "runs": len(rows)}
    return Result("parity", "PASS" if ok else "FAIL", figures, "" if ok else " ".join(rows))


# -- swap ----------------------------------------------------------------------------------------


def moe_dir(root: Path, name: str) -> Path:
    """tiny_moe, one tensor per shard (a swap replaces one file)."""
    return write_model(tiny_moe(), root / name, layout=Layout.PER_TENSOR)[0]


def shard_of(path: Path, name: str) -> Path:
    return Path(open_shard_set(path).tensors[name].path)


def check_swap(root: Path, device: torch.device) -> Result:
    path = moe_dir(root, "swap")
    variants = {
        n: requantize(shard_of(path, n), n, t, out=root / f"{n}.{t.name}.gguf")
        for n, t in SWAPS.items()
    }
    runtime, model = open_model(path, device, Storage.DEQUANTIZED, stable_pointers=True)
    try:
        pointers = {n: s.active.tensor.data_ptr() for n, s in runtime.store.slots.items()}
        tokens = probe_tokens(model.config.n_vocab, batch=2, tokens=16).to(device)
        before = logits_of(model, tokens)
        for name, variant in variants.items():
            put(shard_of(path, name), variant)
        ticket = runtime.submit(plan_for(path, list(SWAPS), "swap"))
        runtime.wait_staged(timeout=60)
        _sync(device)
        started = time.perf_counter()
        runtime.at_batch_boundary()
        _sync(device)
        stall_ms = (time.perf_counter() - started) * 1e3
        after = logits_of(model, tokens)
        moved = [
            n for n, s in runtime.store.slots.items() if s.active.tensor.data_ptr() != pointers[n]
        ]
    finally:
        runtime.close()
    fresh_rt, fresh = open_model(path, device, Storage.DEQUANTIZED)
    try:
        same = torch.equal(after, logits_of(fresh, tokens))
    finally:
        fresh_rt.close()
    ok = (
        ticket.state is PlanState.COMMITTED
        and same
        and not moved
        and not torch.equal(before, after)
    )
    figures = {"commit_ms": stall_ms, "bit_identical": same, "pointers_moved": len(moved)}
    return Result("swap", "PASS" if ok else "FAIL", figures, "" if ok else str(ticket.summary()))


# -- OOM fallback --------------------------------------------------------------------------------


# The caching allocator's smallest block: filled down to it, not even its cached segments (2 MiB
# ones for small tensors) have room left.
SMALLEST_BLOCK = 512


def fill_device(device: torch.device) -> list[torch.Tensor]:
    """Hold device memory until no block of the caching allocator can be had: its cache is
    returned to the driver first, then taken in halving chunks, so a later allocation is refused
    by the allocator itself rather than served from memory torch had cached."""
    gc.collect()  # the earlier checks' models: freed later, they would return blocks to the cache
    torch.cuda.empty_cache()
    filler: list[torch.Tensor] = []
    chunk = 1 << 30
    while chunk >= SMALLEST_BLOCK:
        try:
            filler.append(torch.empty(chunk, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            chunk //= 2
    return filler


def check_oom(root: Path, device: torch.device) -> Result:
    if device.type != "cuda":
        return Result("oom", "SKIP", why="needs a CUDA device (the CPU suite simulates it)")
    path = moe_dir(root, "oom")
    saved = root / "oom-saved.gguf"
    shutil.copyfile(shard_of(path, GROW), saved)
    big = requantize(shard_of(path, GROW), GROW, GGMLType.F16, out=root / "oom-big.gguf")
    runtime, model = open_model(path, device, Storage.NATIVE)
    filler: list[torch.Tensor] = []
    try:
        tokens = probe_tokens(model.config.n_vocab, batch=2, tokens=16).to(device)
        logits_of(model, tokens)
        filler = fill_device(device)
        baseline = torch.cuda.memory_allocated(device)
        figures: dict[str, Any] = {
            "device_free_mib": torch.cuda.mem_get_info(device)[0] >> 20,
            "cached_free_kib": (torch.cuda.memory_reserved(device) - baseline) >> 10,
        }
        after_back = []
        for i in range(5):
            put(shard_of(path, GROW), big)
            grown = runtime.apply(plan_for(path, [GROW], f"big-{i}"))
            states = {runtime.store.slots[n].state for n in FAMILY}
            figures["allocated_fallen_mib"] = torch.cuda.memory_allocated(device) / 2**20
            figures["host_pool_kib"] = runtime.store.pools["host"].used / 1024
            put(shard_of(path, GROW), saved)
            runtime.apply(plan_for(path, [GROW], f"back-{i}"))
            after_back.append(torch.cuda.memory_allocated(device) - baseline)
        figures["allocated_baseline_mib"] = baseline / 2**20
        figures["growth_after_returns"] = max(after_back)
        put(shard_of(path, GROW), big)
        runtime.apply(plan_for(path, [GROW], "final"))
        filler.clear()  # a forward needs room for its activations
        torch.cuda.empty_cache()
        fallen = logits_of(model, tokens).cpu()
    finally:
        filler.clear()
        runtime.close()
        torch.cuda.empty_cache()
    fresh_rt, fresh = open_model(path, CPU, Storage.NATIVE)
    try:
        want = logits_of(fresh, tokens.cpu())
    finally:
        fresh_rt.close()
    figures["max_delta_vs_fresh"] = (fallen - want).abs().max().item()
    ok = (
        grown.state is PlanState.COMMITTED
        and states == {SlotState.FALLBACK_CPU}
        and max(after_back) == 0
        and figures["max_delta_vs_fresh"] <= 1e-3
    )
    return Result("oom", "PASS" if ok else "FAIL", figures, "" if ok else str(grown.summary()))


# -- CUDA graph ----------------------------------------------------------------------------------


def check_graph(root: Path, device: torch.device) -> Result:
    if device.type != "cuda":
        return Result("graph", "SKIP", why="needs a CUDA device")
    path = write_model(tiny_dense(), root / "graph", layout=Layout.PER_TENSOR)[0]
    name = "blk.1.ffn_down.weight"
    variant = requantize(shard_of(path, name), name, GGMLType.Q4_0, out=root / "graph-v.gguf")
    runtime, model = open_model(path, device, Storage.DEQUANTIZED, stable_pointers=True)
    try:
        tokens = probe_tokens(model.config.n_vocab, batch=2, tokens=16).to(device)
        with torch.inference_mode():
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up outside the graph: tables, workspaces
                    model(tokens)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = model(tokens)
            graph.replay()
            before = static.clone()
            put(shard_of(path, name), variant)
            ticket = runtime.apply(plan_for(path, [name], "graph"))
            graph.replay()
            replayed = static.clone()
            eager = model(tokens)
    except RuntimeError as exc:  # a capture the model's code does not allow
        return Result("graph", "FAIL", why=f"capture or replay failed: {exc}")
    finally:
        runtime.close()
    same = torch.equal(replayed, eager)
    ok = ticket.state is PlanState.COMMITTED and same and not torch.equal(before, replayed)
    return Result("graph", "PASS" if ok else "FAIL", {"replay_equals_eager": same})


# -- speed ---------------------------------------------------------------------------------------


def moe_spec(*, n_layers: int, n_embd: int, n_ff: int) -> ModelSpec:
    types = {"ffn_gate_exps": "q4_k", "ffn_up_exps": "q4_k", "ffn_down_exps": "q6_k"}
    types |= {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_o": "q4_k"}
    return ModelSpec(
        arch=Arch.QWEN3MOE,
        name="speed",
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=8,
        n_head_kv=4,
        n_ff=n_ff,
        n_vocab=2048,
        n_expert=32,
        n_expert_used=8,
        n_ff_expert=n_ff,
        context_length=512,
        types={**types, "token_embd": "q4_k", "output": "q6_k"},
    )


def decode_ms(path: Path, device: torch.device, storage: Storage, steps: int) -> float:
    """Median milliseconds of one-token decode steps with a KV cache."""
    runtime, model = open_model(path, device, storage)
    try:
        cache = model.new_cache(max_len=steps + 16)
        times = []
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3, 4]], device=device), start_pos=0, cache=cache)
            for i in range(steps + 2):
                token = torch.tensor([[(7 * i + 11) % 2048]], device=device)
                _sync(device)
                started = time.perf_counter()
                model(token, start_pos=cache.length, cache=cache)
                _sync(device)
                times.append(time.perf_counter() - started)
        return statistics.median(times[2:]) * 1e3
    finally:
        runtime.close()


def kernel_rows(device: torch.device, size: int) -> dict[str, float]:
    """Per type: decode + F.linear time over the kernel's, one row against [size, size]."""
    out: dict[str, float] = {}
    if not gpu.handles(GGMLType.Q4_K, device):
        return out
    from ggufswap.runtime.kernels.triton_qmatmul import TYPES, matmul
    from ggufswap.shards.ggml_types import row_nbytes

    x = torch.randn(1, size, device=device)
    for ggml_type in sorted(TYPES, key=int):
        raw = torch.randint(0, 256, (size * row_nbytes(ggml_type, size),), dtype=torch.uint8)
        raw = raw.to(device)  # random scales: timing only
        t_kernel = _time(lambda r=raw, t=ggml_type: matmul(r, t, (size, size), x), device)
        t_decode = _time(
            lambda r=raw, t=ggml_type: torch.nn.functional.linear(
                x, dequantize(r, t, (size, size))
            ),
            device,
        )
        out[ggml_type.name] = t_decode / t_kernel
    return out


def _time(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    fn()
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - started) / repeats


def check_speed(root: Path, device: torch.device, quick: bool) -> Result:
    small = quick or device.type == "cpu"
    n_layers, n_embd, n_ff = (2, 256, 256) if small else (4, 1024, 512)
    path = write_model(moe_spec(n_layers=n_layers, n_embd=n_embd, n_ff=n_ff), root / "speed")[0]
    steps = 4 if small else 32
    native = decode_ms(path, device, Storage.NATIVE, steps)
    dequantized = decode_ms(path, device, Storage.DEQUANTIZED, steps)
    ratio = dequantized / native
    figures: dict[str, Any] = {"native_ms": native, "dequantized_ms": dequantized, "ratio": ratio}
    figures |= {f"kernel_{k}": v for k, v in kernel_rows(device, 1024 if small else 4096).items()}
    if device.type == "cpu":
        return Result("speed", "SKIP", figures, "dry run: CPU figures, no target")
    return Result("speed", "PASS" if ratio >= 0.7 else "FAIL", figures, "target ratio >= 0.7")


# Each check by name, in the order they run: (the work folder, the device, --quick) -> its result.
CHECKS: dict[str, Callable[[Path, torch.device, bool], Result]] = {
    "parity": lambda root, device, _quick: check_parity(root, device),
    "swap": lambda root, device, _quick: check_swap(root, device),
    "oom": lambda root, device, _quick: check_oom(root, device),
    "graph": lambda root, device, _quick: check_graph(root, device),
    "speed": check_speed,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--quick", action="store_true", help="small models only")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument(
        "--check", action="append", choices=list(CHECKS), help="run only this check (repeatable)"
    )
    args = parser.parse_args()
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(
        f"gpu_check on {what}; torch {torch.__version__}; kernels: {gpu.unavailable() or 'triton'}"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(tmp)
        for label, check in CHECKS.items():
            if args.check and label not in args.check:
                continue
            started = time.perf_counter()
            try:
                result = check(root, device, args.quick)
            except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others'
                traceback.print_exc()
                result = Result(label, "FAIL", why=f"{type(exc).__name__}: {exc}"[:500])
            result.figures["seconds"] = round(time.perf_counter() - started, 1)
            print(result.line(), flush=True)
            results.append(result)
    if args.json is not None:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1, default=str))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
