"""Native storage's products: ggml's own kernels against the project's compiled float kernels.

    python bench/kernels.py [--quick] [--threads 1 2]

The measurement behind the kernel choice (pyproject.toml's comment on the C extensions): one
``[ROWS, COLS]`` matrix per type, in its GGUF blocks, multiplied by activations of 1 row (a decode
step) and 512 rows (a perplexity batch), on 1 and 2 threads, by

- ggml's kernels (``runtime/kernels/_ggml.py``: the installed libggml, through the project's glue),
- the project's own kernels: the compiled float kernel (``csrc/qkernels.c``: each block decoded
  in L1 and multiplied in float32) for a row, decode + ``F.linear`` for a batch
  (``float_products``, what runs without a libggml).

Each row is the float path's median time over ggml's (same matrix, activations and threads, the
two alternating), so a ratio above 1 is ggml faster. Where a C compiler is at hand, Q8_0's decode
row also runs a hand-written integer kernel (``bench/csrc/q8_0_int.c``: AVX2 + FMA, the
activations quantized to 8 bits, integer dot products; one thread): what writing our own integer
kernels would give, against ggml's. Needs a libggml (``pip install .[ggml]``).
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from _rows import row

from ggufswap.runtime import QuantizedMatrix, float_products
from ggufswap.runtime.kernels import _ggml
from ggufswap.shards import _synth
from ggufswap.shards.ggml_types import GGMLType

ROWS, COLS = 2048, 2048
T = GGMLType
MAINLINE: Final = (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)
IK: Final = (T.IQ4_KS, T.IQ4_K, T.IQ5_K)


def blocks(t: GGMLType) -> torch.Tensor:
    rng = np.random.default_rng([int(t), 7])
    if t in IK:
        data = _synth.synth_ik_tensor(rng, t, (COLS, ROWS), std=0.05)
    else:
        data = _synth.synth_tensor(rng, t, (COLS, ROWS), mean=0.0, std=0.05)
    return torch.from_numpy(np.ascontiguousarray(data))


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn: Any, reps: int, clock: str = "wall") -> float:
    """Median seconds of ``fn`` on ``clock`` (``cpu``: the process's CPU time, steadier on a
    shared host; with several threads it sums them)."""
    now = CLOCK[clock]
    fn()
    took = []
    for _ in range(reps):
        started = now()
        fn()
        took.append(now() - started)
    return statistics.median(took)


def measure(t: GGMLType, n: int, threads: int, reps: int, clock: str) -> tuple[float, float]:
    """(float path's seconds, ggml's) for one product."""
    torch.set_num_threads(threads)
    matrix = QuantizedMatrix(blocks(t), t, (ROWS, COLS), "blk.0.ffn_up.weight")
    x = torch.randn(n, COLS, generator=torch.Generator().manual_seed(n))

    def floats() -> None:
        with float_products():
            matrix.linear(x, dtype=torch.float32)

    def ggml() -> None:
        matrix.linear(x, dtype=torch.float32)

    float_s, ggml_s = [], []
    for _ in range(3):  # alternating rounds
        float_s.append(timed(floats, reps, clock))
        ggml_s.append(timed(ggml, reps, clock))
    return statistics.median(float_s), statistics.median(ggml_s)


def own_q8_0(tmp: Path) -> Any:
    """The hand-written Q8_0 kernel, compiled here (None without a compiler or off x86-64)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    lib = tmp / "q8_0_int.so"
    source = Path(__file__).resolve().parent / "csrc" / "q8_0_int.c"
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC"]
    if subprocess.run([cc, *flags, "-o", str(lib), str(source)], check=False).returncode:
        return None
    fn = ctypes.CDLL(str(lib)).q8_0_matvec
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def own_row(clock: str, reps: int) -> list[dict[str, Any]]:
    """Q8_0, one row, one thread: the hand-written integer kernel against ggml's."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        fn = own_q8_0(Path(tmp))
        if fn is None:
            print("  no C compiler: no hand-written integer kernel", file=sys.stderr)
            return []
        raw = blocks(T.Q8_0)
        matrix = QuantizedMatrix(raw, T.Q8_0, (ROWS, COLS), "blk.0.ffn_up.weight")
        x = torch.randn(1, COLS, generator=torch.Generator().manual_seed(1))
        y = torch.empty(ROWS)
        fn(raw.data_ptr(), ROWS, COLS, x.data_ptr(), y.data_ptr())
        ggml_y = matrix.linear(x, dtype=torch.float32)[0]
        error = float((y - ggml_y).norm() / ggml_y.norm())
        own_s, ggml_s = [], []
        for _ in range(3):
            own_s.append(
                timed(
                    lambda: fn(raw.data_ptr(), ROWS, COLS, x.data_ptr(), y.data_ptr()), reps, clock
                )
            )
            ggml_s.append(timed(lambda: matrix.linear(x, dtype=torch.float32), reps, clock))
    own, ggml = statistics.median(own_s), statistics.median(ggml_s)
    print(f"  Q8_0 x 1 row, 1 thread: own integer kernel {own * 1e3:.3f} ms, ggml "
          f"{ggml * 1e3:.3f} ms (relative difference {error:.1e})", file=sys.stderr)  # fmt: skip
    return [row(f"Q8_0 [{ROWS}x{COLS}] x 1 row, 1 thread: ggml vs own integer", own, ggml, None)]


def run(
    quick: bool, threads: tuple[int, ...] = (1, 2), clock: str = "wall"
) -> list[dict[str, Any]]:
    library = _ggml.library()
    if library is None:
        print(f"  no libggml: {_ggml.describe()}", file=sys.stderr)
        return []
    types = [t for t in (*MAINLINE, *IK) if t in library.types]
    if quick:
        types = types[:2]
    rows = []
    for t in types:
        for n in (1, 512):
            for th in threads:
                reps = (3 if quick else 10) if n > 1 else (10 if quick else 50)
                float_s, ggml_s = measure(t, n, th, reps, clock)
                print(f"  {t.name} x {n} rows, {th} thread(s): float {float_s * 1e3:.3f} ms, "
                      f"ggml {ggml_s * 1e3:.3f} ms", file=sys.stderr)  # fmt: skip
                name = f"{t.name} [{ROWS}x{COLS}] x {n} rows, {th} thread(s): ggml vs float"
                rows.append(row(name, float_s, ggml_s, None))
    if platform.machine() == "x86_64":
        rows += own_row(clock, 10 if quick else 50)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall")
    args = parser.parse_args()
    for r in run(args.quick, tuple(args.threads), args.clock):
        print(f"{r['name']}: float {r['baseline_s']:.4g} s, ggml {r['ours_s']:.4g} s, "
              f"ratio {r['ratio']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
