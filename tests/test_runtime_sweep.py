"""A per-block quantization sweep driven through the eval loop: every swap changes perplexity,
every restore gives exactly the baseline perplexity, and a byte-identical file changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from runtime_helpers import WAIT_S, ModelDir, Q, one_thread, open_runtime

from ggufswap.ipc.plan import Plan
from ggufswap.runtime import HotSwapRuntime, PlanState, Storage
from ggufswap.runtime.serving import evaluate_batches, make_eval_tokens
from ggufswap.runtime.serving.perplexity import perplexity, token_windows

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

N_BLOCKS = 4
CTX, BATCH = 32, 4


def down(block: int) -> str:
    return f"blk.{block}.ffn_down_exps.weight"


def committing(runtime: HotSwapRuntime, plan: Plan) -> int:
    """What a sweep script does between two batches: submit, wait until staged, commit."""
    ticket = runtime.submit(plan)
    assert runtime.wait_staged(timeout=WAIT_S), ticket.summary()
    version = runtime.at_batch_boundary()
    assert ticket.state is PlanState.COMMITTED, ticket.summary()
    return version


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_sweep_restores_baseline_perplexity_exactly(tmp_path: Path, storage: Storage) -> None:
    """Swapping each block's ffn_down_exps to Q4_0 changes perplexity; restoring it gives the
    baseline perplexity exactly (==), recorded per weight version by evaluate_batches."""
    model_dir = ModelDir.write(tmp_path / "model")
    saved = {b: model_dir.save(down(b), tmp_path / "saved") for b in range(N_BLOCKS)}
    low = {b: model_dir.variant(down(b), Q.Q4_0, tmp_path / "variants") for b in range(N_BLOCKS)}
    runtime, model = open_runtime(model_dir.first, storage=storage)
    tokens = make_eval_tokens(256, CTX * BATCH * 2, seed=3)
    batches = token_windows(tokens, ctx=CTX, batch_size=BATCH)
    # Phase 0 is the baseline; then (swap block b, restore block b) for every block.
    phases: list[tuple[str, int]] = [("baseline", -1)]
    for b in range(N_BLOCKS):
        phases += [("swap", b), ("restore", b)]
    versions: list[int] = []
    step = 0

    def between_batches() -> int:
        nonlocal step
        phase, offset = divmod(step, len(batches))
        step += 1
        if offset == 0 and phase > 0:
            kind, block = phases[phase]
            model_dir.put(down(block), low[block] if kind == "swap" else saved[block])
            versions.append(committing(runtime, model_dir.plan(f"{kind}-{block}", [down(block)])))
            return versions[-1]
        version = runtime.at_batch_boundary()
        if offset == 0:
            versions.append(version)
        return version

    try:
        per_version = evaluate_batches(
            model, [b for _ in phases for b in batches], between_batches=between_batches
        )
        assert versions == list(range(len(phases)))
        ppl = {v: stats.perplexity for v, stats in per_version.items()}
        assert per_version[0].n_batches == len(batches)
        baseline = ppl[0]
        assert baseline == perplexity(model, tokens, ctx=CTX, batch_size=BATCH)
        for phase, (kind, block) in enumerate(phases[1:], start=1):
            if kind == "swap":
                assert ppl[phase] != baseline, f"block {block}: Q4_0 changed nothing"
            else:
                assert ppl[phase] == baseline, f"block {block}: restore is not exact"

        # The sanity slot: block 0's shard re-written byte for byte (a new inode).
        model_dir.put(down(0), saved[0])
        before = runtime.weight_version
        sanity = evaluate_batches(
            model,
            batches,
            between_batches=sanity_hook(runtime, model_dir.plan("sanity", [down(0)])),
        )
        assert list(sanity) == [before], "identical bytes make no new weight version"
        assert sanity[before].perplexity == baseline
        assert runtime.store.slots[down(0)].record == model_dir.record(down(0))
    finally:
        runtime.close()


def sanity_hook(runtime: HotSwapRuntime, plan: Plan) -> Callable[[], int]:
    """A between-batches hook that commits ``plan`` before the first batch."""
    pending = [plan]

    def hook() -> int:
        if pending:
            return committing(runtime, pending.pop())
        return runtime.at_batch_boundary()

    return hook


def test_perplexity_is_deterministic_across_fresh_runtimes(tmp_path: Path) -> None:
    """Two fresh loads of the same files give the same perplexity bit for bit (the premise of
    comparing sweep figures with ==)."""
    model_dir = ModelDir.write(tmp_path / "model")
    tokens = make_eval_tokens(256, CTX * BATCH, seed=5)
    figures = []
    for _ in range(2):
        runtime, model = open_runtime(model_dir.first)
        try:
            figures.append(perplexity(model, tokens, ctx=CTX, batch_size=BATCH))
        finally:
            runtime.close()
    assert figures[0] == figures[1]
    assert torch.isfinite(torch.tensor(figures[0]))
