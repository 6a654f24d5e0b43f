"""The reference runtime's batch loop (``runtime/serving/serve.py``) in this process: the
perplexity mode measures each weight version once, then runs no batch until a commit."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from runtime_helpers import ModelDir, one_thread, open_model

from ggufswap.runtime import PlanState
from ggufswap.runtime.serving.perplexity import make_eval_tokens, perplexity
from ggufswap.runtime.serving.serve import Mode, ServeLoop, ServeOptions
from ggufswap.shards import tiny_dense

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

# Two windows of 32 tokens, one window a batch: a pass is two batches.
OPTIONS = ServeOptions(mode=Mode.PERPLEXITY, eval_tokens=64, eval_ctx=32, eval_batch=1)
SWAPPED = "blk.0.ffn_down.weight"


def run_until_measured(loop: ServeLoop, version: int, *, limit: int = 20) -> dict[str, float]:
    """Step until ``version``'s pass is recorded (at most ``limit`` steps); its result."""
    for _ in range(limit):
        loop.step()
        result = loop.status()["serve"]["results"].get(str(version), {})
        if "perplexity" in result:
            return result
    raise AssertionError(f"no pass on version {version} after {limit} steps: {loop.status()}")


def test_perplexity_mode_measures_each_version_once_then_only_commits(tmp_path: Path) -> None:
    """A pass on version 0 gives the stream's perplexity; further steps run no batch; a plan
    staged meanwhile is still committed at the next step, and version 1 is measured in turn."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_dense())
    variant = model_dir.variant(SWAPPED, GGMLQuantizationType.Q5_1, tmp_path / "variants")
    runtime, model = open_model(model_dir.first)
    try:
        loop = ServeLoop(runtime, model, options=OPTIONS)
        first = run_until_measured(loop, 0)
        stream = make_eval_tokens(model.config.n_vocab, OPTIONS.eval_tokens, OPTIONS.seed)
        assert first["perplexity"] == pytest.approx(
            perplexity(model, stream, ctx=OPTIONS.eval_ctx, batch_size=OPTIONS.eval_batch),
            rel=1e-9,
        )
        batches = loop.batches
        for _ in range(5):
            assert loop.step() == 0
        assert loop.batches == batches, "a measured version runs no more batches"

        model_dir.put(SWAPPED, variant)
        ticket = runtime.submit(model_dir.plan("swap", [SWAPPED]))
        assert runtime.wait_staged(timeout=30), ticket.summary()
        assert loop.step() == 1, "the idle loop still commits at its next step"
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        second = run_until_measured(loop, 1)
        assert second["perplexity"] != first["perplexity"]
        assert loop.batches == batches + 2, "version 1's pass: two batches"
    finally:
        runtime.close()
