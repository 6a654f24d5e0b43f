"""Embedding the ggufswap runtime in your own PyTorch serving loop (runnable: python THIS_FILE).

It writes a tiny MoE model, loads it, serves batches, and applies a plan that swaps one expert
tensor to another quant type between two batches -- the same plan the agent would send.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ggufswap.ipc import Job, Plan
from ggufswap.runtime import HotSwapRuntime, PlanState
from ggufswap.runtime.models import HParams, Transformer
from ggufswap.shards import Layout, open_shard_set, requantize, tiny_moe, write_model


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="ggufswap-example-"))
    first = write_model(tiny_moe(), workdir, layout=Layout.PER_TENSOR)[0]

    # 1. Load the model's tensors into the runtime's store (pools, storage mode, allowed roots).
    runtime = HotSwapRuntime.open(first, allowed_roots=[str(workdir)])
    assert runtime.shards is not None

    # 2. Your model reads its weights from runtime.store at forward time (no private copies).
    model = Transformer(HParams.from_metadata(runtime.shards.metadata), runtime.store)

    # 3. Invalidate whatever you cache per weight version (CUDA graphs, KV caches of old weights).
    runtime.on_commit(lambda version, names: print(f"committed v{version}: {', '.join(names)}"))

    # 4. Something changes a tensor on disk; a plan names the new source of that tensor.
    name = "blk.1.ffn_down_exps.weight"
    requantize(Path(open_shard_set(first).tensors[name].path), name, GGMLQuantizationType.Q4_0)
    ticket = runtime.submit(Plan("example-1", "", (Job(open_shard_set(first).tensors[name]),)))

    # 5. The serving loop: one call between batches; staging happens in the background.
    batch = torch.arange(32).reshape(2, 16)
    for _ in range(1000):
        version = runtime.at_batch_boundary()
        with torch.inference_mode():
            logits = model(batch)  # every batch runs on exactly one weight version
        if ticket.state.final:
            break
        ticket.wait(timeout=0.01)
    print(
        f"plan {ticket.state.value}; last batch on weight_version {version}; "
        f"logits {tuple(logits.shape)}"
    )
    assert ticket.state is PlanState.COMMITTED
    runtime.close()


if __name__ == "__main__":
    main()
