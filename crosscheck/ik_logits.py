"""ik_llama.cpp's full-sequence logits for a list of GGUF files; runs in ``.venv-ik``.

``python ik_logits.py JOBS.json OUT.npz``, the jobs as ``llama_logits.py`` reads them
(``{"tokens": [...], "models": {case: path}}``): each model is loaded by ik_llama.cpp's own
library (the ``ik-llama-cpp-python`` wheel, through its ctypes API: ``llama_model_load_from_file``,
``llama_init_from_model``, ``llama_decode``), the tokens evaluated in one batch with one thread, an
F32 KV cache and every position's logits, and OUT gets one ``[T, V]`` float32 array per case. Each
model runs in a forked child, because ik aborts the process on a model it cannot run (mainline's
deepseek2 files with other than DeepSeek's head sizes, for one); a model ik refuses gets no array
and its log's tail is listed under ``"refused"`` in the JSON report on stdout.

The context keeps ik's defaults (``mla_attn`` 3) but the K cache type, the threads and flash
attention, off unless the jobs say ``"flash_attn": true``: the wheel's ``IkLlama`` turns it off on
CPUs without AVX-VNNI, such as this one, where ik's flash attention aborts (it did on every tiny
deepseek2 file here). Without it ik computes every batch of the three-tensor deepseek2 form from
``attn_k_b`` / ``attn_v_b`` (``src/graphs/build_deepseek2.cpp``). The V cache stays F16: ik
refuses any other V type without flash attention, and its MLA path keeps no V cache.

Imports only numpy and ik_llama_cpp: this venv has neither the project nor torch.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from ik_llama_cpp import _ctypes_api as C  # noqa: N812 (the wheel's own name for it)

GGML_TYPE_F32 = 0
LOG_TAIL_CHARS = 2000


def logits_of(path: str, tokens: list[int], *, flash_attn: bool) -> np.ndarray:
    """``[T, V]`` logits of ``tokens`` evaluated in one batch (F32 cache, one thread)."""
    model_params = C.llama_model_default_params()
    model = C.llama_model_load_from_file(path.encode(), model_params)
    if not model:
        raise RuntimeError(f"ik_llama.cpp refused {path}")
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    params = C.llama_context_default_params()
    params.n_ctx = max(64, len(tokens))
    params.n_batch = params.n_ubatch = len(tokens)
    params.n_threads = params.n_threads_batch = 1
    params.type_k = GGML_TYPE_F32  # the latent cache (ik: type_v other than F16 needs FA)
    params.flash_attn = flash_attn
    ctx = C.llama_init_from_model(model, params)
    try:
        if not ctx:
            raise RuntimeError(f"ik_llama.cpp could not make a context for {path}")
        batch = C.llama_batch_init(len(tokens), 0, 1)
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        status = C.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for {path}")
        rows = []
        for i in range(len(tokens)):
            row = ctypes.cast(C.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float))
            rows.append(np.ctypeslib.as_array(row, shape=(n_vocab,)).copy())
        C.llama_batch_free(batch)
        return np.stack(rows).astype(np.float32)
    finally:
        if ctx:
            C.llama_free(ctx)
        C.llama_free_model(model)


def in_child(path: str, tokens: list[int], *, flash_attn: bool, out: Path) -> str | None:
    """``logits_of`` in a forked child (ik aborts the process on a model it cannot run), its
    array saved to ``out``; None when it succeeded, else the tail of what ik logged."""
    with tempfile.TemporaryFile() as log:
        pid = os.fork()
        if pid == 0:  # the child: ik's log to the file, the logits to out, then exit
            os.dup2(log.fileno(), 2)
            try:
                np.save(out, logits_of(path, tokens, flash_attn=flash_attn))
                os._exit(0)
            except BaseException:  # noqa: BLE001 (anything: the parent reads the log)
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) == 0:
            return None
        log.seek(0)
        return log.read().decode(errors="replace")[-LOG_TAIL_CHARS:]


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[1]).read_text())
    tokens = [int(t) for t in jobs["tokens"]]
    flash_attn = bool(jobs.get("flash_attn", False))
    C.llama_backend_init()
    out: dict[str, np.ndarray] = {}
    refused: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (case, path) in enumerate(jobs["models"].items()):
            array = Path(tmp) / f"{i}.npy"
            log = in_child(path, tokens, flash_attn=flash_attn, out=array)
            if log is None:
                out[case] = np.load(array)
            else:
                refused[case] = log
    np.savez(argv[2], **{f"case{i}": out[c] for i, c in enumerate(out)})
    report: dict[str, Any] = {"cases": list(out), "refused": refused, "engine": "ik_llama.cpp"}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
