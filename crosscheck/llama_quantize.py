"""llama.cpp's own quantizer on GGUF files; runs in the cross-check venv.

``python llama_quantize.py SRC DST FTYPE [SRC DST FTYPE ...]``: each DST is SRC quantized by
``llama_model_quantize`` (what ``llama-quantize`` runs) with its default parameters, one thread,
``FTYPE`` a ``LLAMA_FTYPE_*`` number (7: Q8_0, 14: Q4_K_S). Rows whose length does not fit the
type take llama.cpp's fallback type, as llama-quantize would. Imports only llama_cpp.
"""

from __future__ import annotations

import sys

import llama_cpp


def quantize(src: str, dst: str, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, ftype {ftype}) returned {status}")


def main(argv: list[str]) -> int:
    jobs = argv[1:]
    if not jobs or len(jobs) % 3:
        print(__doc__, file=sys.stderr)
        return 2
    for i in range(0, len(jobs), 3):
        quantize(jobs[i], jobs[i + 1], int(jobs[i + 2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
