"""Where ggufswap's ``ggml`` forward and llama.cpp's part, layer by layer, on the real Gemma 3.

``python crosscheck/layer_step.py --model M.gguf --text T [--chunk 0]``: llama.cpp
(``llama_runs.py`` in the cross-check venv: one thread, F32 KV cache, flash attention off) dumps
every layer's output (``l_out-N``, through the context's eval callback) for one chunk, twice:
with its weight repacking off (the kernels ggufswap's glue calls) and on (its default). Then
ggufswap's decoder, numerics ``ggml`` with an F32 KV cache and the libggml of ``$GGUFSWAP_GGML``
(set it to mainline's ``libggml-cpu.so`` to compare like with like), computes:

- **one step**: each block fed llama.cpp's own input to that block (its ``l_out`` of the layer
  before), its output against llama.cpp's: what one layer adds, free of the layers before;
- **the whole forward**: its own layer outputs against llama.cpp's (repacking off);
- beside them llama.cpp against itself: repacking on against off.

Printed per layer: the relative L2 difference of the whole ``[T, D]`` output and the median over
rows of the largest relative difference in a row. A systematic difference in one operation
shows in the one-step column; chaotic growth of rounding flips shows in the forward columns, for
both implementations alike. docs/sweep.md records what it printed. Not run by tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ggufswap.config import Storage
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.kernels import ggml_describe
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.models.blocks.decoder import embed
from ggufswap.runtime.models.ggml_numerics import ggml_norms, kv_cache_type
from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.perplexity import text_tokens
from ggufswap.shards.ggml_types import GGMLType

HERE = Path(__file__).resolve().parent
DEFAULT_LLAMA_PYTHON = HERE.parent / ".venv-crosscheck" / "bin" / "python"


def dumps(python: Path, model: Path, tokens: list[int], names: list[str]) -> dict[str, Any]:
    """llama.cpp's dumped tensors, repacking off (``norep``) and on (``rep``)."""
    runs = [
        {"name": name, "path": str(model), "chunk": 0, "extra_bufts": on, "dump": names}
        for name, on in (("norep", False), ("rep", True))
    ]
    with tempfile.TemporaryDirectory() as tmp:
        jobs, out = Path(tmp) / "jobs.json", Path(tmp) / "out.npz"
        jobs.write_text(json.dumps({"tokens": [tokens], "runs": runs}))
        subprocess.run(
            [str(python), str(HERE / "llama_runs.py"), str(jobs), str(out)],
            check=True,
            capture_output=True,
        )
        with np.load(out) as arrays:
            return {k: arrays[k] for k in arrays.files}


def rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Relative L2 difference, and the median over rows of the row's max relative difference."""
    a, b = a.double(), b.double()
    rows = (a - b).abs().amax(-1) / b.abs().amax(-1)
    return float((a - b).norm() / b.norm()), float(rows.median())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--text", required=True, type=Path)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--llama-python", type=Path, default=DEFAULT_LLAMA_PYTHON)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids, bos = text_tokens(GgufTokenizer.from_file(args.model), args.text.read_text())
    n = args.ctx
    chunk = ids[args.chunk * n : (args.chunk + 1) * n]
    tokens = [bos, *chunk[1:]] if bos is not None else chunk
    runtime = HotSwapRuntime.open(args.model, storage=Storage.NATIVE)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        hp = HParams.from_metadata(runtime.shards.metadata)
        names = ["inp_scaled"] + [f"l_out-{i}" for i in range(hp.n_layer)]
        ref = dumps(args.llama_python, args.model, tokens, names)
        print(f"ggufswap's products: {ggml_describe()}")
        model = build_model(hp, runtime.store, store=runtime.store, numerics="ggml")

        def theirs(name: str, run: str = "norep") -> torch.Tensor:
            return torch.from_numpy(ref[f"{run}::{name}"].reshape(1, n, -1))

        with torch.inference_mode(), ggml_norms(), kv_cache_type(GGMLType.F32):
            t = torch.tensor([tokens])
            x = embed(t, model.weights, model.tok_embd, hp.embed_scale)
            print(f"embedding bit-equal: {torch.equal(x, theirs('inp_scaled'))}")
            inputs = model.layer_inputs(0, n, t.device, cached=False)
            print("layer  one step (L2, row median)    forward vs norep   llama rep vs norep")
            layers = zip(model.layers, inputs, strict=True)
            for layer, (block, (rope, mask)) in enumerate(layers):
                before = theirs("inp_scaled" if layer == 0 else f"l_out-{layer - 1}")
                step = rel(block(before, rope, mask, None), theirs(f"l_out-{layer}"))
                x = block(x, rope, mask, None)
                full = rel(x, theirs(f"l_out-{layer}"))[0]
                own = rel(theirs(f"l_out-{layer}", "rep"), theirs(f"l_out-{layer}"))[0]
                print(f"{layer:5d}  {step[0]:.2e} {step[1]:.2e}{full:19.2e}{own:21.2e}")
    finally:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
