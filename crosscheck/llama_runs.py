"""llama.cpp's logits under chosen kernel settings, and its intermediate tensors; runs in the
cross-check venv (numpy and llama_cpp only).

``python llama_runs.py JOBS.json OUT.npz``: JOBS is ``{"tokens": [[...], ...], "runs": [{"name",
"path", "chunk", "extra_bufts": bool, "flash_attn": bool, "dump": [tensor names]}]}``. Each run
loads ``path`` (one thread, F32 KV cache, one batch) and writes ``OUT[name]`` (``[T, V]``
logits of ``tokens[chunk]``) and ``OUT[name + "::" + tensor]`` for each dumped graph tensor
(``l_out-3``, ``attn_norm-0``, ...: llama.cpp's callback names), caught through the context's
eval callback. ``extra_bufts`` is set on the model parameters directly: llama-cpp-python's
``Llama`` takes no such argument (a ``use_extra_bufts=`` keyword is swallowed by its
``**kwargs``), so by default the weights are repacked (Q4_0, Q4_K, IQ4_NL to 8x8 on AVX2).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as capi
import numpy as np
from llama_cpp import Llama

GGML_TYPE_F32 = 0
TENSOR_NE_OFFSET = 16  # struct ggml_tensor: enum type (padded to 8), buffer pointer, int64 ne[4]


def _ggml_base() -> Any:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    return lib


def run(job: dict[str, Any], tokens: list[int]) -> dict[str, np.ndarray]:
    """One run's logits and dumped tensors."""
    base = _ggml_base()
    dump = set(job.get("dump", ()))
    captured: dict[str, np.ndarray] = {}

    def callback(t: int, ask: bool, _user: int) -> bool:
        name = base.ggml_get_name(t).decode()
        if ask or name not in dump:
            return name in dump if ask else True
        ne = (ctypes.c_int64 * 4).from_address(t + TENSOR_NE_OFFSET)
        assert ctypes.c_int32.from_address(t).value == GGML_TYPE_F32, name
        size = base.ggml_nbytes(t)
        buf = (ctypes.c_uint8 * size)()
        base.ggml_backend_tensor_get(t, buf, 0, size)
        shape = (ne[3], ne[2], ne[1], ne[0])
        captured[name] = np.frombuffer(bytes(buf), dtype=np.float32).reshape(shape).copy()
        return True

    eval_cb = capi.ggml_backend_sched_eval_callback(callback)
    model_defaults, context_defaults = (
        capi.llama_model_default_params,
        capi.llama_context_default_params,
    )

    def model_params() -> Any:
        params = model_defaults()
        params.use_extra_bufts = bool(job.get("extra_bufts", True))
        return params

    def context_params() -> Any:
        params = context_defaults()
        if dump:
            params.cb_eval = eval_cb
        return params

    capi.llama_model_default_params = model_params
    capi.llama_context_default_params = context_params
    try:
        llm = Llama(
            model_path=job["path"],
            type_k=GGML_TYPE_F32,
            type_v=GGML_TYPE_F32,
            n_ctx=max(64, len(tokens)),
            n_batch=len(tokens),
            n_ubatch=len(tokens),
            logits_all=True,
            n_threads=1,
            n_threads_batch=1,
            flash_attn=bool(job.get("flash_attn", False)),
            verbose=False,
        )
    finally:
        capi.llama_model_default_params = model_defaults
        capi.llama_context_default_params = context_defaults
    try:
        llm.eval(tokens)
        out = {job["name"]: np.array(llm.scores[: len(tokens)], dtype=np.float32)}
    finally:
        llm.close()
    out.update({f"{job['name']}::{k}": v for k, v in captured.items()})
    return out


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[1]).read_text())
    arrays: dict[str, np.ndarray] = {}
    for job in jobs.get("runs", []):
        arrays.update(run(job, [int(t) for t in jobs["tokens"][job.get("chunk", 0)]]))
    np.savez(argv[2], **arrays)
    if "tokenize" in jobs:
        llm = Llama(model_path=jobs["tokenize"]["model"], vocab_only=True, verbose=False)
        text = jobs["tokenize"]["text"].encode("utf-8")
        ids = [int(t) for t in llm.tokenize(text, add_bos=True, special=False)]
        print(json.dumps({"tokenized": ids, "bos": int(llm.token_bos())}))
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
