"""llama.cpp's full-sequence logits for a list of GGUF files; runs in the cross-check venv.

``python llama_logits.py JOBS.json OUT.npz``: JOBS is ``{"tokens": [...], "models": {case: path}}``.
Each model is loaded with llama-cpp-python as reference-builds.md says (one thread, every
position's logits; its ``use_extra_bufts=False`` is swallowed by ``Llama``'s ``**kwargs``, so
llama.cpp's default weight repacking stays on: ``llama_runs.py`` sets it for real), the tokens
are evaluated in one batch, and OUT gets one
``[T, V]`` float32 array per case. A model llama.cpp refuses gets no array; its load log's tail
is printed under the case name on stdout as JSON (``{"refused": {case: log}}``).

Optional JOBS fields: ``"quantize": [{"src", "dst", "ftype"}]`` has llama.cpp's quantizer
(``llama_model_quantize``, what ``llama-quantize`` runs; ``ftype`` a ``LLAMA_FTYPE_*`` number)
write each ``dst`` first, reported as ``"quantized"``; ``"ubatch": N`` evaluates in
micro-batches of N tokens (long sequences); ``"case_tokens": {case: [...]}`` gives a case its own
tokens instead of ``tokens``; ``"kv_type"`` (0 = F32, the default; 1 = F16) and ``"flash_attn"``
(default false): llama-perplexity's CPU defaults are F16 and true; ``"tokenize": {"model":
path, "text": str}`` has llama.cpp tokenize the text with that model's vocabulary as
``llama-perplexity`` does (``common_tokenize(..., add_special=true, parse_special=false)``:
BOS in front when the vocabulary adds it), reported as ``"tokenized"``.

Imports only numpy and llama_cpp: this venv does not have the project installed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import Llama

LOG_TAIL_CHARS = 2000
GGML_TYPE_F32 = 0  # the KV cache's default here: see the jobs' kv_type


def logits_of(
    path: str,
    tokens: list[int],
    *,
    kv_type: int,
    ubatch: int | None = None,
    flash_attn: bool = False,
) -> np.ndarray:
    """``[T, V]`` logits of ``tokens`` evaluated in one batch (or in micro-batches of ``ubatch``
    tokens through the KV cache), K and V cached as ``kv_type``, flash attention as asked."""
    batch = len(tokens) if ubatch is None else min(ubatch, len(tokens))
    llm = Llama(
        type_k=kv_type,
        type_v=kv_type,
        model_path=path,
        n_ctx=max(64, len(tokens)),
        n_batch=batch,
        n_ubatch=batch,
        logits_all=True,
        n_threads=1,
        n_threads_batch=1,
        flash_attn=flash_attn,
        verbose=False,
        use_extra_bufts=False,
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def load_log(path: str, tokens: list[int]) -> str:
    """What llama.cpp logs while refusing ``path`` (it writes to fd 2 from C)."""
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            Llama(model_path=path, n_ctx=64, verbose=True, use_extra_bufts=False)
        except (ValueError, RuntimeError):
            pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return log.read().decode(errors="replace")[-LOG_TAIL_CHARS:]


def tokenize(path: str, text: str) -> list[int]:
    """``text`` tokenized by ``path``'s vocabulary as llama-perplexity tokenizes its input."""
    llm = Llama(model_path=path, vocab_only=True, verbose=False, use_extra_bufts=False)
    try:
        return [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)]
    finally:
        llm.close()


def quantize(src: str, dst: str, ftype: int) -> None:
    """``dst``: ``src`` quantized by llama.cpp (its default parameters, one thread)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, ftype {ftype}) returned {status}")


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[1]).read_text())
    quantized = []
    for job in jobs.get("quantize", []):
        quantize(job["src"], job["dst"], int(job["ftype"]))
        quantized.append(job["dst"])
    tokens = [int(t) for t in jobs.get("tokens", [])]
    case_tokens = {c: [int(t) for t in ts] for c, ts in jobs.get("case_tokens", {}).items()}
    kv_type = int(jobs.get("kv_type", GGML_TYPE_F32))
    out: dict[str, np.ndarray] = {}
    refused: dict[str, str] = {}
    for case, path in jobs["models"].items():
        try:
            case_ubatch = jobs.get("ubatch")
            out[case] = logits_of(
                path,
                case_tokens.get(case, tokens),
                kv_type=kv_type,
                ubatch=case_ubatch,
                flash_attn=bool(jobs.get("flash_attn", False)),
            )
        except (ValueError, RuntimeError) as exc:
            refused[case] = f"{exc}\n{load_log(path, tokens)}"
    arrays: dict[str, Any] = {f"case{i}": out[c] for i, c in enumerate(out)}
    np.savez(argv[2], **arrays)
    report: dict[str, Any] = {
        "version": llama_cpp.__version__,
        "cases": list(out),
        "refused": refused,
        "quantized": quantized,
    }
    if "tokenize" in jobs:
        report["tokenized"] = tokenize(jobs["tokenize"]["model"], jobs["tokenize"]["text"])
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
