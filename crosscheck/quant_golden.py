"""Golden quantization data for the K-quant and IQ4 types, made with llama.cpp's own ggml.

Writes ``tests/fixtures/kquant_golden/``: ``source.f32`` (the input rows, float32 little-endian),
one ``<type>.bin`` per type (the bytes ``ggml_quantize_chunk`` wrote for those rows, no importance
matrix: what ``llama-quantize`` writes for a tensor of that type without ``--imatrix``) and
``manifest.json`` (shape, row descriptions, sizes and sha256 of every file).
``tests/test_kquants.py`` checks ``ggufswap.shards.kquants`` against them without llama.cpp. Not
part of the test suite; run by hand with the cross-check venv (``make crosscheck`` builds it),
which has llama-cpp-python and its ggml shared libraries but no numpy, so this script uses only
the standard library::

    .venv-crosscheck/bin/python crosscheck/quant_golden.py [--out DIR] [--random-rows N]

``--random-rows N`` appends N rows of seeded normal data (a larger sample for measuring agreement
by hand; the committed fixture uses the default 0). ``--quantize SRC TYPE N_PER_ROW DST`` instead
quantizes the float32 file SRC (rows of N_PER_ROW) to TYPE and writes ggml's bytes to DST; this
is how ``crosscheck/requant_check.py`` asks ggml for its bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import random
import struct
from array import array
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "kquant_golden"
N_PER_ROW = 512  # two 256-element super-blocks per row

# ggml's type ids (ggml/include/ggml.h) and block sizes in bytes per 256 values.
TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}


def _rows() -> list[tuple[str, list[float]]]:
    """The deterministic source rows: ordinary data and the awkward cases quantizers trip on."""
    rng = random.Random(20261123)  # noqa: S311 -- seeded test data, not secrets
    n = N_PER_ROW

    def normal(std: float, mean: float = 0.0) -> list[float]:
        return [rng.gauss(mean, std) for _ in range(n)]

    outlier = normal(0.02)
    outlier[37] = 1.5
    outlier[300] = -0.9
    sparse = [0.0] * n
    for i in rng.sample(range(n), 12):
        sparse[i] = rng.uniform(-0.1, 0.1)
    half = [0.5] * (n // 4) + [-0.25] * (n // 4) + [0.0] * (n // 4) + [3.0] * (n // 4)
    # Values already on a 4-bit grid with a per-32 scale and offset (a dequantized K-quant tensor).
    grid = []
    for b in range(n // 32):
        scale, offset = 0.003 * (1 + b % 5), -0.01 * (b % 3)
        grid += [offset + scale * rng.randrange(16) for _ in range(32)]
    return [
        ("normal std 0.02", normal(0.02)),
        ("zeros", [0.0] * n),
        ("normal std 0.02 with two outliers (1.5 at 37, -0.9 at 300)", outlier),
        ("constant quarters 0.5, -0.25, 0.0, 3.0", half),
        ("normal std 1e-6 (tiny)", normal(1e-6)),
        ("normal std 1e-9 (fp16 scales underflow)", normal(1e-9)),
        ("uniform [-1, 1]", [rng.uniform(-1.0, 1.0) for _ in range(n)]),
        ("normal mean 3 std 1 (all positive)", normal(1.0, 3.0)),
        ("normal mean -2 std 0.1 (all negative)", normal(0.1, -2.0)),
        ("12 nonzeros among zeros", sparse),
        ("on a 4-bit grid (dequantized K-quant values)", grid),
        ("normal std 200 (large)", normal(200.0)),
        ("alternating signs 1e-3 * (-1)^i * i", [1e-3 * (-1) ** i * (i % 17) for i in range(n)]),
    ]


def _library() -> ctypes.CDLL:
    import llama_cpp  # the cross-check venv's llama-cpp-python: its lib/ holds libggml-base.so

    lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return base


def quantizer() -> Callable[[str, array, int], bytes]:
    """``quantize(type_name, float32 array, n_per_row) -> bytes`` through ggml_quantize_chunk."""
    lib = _library()

    def quantize(type_name: str, src: array, n_per_row: int) -> bytes:
        ggml_type = TYPES[type_name]
        nrows = len(src) // n_per_row
        size = lib.ggml_row_size(ggml_type, n_per_row) * nrows
        dst = ctypes.create_string_buffer(size)
        src_buf = (ctypes.c_float * len(src)).from_buffer(src)
        done = lib.ggml_quantize_chunk(ggml_type, src_buf, dst, 0, nrows, n_per_row, None)
        assert done == size, f"{type_name}: ggml wrote {done} bytes, expected {size}"
        return dst.raw

    return quantize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--random-rows", type=int, default=0, metavar="N")
    parser.add_argument("--quantize", nargs=4, metavar=("SRC", "TYPE", "N_PER_ROW", "DST"))
    args = parser.parse_args()
    if args.quantize:
        src_path, type_name, n_per_row, dst_path = args.quantize
        values = array("f")
        values.frombytes(Path(src_path).read_bytes())
        Path(dst_path).write_bytes(quantizer()(type_name.upper(), values, int(n_per_row)))
        return

    rows = _rows()
    rng = random.Random(7)  # noqa: S311 -- seeded test data, not secrets
    for r in range(args.random_rows):
        std = math.exp(rng.uniform(math.log(1e-4), math.log(10.0)))
        rows.append((f"random {r}", [rng.gauss(0.0, std) for _ in range(N_PER_ROW)]))
    src = array("f", [v for _, row in rows for v in row])
    assert src.itemsize == 4, "array('f') is float32"
    assert struct.pack("=f", 1.0) == struct.pack("<f", 1.0), "source.f32 is little-endian"

    args.out.mkdir(parents=True, exist_ok=True)
    files = {"source.f32": src.tobytes()}
    quantize = quantizer()
    for name in TYPES:
        files[f"{name.lower()}.bin"] = quantize(name, src, N_PER_ROW)
    import llama_cpp

    manifest = {
        "made_by": "crosscheck/quant_golden.py: ggml_quantize_chunk(type, src, dst, 0, rows, "
        "n_per_row, imatrix=NULL)",
        "llama_cpp_python": llama_cpp.__version__,
        "rows": len(rows),
        "n_per_row": N_PER_ROW,
        "row_descriptions": [desc for desc, _ in rows],
        "ggml_type_ids": TYPES,
        "files": {
            name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in files.items()
        },
    }
    for name, data in files.items():
        (args.out / name).write_bytes(data)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(files) + 1} files to {args.out}")


if __name__ == "__main__":
    main()
