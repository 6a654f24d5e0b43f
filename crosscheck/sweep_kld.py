"""Cross-check one sweep round against llama.cpp's logits on the same files and tokens.

``python crosscheck/sweep_kld.py --model M.gguf --out SWEEP_DIR --round KEY``: reads the sweep's
base file (its chunks of tokens) and the round's journal record, writes the model with the
round's tensors requantized as the sweep did (a single file, in a temp dir), evaluates every
chunk (BOS first, as llama-perplexity does) with llama.cpp through llama-cpp-python in the
cross-check venv (``crosscheck/llama_logits.py``; with the sweep's F16 KV cache as
llama-perplexity runs by default: F16 cache, flash attention on) for the original and the swapped
model, scores
the second half of each chunk with the same KLD code, and prints the sweep's figures beside
llama.cpp's with their relative difference. Needs ``make crosscheck``'s venv; not run by tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.perplexity import eval_batch, first_scored
from ggufswap.shards import requantize
from ggufswap.sweep.basefile import BaseLogProbs, encode_base_rows
from ggufswap.sweep.kld import KldStats
from ggufswap.sweep.results import JOURNAL

HERE = Path(__file__).resolve().parent
DEFAULT_LLAMA_PYTHON = HERE.parent / ".venv-crosscheck" / "bin" / "python"
FIGURES = (
    "ppl", "ppl_base", "ln_ppl_ratio", "kld_mean", "kld_median", "kld_p99", "kld_max", "dp_rms",
    "same_top",
)  # fmt: skip


# llama.cpp's settings for the sweep's KV cache (protocol.json's kv_cache): llama-perplexity's
# CPU defaults (F16 cache, flash attention auto, which is on) or an F32 cache without it.
LLAMA_SETTINGS = {"f16": {"kv_type": 1, "flash_attn": True}, "f32": {"kv_type": 0}}


def llama_logits(
    python: Path, tokens: list[int], models: dict[str, str], tmp: Path, kv_cache: str
) -> dict:
    jobs = tmp / "jobs.json"
    settings = LLAMA_SETTINGS[kv_cache]
    jobs.write_text(json.dumps({"tokens": tokens, "models": models, **settings}))
    out = tmp / "logits.npz"
    run = subprocess.run(
        [str(python), str(HERE / "llama_logits.py"), str(jobs), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(run.stdout.splitlines()[-1])
    if report["refused"]:
        raise SystemExit(f"llama.cpp refused: {report['refused']}")
    arrays = np.load(out)
    return {case: arrays[f"case{i}"] for i, case in enumerate(report["cases"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, type=Path, help="the swept model, one file")
    parser.add_argument("--out", required=True, type=Path, help="the sweep's --out directory")
    parser.add_argument(
        "--round", required=True, help="a journal key, e.g. blk.3.attn_q.weight@q4_0"
    )
    parser.add_argument("--llama-python", type=Path, default=DEFAULT_LLAMA_PYTHON)
    args = parser.parse_args()
    records = [json.loads(line) for line in (args.out / JOURNAL).read_text().splitlines()]
    record = next(r for r in records if r["key"] == args.round)
    base = BaseLogProbs(args.out / "baseline.logits")
    protocol = json.loads((args.out / "protocol.json").read_text())
    kv_cache = protocol.get("kv_cache", "f32")
    tokenizer = GgufTokenizer.from_file(args.model)
    bos = tokenizer.bos_id if tokenizer.vocab.add_bos else None
    batch = eval_batch(base.tokens, bos)  # [C, n_ctx]
    first, n_ctx = first_scored(base.n_ctx), base.n_ctx
    stats = KldStats()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        swapped = tmp / "swapped.gguf"
        source = args.model
        for name in record["tensors"]:
            requantize(source, name, record["qtype"], out=swapped)
            source = swapped
        for c in range(base.n_chunk):
            logits = llama_logits(
                args.llama_python,
                batch[c].tolist(),
                {"base": str(args.model), "swapped": str(swapped)},
                tmp,
                kv_cache,
            )
            targets = base.targets(c)
            rows, _ = encode_base_rows(torch.from_numpy(logits["base"][first : n_ctx - 1]), targets)
            stats.add(torch.from_numpy(logits["swapped"][first : n_ctx - 1]), rows, targets)
    theirs = stats.result().as_metrics()
    ours = record["metrics"]
    print(
        f"round {record['key']} ({base.n_chunk} chunks of {n_ctx}, {theirs['count']} scored; "
        f"{protocol.get('products')}, KV cache {kv_cache}; llama.cpp: {LLAMA_SETTINGS[kv_cache]})"
    )
    print(f"{'figure':<14}{'ggufswap':>14}{'llama.cpp':>14}{'rel. diff':>12}")
    for key in FIGURES:
        a, b = float(ours[key]), float(theirs[key])
        rel = abs(a - b) / abs(b) if b else float("nan")
        print(f"{key:<14}{a:>14.6f}{b:>14.6f}{100 * rel:>11.2f}%")
    print(f"kld_mean unc  {ours['kld_unc']:>14.6f}{theirs['kld_unc']:>14.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
