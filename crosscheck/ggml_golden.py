"""Golden data for ggml's CPU products, recorded with a libggml itself (mainline's or ik's).

Writes ``tests/fixtures/ggml_golden/<family>.npz`` and ``<family>.json`` (``family``: ``mainline``
or ``ik``) for ``tests/test_ggml_golden.py``, which replays them without any reference library:
the project's ggml products (``runtime/kernels/_ggml.py``, through its own C glue) must give these
bits where the same library is loaded on a CPU of the same instruction sets, and its fallbacks
(ggml's rounding emulated, or float products) must come close everywhere.

This script is independent of the project's code: it drives the library through ctypes only
(``ggml_quantize_chunk`` for the weights, then one ``ggml_mul_mat`` / ``ggml_mul_mat_id`` graph
on a CPU backend), so that it checks the project's glue rather than repeating it. Run it with the
Python of the venv that holds the library (numpy is all it needs)::

    .venv-ik/bin/python crosscheck/ggml_golden.py \\
        --lib .venv-ik/lib/python3.11/site-packages/ik_llama_cpp/lib/libggml.so
    .venv-crosscheck/bin/python crosscheck/ggml_golden.py \\
        --lib .venv-crosscheck/lib/python3.11/site-packages/llama_cpp/lib/libggml-cpu.so

Per type: a stack of ``N_EXPERT`` expert matrices ``[ROWS, COLS]`` (the first is the matrix of
the plain products) quantized from seeded normal floats (an imatrix of ones for the
types that need one), each in a forked child (a type the library cannot quantize aborts it: the
type is then listed as not recorded, with the signal); activations of ``N_ROWS`` rows each (the
single-row decode path and the batched ones of both libraries); and a routed-experts product of
``N_EXPERT`` experts. A library's products do not depend on its thread count (checked here: 1 and
2 threads must agree, or the type is not recorded).
"""

from __future__ import annotations

import argparse
import ctypes as C  # noqa: N812 (the ctypes convention of the reference scripts)
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "tests" / "fixtures" / "ggml_golden"
ROWS, COLS = 64, 256  # ik's kernels take one path per thread from 32 rows a thread up
N_ROWS = (1, 5, 40)  # decode, a few rows, a batch (ik repacks activations from 32 rows up)
N_EXPERT, N_TOKENS, N_USED = 3, 3, 2
GGML_F32, GGML_I32 = 0, 26
MAINLINE = {
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
    "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19,
    "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "IQ1_M": 29, "MXFP4": 39,
}  # fmt: skip
IK = {
    "Q6_0": 133, "IQ2_K": 137, "IQ3_K": 138, "IQ4_K": 139, "IQ5_K": 140, "IQ6_K": 141,
    "IQ4_KS": 144, "IQ2_KS": 145, "IQ4_KSS": 146, "IQ5_KS": 152, "IQ2_KT": 153, "IQ3_KT": 154,
    "IQ4_KT": 155, "IQ3_KS": 156, "IQ2_KL": 157, "IQ1_KT": 158,
}  # fmt: skip
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_int8")  # fmt: skip


class InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class Ggml:
    """The few functions of a libggml this script calls, through ctypes."""

    def __init__(self, path: str) -> None:
        lib = C.CDLL(path)
        p, i64, sz = C.c_void_p, C.c_int64, C.c_size_t

        def fn(name: str, res: Any, *args: Any) -> Any:
            f = getattr(lib, name)
            f.restype, f.argtypes = res, list(args)
            return f

        self.ik = hasattr(lib, "iqk_mul_mat")
        self.init = fn("ggml_init", p, InitParams)
        self.free = fn("ggml_free", None, p)
        self.overhead = fn("ggml_tensor_overhead", sz)
        self.graph_overhead = fn("ggml_graph_overhead", sz)
        self.new_2d = fn("ggml_new_tensor_2d", p, p, C.c_int, i64, i64)
        self.new_3d = fn("ggml_new_tensor_3d", p, p, C.c_int, i64, i64, i64)
        self.mul_mat = fn("ggml_mul_mat", p, p, p, p)
        self.mul_mat_id = fn("ggml_mul_mat_id", p, p, p, p, p)
        self.new_graph = fn("ggml_new_graph", p, p)
        self.expand = fn("ggml_build_forward_expand", None, p, p)
        self.from_ptr = fn("ggml_backend_cpu_buffer_from_ptr", p, p, sz)
        self.tensor_alloc = fn("ggml_backend_tensor_alloc", None, p, p, p)
        self.buffer_free = fn("ggml_backend_buffer_free", None, p)
        self.cpu_init = fn("ggml_backend_cpu_init", p)
        self.set_threads = fn("ggml_backend_cpu_set_n_threads", None, p, C.c_int)
        self.compute = fn("ggml_backend_graph_compute", C.c_int, p, p)
        self.row_size = fn("ggml_row_size", sz, C.c_int, i64)
        self.quantize = fn("ggml_quantize_chunk", sz, C.c_int, p, p, i64, i64, i64, p)
        self.needs_imatrix = fn("ggml_quantize_requires_imatrix", C.c_bool, C.c_int)
        self.backend = self.cpu_init()

    def run(self, build: Any, arrays: list[np.ndarray], threads: int) -> None:
        """``build(ctx) -> (out, tensors)``; ``tensors[i]`` is placed on ``arrays[i]``."""
        ctx = self.init(InitParams(self.overhead() * 16 + self.graph_overhead(), None, True))
        out, tensors = build(ctx)
        graph = self.new_graph(ctx)
        self.expand(graph, out)
        buffers = []
        for tensor, array in zip(tensors, arrays, strict=True):
            addr = array.ctypes.data
            base = addr & ~63
            buffer = self.from_ptr(base, addr + array.nbytes - base)
            self.tensor_alloc(buffer, tensor, addr)
            buffers.append(buffer)
        self.set_threads(self.backend, threads)
        assert self.compute(self.backend, graph) == 0, "ggml_backend_graph_compute failed"
        for buffer in buffers:
            self.buffer_free(buffer)
        self.free(ctx)

    def product(self, t: int, w: np.ndarray, x: np.ndarray, threads: int) -> np.ndarray:
        y = np.zeros((x.shape[0], ROWS), np.float32)

        def build(ctx: Any) -> Any:
            tw = self.new_2d(ctx, t, COLS, ROWS)
            tx = self.new_2d(ctx, GGML_F32, COLS, x.shape[0])
            ty = self.mul_mat(ctx, tw, tx)
            return ty, [tw, tx, ty]

        self.run(build, [w, x, y], threads)
        return y

    def routed(
        self, t: int, w: np.ndarray, x: np.ndarray, ids: np.ndarray, threads: int
    ) -> np.ndarray:
        y = np.zeros((N_TOKENS, N_USED, ROWS), np.float32)

        def build(ctx: Any) -> Any:
            tw = self.new_3d(ctx, t, COLS, ROWS, N_EXPERT)
            tx = self.new_3d(ctx, GGML_F32, COLS, 1, N_TOKENS)
            ti = self.new_2d(ctx, GGML_I32, N_USED, N_TOKENS)
            ty = self.mul_mat_id(ctx, tw, tx, ti)
            return ty, [tw, tx, ti, ty]

        self.run(build, [w, x, ids, y], threads)
        return y

    def quantized(self, t: int, values: np.ndarray) -> np.ndarray:
        rows, cols = values.shape
        out = np.zeros(rows * self.row_size(t, cols), np.uint8)
        imatrix = np.ones(cols, np.float32)
        im = imatrix.ctypes.data if self.needs_imatrix(t) else None
        self.quantize(t, values.ctypes.data, out.ctypes.data, 0, rows, cols, im)
        return out


