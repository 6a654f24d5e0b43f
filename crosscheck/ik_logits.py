"""ik_llama.cpp's full-sequence logits for a list of GGUF files; runs in ``.venv-ik`` (the
``ik-llama-cpp-python`` wheel's ik_llama.cpp: numpy and ik_llama_cpp only).

``python ik_logits.py JOBS.json OUT.npz``: JOBS is ``{"tokens": [...], "models": {case: path}}``,
as ``llama_logits.py`` takes it. Each model is loaded with ik_llama.cpp's C API (one thread, an
F16 KV cache (see ``KV_TYPE``), no flash attention), the tokens
decoded in one batch with every position's logits requested, and OUT gets one ``[T, V]`` float32
array per case. A model ik_llama.cpp refuses is reported under ``"refused"`` on stdout (JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from ik_llama_cpp import _ctypes_api as C  # noqa: N812 (the wheel's own alias)
from ik_llama_cpp._internals import IkModel

# ik_llama.cpp refuses an F32 V cache without flash attention ("V cache quantization requires
# flash_attn"), and its flash attention asserts on CPUs without AVX-VNNI: an F16 cache (llama.cpp's
# own default; ~2e-7 mean KLD of rounding at F32 weights, finding 2).
KV_TYPE = 1  # GGML_TYPE_F16


def logits_of(path: str, tokens: list[int]) -> np.ndarray:
    """``[T, V]`` logits of ``tokens`` decoded in one batch."""
    model = IkModel(path)
    params = C.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = max(64, len(tokens))
    params.n_threads = params.n_threads_batch = 1
    params.type_k = params.type_v = KV_TYPE
    params.flash_attn = False
    ctx = C.llama_init_from_model(model.model, params)
    if not ctx:
        raise RuntimeError(f"ik_llama.cpp could not create a context for {path}")
    batch = C.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        if C.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on {path}")
        rows = [C.llama_get_logits_ith(ctx, i) for i in range(len(tokens))]
        return np.array([[row[j] for j in range(model.n_vocab)] for row in rows], np.float32)
    finally:
        C.llama_batch_free(batch)
        C.llama_free(ctx)
        model.close()


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[1]).read_text())
    tokens = [int(t) for t in jobs["tokens"]]
    out: dict[str, np.ndarray] = {}
    refused: dict[str, str] = {}
    for case, path in jobs["models"].items():
        try:
            out[case] = logits_of(path, tokens)
        except RuntimeError as exc:
            refused[case] = str(exc)
    arrays: dict[str, Any] = {f"case{i}": out[c] for i, c in enumerate(out)}
    np.savez(argv[2], **arrays)
    print(json.dumps({"cases": list(out), "refused": refused}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
