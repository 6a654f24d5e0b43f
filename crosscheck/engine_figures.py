"""One sweep round's per-position figures under one engine; runs in whichever venv has it.

``python engine_figures.py JOBS.json OUT.npz``: JOBS is ``{"engine", "options", "base",
"swapped", "chunks": [[tokens]], "n_ctx"}``. Each chunk (BOS first, as the sweep evaluates it) is
evaluated alone, in one batch on one thread, on the base and the swapped file, and the second
half of the chunk scored as llama-perplexity scores it (logits at ``n_ctx/2 .. n_ctx-2`` against
the next tokens). OUT gets, per scored position, ``kld`` (``sum p (ln p - ln q)`` in float64, p
the base's), ``nll_base``, ``nll_swap`` and ``same_top`` (argmax equal).

Engines (``agree_study.py`` drives them, each in its own process, so one libggml a process):

- ``llama``: llama.cpp through llama-cpp-python (the cross-check venv). Options: ``kv_type``
  (GGML type of the K and V cache, 0 = F32, 1 = F16), ``flash_attn``, ``extra_bufts`` (weight
  repacking; llama-cpp-python's ``Llama`` does not pass it, so it is set on the default
  parameters, as ``llama_runs.py`` does);
- ``ik``: ik_llama.cpp through the ``ik-llama-cpp-python`` wheel (``.venv-ik``), as
  ``ik_logits.py`` runs it (F32 K cache, F16 V, flash attention off);
- ``ggufswap``: the project's decoder with ``--numerics ggml`` (the project's venv), its libggml
  chosen by the parent's ``GGUFSWAP_GGML``. Option ``kv``: ``f32`` (default here: keys and values
  unrounded, as the ``llama`` engine's F32 cache) or ``f16`` (llama-perplexity's cache).

Imports numpy and the engine's package only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Logits = Callable[[str, list[int]], np.ndarray]  # (path, tokens) -> [T, V] float32


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def chunk_figures(base: np.ndarray, swap: np.ndarray, tokens: list[int]) -> dict[str, np.ndarray]:
    """The scored positions' figures of one chunk's ``[n_ctx, V]`` logits."""
    n_ctx = len(tokens)
    first = n_ctx // 2
    targets = np.array(tokens[first + 1 :])
    p, q = log_softmax(base[first : n_ctx - 1]), log_softmax(swap[first : n_ctx - 1])
    rows = np.arange(len(targets))
    return {
        "kld": (np.exp(p) * (p - q)).sum(-1),
        "nll_base": -p[rows, targets],
        "nll_swap": -q[rows, targets],
        "same_top": (p.argmax(-1) == q.argmax(-1)).astype(np.float64),
    }


def llama_engine(options: dict[str, Any]) -> Logits:
    import llama_cpp.llama_cpp as capi
    from llama_cpp import Llama

    def logits(path: str, tokens: list[int]) -> np.ndarray:
        defaults = capi.llama_model_default_params

        def model_params() -> Any:
            params = defaults()
            params.use_extra_bufts = bool(options.get("extra_bufts", True))
            return params

        capi.llama_model_default_params = model_params
        try:
            kv = int(options.get("kv_type", 0))
            llm = Llama(
                model_path=path,
                type_k=kv,
                type_v=kv,
                n_ctx=max(64, len(tokens)),
                n_batch=len(tokens),
                n_ubatch=len(tokens),
                logits_all=True,
                n_threads=1,
                n_threads_batch=1,
                flash_attn=bool(options.get("flash_attn", False)),
                verbose=False,
            )
        finally:
            capi.llama_model_default_params = defaults
        try:
            llm.eval(tokens)
            return np.array(llm.scores[: len(tokens)], dtype=np.float32)
        finally:
            llm.close()

    return logits


def ik_engine(options: dict[str, Any]) -> Logits:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ik_logits
    from ik_llama_cpp import _ctypes_api as C  # noqa: N812 (the wheel's own name for it)

    C.llama_backend_init()
    flash = bool(options.get("flash_attn", False))
    return lambda path, tokens: ik_logits.logits_of(path, tokens, flash_attn=flash)


def ggufswap_engine(options: dict[str, Any]) -> Logits:
    import torch

    from ggufswap.config import Storage
    from ggufswap.runtime import HotSwapRuntime
    from ggufswap.runtime.models import HParams, build_model
    from ggufswap.runtime.models.ggml_numerics import kv_cache_type
    from ggufswap.shards.ggml_types import GGMLType

    torch.set_num_threads(1)
    kv = GGMLType.F16 if options.get("kv", "f32") == "f16" else GGMLType.F32
    models: dict[str, Any] = {}

    def logits(path: str, tokens: list[int]) -> np.ndarray:
        if path not in models:
            runtime = HotSwapRuntime.open(Path(path), storage=Storage.NATIVE)
            assert runtime.shards is not None, "open() keeps the shard set"
            hp = HParams.from_metadata(runtime.shards.metadata)
            numerics = options.get("numerics", "ggml")
            models[path] = (runtime, build_model(hp, runtime.store, store=runtime.store,
                                                 numerics=numerics))  # fmt: skip
        with torch.inference_mode(), kv_cache_type(kv):
            out: np.ndarray = models[path][1](torch.tensor([tokens]))[0].numpy()
            return out

    return logits


ENGINES: dict[str, Callable[[dict[str, Any]], Logits]] = {
    "llama": llama_engine,
    "ik": ik_engine,
    "ggufswap": ggufswap_engine,
}


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[1]).read_text())
    logits = ENGINES[jobs["engine"]](jobs.get("options", {}))
    parts: dict[str, list[np.ndarray]] = {}
    for tokens in jobs["chunks"]:
        base, swapped = logits(jobs["base"], tokens), logits(jobs["swapped"], tokens)
        figures = chunk_figures(base, swapped, tokens)
        for key, value in figures.items():
            parts.setdefault(key, []).append(value)
        print(f"chunk done: mean KLD {figures['kld'].mean():.6f}", flush=True)
        partial = {key: np.concatenate(values) for key, values in parts.items()}
        np.savez(argv[2] + ".partial.npz", **partial)  # the chunks so far, should it be stopped
    np.savez(argv[2], **{key: np.concatenate(values) for key, values in parts.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
