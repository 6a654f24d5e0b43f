"""Why Q4_1 MoE models stood out against llama.cpp (issue 18): the measurements in docs/models.md.

``python crosscheck/q4_1_study.py --llama-python PY`` (the project's venv; PY has llama-cpp-python).
For a few cross-check cases it prints:

- ``dequant``: the largest difference between the tensor store's Q4_1 weights and gguf-py's
  ``dequantize`` of the same bytes (0 means the project decodes Q4_1 exactly as the reference
  decoder does);
- ``KLD exact``: the project's decoder (float activations) against llama.cpp;
- ``KLD -sums``: the decoder with ggml's activation rounding emulated, but not the F16 rounding of
  Q8_1's block sums that only Q4_1/Q5_1 dot products use;
- ``KLD emulated``: with all of ggml's rounding emulated (``emulate.py``);
- ``flips``: routing decisions (block x position) whose expert set differs between the exact and
  the emulated decoder, of all decisions, with the smallest router-probability margin (k-th minus
  (k+1)-th) among the flipped ones.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xcheck
from emulate import Routing, emulating, flips, recording
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from run import llama_cpp_logits

from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models import HParams, build_model

Q = GGMLQuantizationType
CASES = (
    "tiny-dense/Q4_1",
    "tiny-moe/Q4_0",
    "tiny-moe/Q4_1",
    "tiny-moe/Q8_0",
    "qwen3moe-tied/Q4_1",
    "llama-moe/Q4_1",
    "qwen2moe-shexp/Q4_1",
    "demo-moe/Q4_1",
    "demo-moe-llama/Q4_1",
)


def forward(path: Path, *, mode: str) -> tuple[np.ndarray, Routing, float]:
    """Logits, routing and (for Q4_1 tensors) the largest dequantization difference."""
    runtime = HotSwapRuntime.open(path)
    routing: Routing = []
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(
            HParams.from_metadata(runtime.shards.metadata), runtime.store, store=runtime.store
        )
        worst = 0.0
        for t in GGUFReader(path).tensors:
            if t.tensor_type == Q.Q4_1:
                ref = dequantize(t.data, Q.Q4_1).astype(np.float32)
                ours = runtime.store.weight(t.name).numpy().reshape(ref.shape)
                worst = max(worst, float(np.abs(ours - ref).max()))
        tokens = torch.tensor([xcheck.TOKENS])
        with torch.inference_mode(), recording(routing):
            if mode == "exact":
                out = model(tokens)
            else:
                with emulating(runtime, path, q8_1_sums=mode == "emulated"):
                    out = model(tokens)
        return out[0].numpy(), routing, worst
    finally:
        runtime.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    specs = xcheck.all_cases()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ggufswap-q4_1-") as tmp_name:
        tmp = Path(tmp_name)
        paths = {c: xcheck.write_case(specs[c], tmp / c.replace("/", "-"))[0] for c in CASES}
        reference, _ = llama_cpp_logits(args.llama_python, paths, tmp)
        for case in CASES:
            ref = reference[case]
            exact, routing_exact, worst = forward(paths[case], mode="exact")
            no_sums, _, _ = forward(paths[case], mode="no-sums")
            emulated, routing_emulated, _ = forward(paths[case], mode="emulated")
            changed, total, margin = flips(routing_exact, routing_emulated)
            rows.append(
                {
                    "case": case,
                    "dequant": worst,
                    "exact": xcheck.compare(ref, exact),
                    "no_sums": xcheck.compare(ref, no_sums).mean_kld,
                    "emulated": xcheck.compare(ref, emulated).mean_kld,
                    "flips": f"{changed}/{total}" if total else "-",
                    "margin": margin,
                }
            )
    print(
        "| case | dequant vs gguf-py | KLD exact (top-1) | KLD -sums | KLD emulated "
        "| routing flips | smallest flipped margin |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        f = r["exact"]
        shown = "-" if r["margin"] == float("inf") else f"{r['margin']:.1e}"
        print(
            f"| {r['case']} | {r['dequant']:.0e} | {f.mean_kld:.1e} ({f.top1:.0%}) | "
            f"{r['no_sums']:.1e} | {r['emulated']:.1e} | {r['flips']} | {shown} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
