"""How close a round's KLD and PPL in ``--numerics ggml`` come to llama.cpp's (docs/sweep.md).

``python crosscheck/kld_study.py --model M.gguf --tensor blk.5.attn_v.weight --qtype q4_0
[--chunks 4] [--configs default,norepack,flash]``: tokenizes Python's ``LICENSE.txt`` with
llama.cpp as llama-perplexity does, cuts chunks of ``--ctx`` tokens (first token BOS), writes
the model with the tensor requantized by ``ggufswap.shards.requantize``, has llama.cpp
(``llama_runs.py`` in the cross-check venv: one thread, F32 KV cache) compute every chunk's
logits for the base and swapped files under each kernel configuration (``default``: weight
repacking on, flash attention off; ``norepack``; ``flash``), computes the same with the project's
decoder in ``ggml`` numerics, and prints mean KLD (± standard error) and PPL of the second half
of every chunk, each against llama.cpp's default. Not run by tests (needs the cross-check venv).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

from ggufswap.config import Storage
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.models.ggml_numerics import kv_cache_type
from ggufswap.shards import requantize
from ggufswap.shards.ggml_types import GGMLType

HERE = Path(__file__).resolve().parent
DEFAULT_LLAMA_PYTHON = HERE.parent / ".venv-crosscheck" / "bin" / "python"
CONFIGS = {
    "default": {},
    "norepack": {"extra_bufts": False},
    "flash": {"flash_attn": True},
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def llama(python: Path, jobs: dict, tmp: Path) -> tuple[dict[str, np.ndarray], str]:
    path, out = tmp / "jobs.json", tmp / "out.npz"
    path.write_text(json.dumps(jobs))
    done = subprocess.run(
        [str(python), str(HERE / "llama_runs.py"), str(path), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    with np.load(out) as arrays:
        return {k: arrays[k] for k in arrays.files}, done.stdout


def ours(path: Path, chunks: list[list[int]]) -> list[np.ndarray]:
    runtime = HotSwapRuntime.open(path, storage=Storage.NATIVE)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        hp = HParams.from_metadata(runtime.shards.metadata)
        model = build_model(hp, runtime.store, store=runtime.store, numerics="ggml")
        with torch.inference_mode(), kv_cache_type(GGMLType.F32):  # llama_runs.py's F32 cache
            return [model(torch.tensor([c], dtype=torch.int64))[0].numpy() for c in chunks]
    finally:
        runtime.close()


def figures(
    base: list[np.ndarray], swapped: list[np.ndarray], targets: list[np.ndarray], n_ctx: int
) -> tuple[float, float, float]:
    """Mean KLD, its standard error and PPL over the scored positions of every chunk."""
    first = n_ctx // 2
    kld, nll = [], []
    for b, s, t in zip(base, swapped, targets, strict=True):
        p, q = log_softmax(b[first : n_ctx - 1]), log_softmax(s[first : n_ctx - 1])
        kld.append((np.exp(p) * (p - q)).sum(-1))
        nll.append(-q[np.arange(len(t)), t])
    k, n = np.concatenate(kld), np.concatenate(nll)
    return float(k.mean()), float(k.std() / np.sqrt(len(k))), float(np.exp(n.mean()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--tensor", required=True)
    parser.add_argument("--qtype", required=True)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--configs", default="default")
    parser.add_argument("--llama-python", type=Path, default=DEFAULT_LLAMA_PYTHON)
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = (Path(sysconfig.get_path("stdlib")) / "LICENSE.txt").read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        _, said = llama(
            args.llama_python, {"tokenize": {"model": str(args.model), "text": text}}, tmp
        )
        said_json = json.loads(said.splitlines()[-1])
        ids, bos, n = said_json["tokenized"], said_json["bos"], args.ctx
        chunks, targets = [], []
        for c in range(min(args.chunks, len(ids) // n)):
            chunk = ids[c * n : (c + 1) * n]
            targets.append(np.array(chunk[n // 2 + 1 :]))
            chunks.append([bos, *chunk[1:]])
        swapped = tmp / "swapped.gguf"
        requantize(args.model, args.tensor, args.qtype, out=swapped)
        models = {"base": args.model, "swapped": swapped}
        runs = [
            {"name": f"{m}/{cfg}/{c}", "path": str(p), "chunk": c, **CONFIGS[cfg]}
            for cfg in args.configs.split(",")
            for m, p in models.items()
            for c in range(len(chunks))
        ]
        logits, _ = llama(args.llama_python, {"tokens": chunks, "runs": runs}, tmp)
        rows = {}
        for cfg in args.configs.split(","):
            base = [logits[f"base/{cfg}/{c}"] for c in range(len(chunks))]
            swap = [logits[f"swapped/{cfg}/{c}"] for c in range(len(chunks))]
            rows[f"llama.cpp {cfg}"] = (
                *figures(base, swap, targets, n),
                figures(base, base, targets, n)[2],
            )
        base, swap = ours(args.model, chunks), ours(swapped, chunks)
        rows["ggufswap ggml"] = (
            *figures(base, swap, targets, n),
            figures(base, base, targets, n)[2],
        )
    ref = rows[next(iter(rows))]
    print(
        f"{args.tensor} -> {args.qtype}: {len(chunks)} chunks of {n}, "
        f"{len(chunks) * (n - 1 - n // 2)} scored"
    )
    for name, (kld, se, ppl, ppl_base) in rows.items():
        print(
            f"{name:20s} mean KLD {kld:.6f} ± {se:.6f} ({100 * (kld / ref[0] - 1):+.1f} %)  "
            f"PPL {ppl:.4f} ({100 * (ppl / ref[2] - 1):+.2f} %)  PPL(base) {ppl_base:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