def activations() -> dict[str, np.ndarray]:
    """The activations every type is multiplied by (shared: recorded once)."""
    rng = np.random.default_rng(26)
    out = {f"x{n}": rng.standard_normal((n, COLS)).astype(np.float32) for n in N_ROWS}
    out["ex"] = rng.standard_normal((N_TOKENS, COLS)).astype(np.float32)
    picks = [rng.permutation(N_EXPERT)[:N_USED] for _ in range(N_TOKENS)]
    out["ids"] = np.stack(picks).astype(np.int32)
    return out


def record_type(ggml: Ggml, name: str, t: int) -> dict[str, np.ndarray]:
    """Everything recorded for one type (run in a child: quantizing may abort)."""
    rng = np.random.default_rng([t, 26])
    # the experts' stack; its first expert is the matrix (rows are quantized one by one)
    stack_values = (rng.standard_normal((N_EXPERT * ROWS, COLS)) * 0.05).astype(np.float32)
    stack = ggml.quantized(t, stack_values)
    w = ggml.quantized(t, stack_values[:ROWS])
    if not np.array_equal(w, stack[: w.size]):
        raise SystemExit(f"{name}: rows quantize differently inside a bigger tensor")
    shared = activations()
    out: dict[str, np.ndarray] = {f"{name}/stack": stack}
    for n in N_ROWS:
        x = shared[f"x{n}"]
        y = ggml.product(t, w, x, 1)
        if not np.array_equal(y, ggml.product(t, w, x, 2)):
            raise SystemExit(f"{name}: {n} rows: 1 and 2 threads differ")
        out[f"{name}/y{n}"] = y
    x, ids = shared["ex"], shared["ids"]
    y = ggml.routed(t, stack, x, ids, 1)
    if not np.array_equal(y, ggml.routed(t, stack, x, ids, 2)):
        raise SystemExit(f"{name}: routed products differ between 1 and 2 threads")
    out[f"{name}/ey"] = y
    return out


def in_child(ggml: Ggml, name: str, t: int) -> tuple[dict[str, np.ndarray] | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.npz"
        pid = os.fork()
        if pid == 0:  # the child: record and leave without cleanup
            code = 0
            try:
                np.savez(path, **record_type(ggml, name, t))
            except BaseException as exc:  # noqa: BLE001 (the child reports any failure)
                print(f"{name}: {exc}", file=sys.stderr)
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            return None, f"aborted (signal {os.WTERMSIG(status)})"
        if os.WEXITSTATUS(status) != 0:
            return None, "failed (see stderr)"
        with np.load(path) as data:
            return {k: data[k] for k in data.files}, "recorded"


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    present = set(line.split(":", 1)[-1].split())
    return [f for f in ISA_FLAGS if f in present]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True, help="libggml.so (ik) or libggml-cpu.so")
    parser.add_argument("--package", default="", help="the package and version it came from")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    ggml = Ggml(args.lib)
    family = "ik" if ggml.ik else "mainline"
    types = {**MAINLINE, **(IK if ggml.ik else {})}
    arrays: dict[str, np.ndarray] = activations()
    outcome: dict[str, str] = {}
    for name, t in types.items():
        got, outcome[name] = in_child(ggml, name, t)
        print(f"{family} {name}: {outcome[name]}", file=sys.stderr)
        if got is not None:
            arrays.update(got)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / f"{family}.npz", **arrays)
    manifest = {
        "family": family,
        "library": Path(args.lib).name,
        "package": args.package,
        "machine": platform.machine(),
        "cpu_flags": cpu_flags(),
        "types": {name: {"code": t, "outcome": outcome[name]} for name, t in types.items()},
        "rows": ROWS,
        "cols": COLS,
        "n_rows": list(N_ROWS),
        "experts": {"n_expert": N_EXPERT, "tokens": N_TOKENS, "used": N_USED},
    }
    (args.out / f"{family}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
