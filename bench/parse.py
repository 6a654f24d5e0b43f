"""Header-parse benchmark: ``read_header`` against ``gguf.GGUFReader`` on the same file.

The model has a 256,000-entry tokenizer vocabulary (as large vocabularies such as Gemma's are) and
over a thousand tensors, so both the metadata walk and the tensor table matter. Both readers run
in the same process on the same file; the figure is their ratio, never an absolute time.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from ggufswap.shards import Keys, read_header
from ggufswap.shards.writer import Arch, ModelSpec, write_model

TARGET_RATIO = 100.0
VOCAB = 256_000


def bench_spec() -> ModelSpec:
    """A qwen3moe with 84 small blocks (12 tensors each: 1,011 in all) and a 256k vocabulary."""
    n_vocab = 256
    return ModelSpec(
        arch=Arch.QWEN3MOE,
        name="parse-bench",
        n_layers=84,
        n_embd=32,
        n_head=2,
        n_head_kv=1,
        n_ff=32,
        n_vocab=n_vocab,
        n_expert=2,
        n_expert_used=1,
        n_ff_expert=32,
        extra_vocab_strings=VOCAB - n_vocab,
    )


def best_of(n: int, fn: Callable[[], Any]) -> float:
    """The fastest of ``n`` timed calls (garbage collection off while timing)."""
    times = []
    for _ in range(n):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return min(times)


def run(quick: bool) -> list[dict[str, Any]]:
    """Time both readers on one generated file; one row per comparison."""
    with tempfile.TemporaryDirectory(prefix="ggufswap-bench-parse-") as tmp:
        (path,) = write_model(bench_spec(), Path(tmp))
        header = read_header(path)  # warm the page cache and check the file
        n_tensors = len(header.tensors)
        vocab = header.metadata[Keys.Tokenizer.TOKENS]
        assert n_tensors >= 1000, n_tensors
        assert getattr(vocab, "count", 0) == VOCAB, vocab
        ours = best_of(3 if quick else 5, lambda: read_header(path))
        baseline = best_of(1 if quick else 2, lambda: GGUFReader(path, "r"))
        size = path.stat().st_size
    return [
        {
            "name": f"read_header vs GGUFReader ({VOCAB:,} tokens, {n_tensors} tensors, "
            f"{size / 2**20:.1f} MiB)",
            "baseline_s": baseline,
            "ours_s": ours,
            "ratio": baseline / ours,
            "target": TARGET_RATIO,
        }
    ]


def print_rows(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        verdict = "ok" if row["ratio"] >= row["target"] else "BELOW TARGET"
        print(row["name"])
        print(f"  GGUFReader   {row['baseline_s'] * 1e3:10.2f} ms")
        print(f"  read_header  {row['ours_s'] * 1e3:10.2f} ms")
        print(f"  ratio        {row['ratio']:10.1f}x  (target >= {row['target']:.0f}x: {verdict})")


if __name__ == "__main__":
    print_rows(run(quick="--quick" in sys.argv[1:]))
