"""How a round's figures agree between ggufswap and llama.cpp / ik_llama.cpp, with paired errors.

``python crosscheck/agree_study.py --model M.gguf --tensor blk.5.attn_v.weight --qtype q4_0
--text T --chunks 16 --work DIR [--engines a,b,...]``: tokenizes T as the sweep does
(``perplexity.text_tokens``: llama-perplexity's tokens, BOS first), cuts ``--chunks`` chunks of
``--ctx``, writes the model with the tensor requantized (``shards.requantize``, as the sweep
makes a round's tensor), and has each engine (``engine_figures.py``, one process each, at most
two at a time) compute every scored position's KLD, NLLs and top-1 agreement on the same files
and tokens. It prints, per engine, PPL base / after, mean KLD ± standard error, median KLD and
same-top, and against a reference engine the paired differences: the mean KLD's relative
difference ± the standard error of the per-position differences (the same positions: what
remains is the two computations' rounding, not the text), and the PPLs' relative differences ±
the standard error of the per-position NLL differences. Each engine's figures are kept in
``--work`` (rerun with other ``--engines`` to add some). Not run by tests.

Engines (``name``: what runs):

- ``llama``: llama.cpp as ``crosscheck/llama_logits.py`` runs it (F32 KV cache, flash attention
  off, weight repacking on); ``llama-norepack``: the same, repacking off (the kernels ggufswap's
  glue calls); ``llama-perplexity``: llama-perplexity's CPU defaults (F16 KV cache, flash
  attention on, repacking on);
- ``ik``: ik_llama.cpp (the ``ik-llama-cpp-python`` wheel; F32 K cache, F16 V, no flash
  attention, as ``ik_logits.py``);
- ``ggufswap-mainline``, ``ggufswap-ik``, ``ggufswap-emulated``: the sweep's decoder with
  ``--numerics ggml`` on mainline's libggml (llama-cpp-python's), ik_llama.cpp's, or none, its
  keys and values unrounded (the F32 cache of ``llama``); ``ggufswap-mainline-f16kv``: mainline's,
  keys and values rounded to F16 (llama-perplexity's cache; compared with ``llama-perplexity``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.perplexity import text_tokens
from ggufswap.shards import requantize

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SITE = "lib/python3.11/site-packages"
MAINLINE_LIB = ROOT / ".venv-crosscheck" / SITE / "llama_cpp/lib/libggml-cpu.so"
IK_LIB = ROOT / ".venv-ik" / SITE / "ik_llama_cpp/lib/libggml.so"
PY = {
    "llama": ROOT / ".venv-crosscheck/bin/python",
    "ik": ROOT / ".venv-ik/bin/python",
    "ggufswap": Path(sys.executable),
}
ENGINES: dict[str, tuple[str, dict, dict[str, str]]] = {  # name: (engine, options, env)
    "llama": ("llama", {"kv_type": 0}, {}),
    "llama-norepack": ("llama", {"kv_type": 0, "extra_bufts": False}, {}),
    "llama-perplexity": ("llama", {"kv_type": 1, "flash_attn": True}, {}),
    "ik": ("ik", {}, {}),
    "ggufswap-mainline": ("ggufswap", {}, {"GGUFSWAP_GGML": str(MAINLINE_LIB)}),
    "ggufswap-ik": ("ggufswap", {}, {"GGUFSWAP_GGML": str(IK_LIB)}),
    "ggufswap-emulated": ("ggufswap", {}, {"GGUFSWAP_GGML": "off"}),
    "ggufswap-mainline-f16kv": ("ggufswap", {"kv": "f16"}, {"GGUFSWAP_GGML": str(MAINLINE_LIB)}),
}
REFERENCE = {"ggufswap-ik": "ik", "ggufswap-mainline-f16kv": "llama-perplexity"}  # else llama


def start(name: str, jobs: dict, work: Path) -> subprocess.Popen:
    engine, options, env = ENGINES[name]
    path = work / f"{name}.json"
    path.write_text(json.dumps({**jobs, "engine": engine, "options": options}))
    log = (work / f"{name}.log").open("w")
    return subprocess.Popen(
        [str(PY[engine]), str(HERE / "engine_figures.py"), str(path), str(work / f"{name}.npz")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
    )


def run_all(names: list[str], jobs: dict, work: Path) -> None:
    """Each engine not yet in ``work``, two at a time."""
    todo = [n for n in names if not (work / f"{n}.npz").exists()]
    running: list[tuple[str, subprocess.Popen]] = []
    while todo or running:
        while todo and len(running) < 2:
            name = todo.pop(0)
            running.append((name, start(name, jobs, work)))
        name, proc = running.pop(0)
        if proc.wait() != 0:
            raise SystemExit(f"{name} failed: see {work / (name + '.log')}")


def ppl(nll: np.ndarray) -> float:
    return float(np.exp(nll.mean()))


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """``mean(a) / mean(b) - 1`` and the standard error of that from the paired differences."""
    d = a - b
    return float(d.mean() / b.mean()), float(d.std(ddof=1) / np.sqrt(len(d)) / b.mean())


def report(names: list[str], work: Path) -> None:
    figs = {n: dict(np.load(work / f"{n}.npz")) for n in names if (work / f"{n}.npz").exists()}
    print(f"{'engine':20s}{'PPL base':>10s}{'PPL after':>10s}{'mean KLD ± SE':>22s}"
          f"{'median':>10s}{'same top':>9s}   vs ref: base PPL, after PPL, mean KLD")  # fmt: skip
    for name, f in figs.items():
        k, n = f["kld"], len(f["kld"])
        line = (
            f"{name:20s}{ppl(f['nll_base']):10.4f}{ppl(f['nll_swap']):10.4f}"
            f"{k.mean():12.6f} ± {k.std(ddof=1) / np.sqrt(n):.6f}{np.median(k):10.6f}"
            f"{100 * f['same_top'].mean():8.2f}%"
        )
        ref = REFERENCE.get(name, "llama")
        if ref in figs and ref != name:
            r = figs[ref]
            parts = []
            for key in ("nll_base", "nll_swap"):
                d = f[key] - r[key]
                se = d.std(ddof=1) / np.sqrt(n)
                parts.append(f"{100 * np.expm1(d.mean()):+.2f}±{100 * se:.2f}%")
            rel, se = paired(k, r["kld"])
            parts.append(f"{100 * rel:+.1f}±{100 * se:.1f}% ({ref})")
            line += "   " + ", ".join(parts)
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--tensor", required=True)
    parser.add_argument("--qtype", required=True)
    parser.add_argument("--text", required=True, type=Path)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--engines", default=",".join(ENGINES))
    args = parser.parse_args()
    names = args.engines.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    tokens, bos = text_tokens(GgufTokenizer.from_file(args.model), args.text.read_text())
    n = args.ctx
    if len(tokens) < args.chunks * n:
        raise SystemExit(f"{args.text}: {len(tokens)} tokens, fewer than {args.chunks} x {n}")
    chunks = [tokens[c * n : (c + 1) * n] for c in range(args.chunks)]
    if bos is not None:
        chunks = [[bos, *c[1:]] for c in chunks]
    swapped = args.work / "swapped.gguf"
    if not swapped.exists():
        requantize(args.model, args.tensor, args.qtype, out=swapped)
    jobs = {"base": str(args.model), "swapped": str(swapped), "chunks": chunks, "n_ctx": n}
    run_all(names, jobs, args.work)
    print(f"{args.tensor} -> {args.qtype}, {args.text.name}, {args.chunks} x {n}")
    report(names, args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
