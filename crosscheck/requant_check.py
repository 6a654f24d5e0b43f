"""Dequantize-requantize round trips through llama.cpp-written tensors, ours against ggml's.

    .venv/bin/python crosscheck/requant_check.py MODEL.gguf [--tensors N] [--max-values M]
        [--xcheck-python .venv-crosscheck/bin/python]

For the first N quantized tensors of MODEL.gguf (a file llama.cpp wrote, e.g. the Gemma 3 270M
Q4_K_M of ``tests/test_gemma_real.py``) whose rows are whole 256-value super-blocks: dequantize
the tensor (gguf-py), quantize the values to every type ``shards.kquants`` writes, both with
``kquants`` and with llama.cpp's own ``ggml_quantize_chunk`` (``crosscheck/quant_golden.py
--quantize`` in the cross-check venv), and print how many blocks differ, plus, for the tensor's
own type, how many blocks reproduce the file's original bytes (llama-quantize may have used an
importance matrix, so those need not match). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf.quants import dequantize

from ggufswap.shards import kquants

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--tensors", type=int, default=6)
    parser.add_argument("--max-values", type=int, default=1 << 20, help="skip larger tensors")
    parser.add_argument(
        "--xcheck-python", default=str(HERE.parent / ".venv-crosscheck" / "bin" / "python")
    )
    args = parser.parse_args()
    reader = GGUFReader(args.model)
    done = 0
    with tempfile.TemporaryDirectory() as tmp:
        for t in reader.tensors:
            ne0 = int(t.shape[0])
            plain = t.tensor_type.name in ("F32", "F16", "BF16")
            if plain or ne0 % 256 or t.n_elements > args.max_values or done == args.tensors:
                continue
            done += 1
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            src = Path(tmp) / "src.f32"
            values.astype("<f4").tofile(src)
            line = [f"{t.name} ({t.tensor_type.name}, {t.n_elements} values):"]
            for target in kquants.TYPES:
                dst = Path(tmp) / "ggml.bin"
                subprocess.run(
                    [
                        args.xcheck_python,
                        str(HERE / "quant_golden.py"),
                        "--quantize",
                        str(src),
                        target.name,
                        str(ne0),
                        str(dst),
                    ],
                    check=True,
                )
                theirs = np.fromfile(dst, dtype=np.uint8)
                ours = kquants.quantize(values, target)
                size = GGML_QUANT_SIZES[target][1]
                differ = int(
                    np.any(ours.reshape(-1, size) != theirs.reshape(-1, size), axis=1).sum()
                )
                note = f"{target.name} {differ}/{ours.size // size}"
                if target == t.tensor_type:
                    original = np.asarray(t.data, dtype=np.uint8).reshape(-1, size)
                    same = int(np.all(ours.reshape(-1, size) == original, axis=1).sum())
                    note += f" (file's bytes reproduced in {same}/{original.shape[0]} blocks)"
                line.append(note)
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
