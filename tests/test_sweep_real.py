"""The sweep on the real Gemma 3 270M Q4_K_M (from its pip package, nothing downloaded), split one
tensor per shard: one round is swapped, measured, restored to the baseline bit for bit and
recorded with plausible figures."""

from __future__ import annotations

import csv
import sysconfig
from pathlib import Path

import pytest

from ggufswap.shards.resplit import split_per_tensor
from ggufswap.sweep import SweepOptions, run_sweep
from ggufswap.sweep.recipe import Recipe
from ggufswap.sweep.results import PPL_CSV

# llama.cpp's rounding (the default numerics) on 2 chunks of 128 of the real model: minutes on a
# loaded CPU
pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.timeout(900)]

SWAPPED = "blk.3.attn_q.weight"  # Q5_0 in the Q4_K_M file


@pytest.fixture(scope="module")
def gemma_per_tensor(tmp_path_factory: pytest.TempPathFactory, real_gemma: Path) -> Path:
    pytest.importorskip("tokenizers", reason="the tokenizer needs `pip install tokenizers`")
    return split_per_tensor(real_gemma, tmp_path_factory.mktemp("gemma3-per-tensor"))[0]


def test_gemma_sweep_round_is_measured_restored_and_recorded(
    gemma_per_tensor: Path, tmp_path: Path
) -> None:
    """Swapping blk.3.attn_q (Q5_0) to Q4_0 raises KLD above zero but keeps it small and the top
    token mostly the same; the restore gives the baseline logits back exactly; the CSV has it."""
    license_path = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    if not license_path.exists():
        pytest.skip(f"no English text to evaluate on: {license_path} is missing")
    recipe = Recipe.from_document({"quants": ["q4_0"], "tensors": [{"match": f"^{SWAPPED}$"}]})
    report = run_sweep(
        gemma_per_tensor,
        text=license_path.read_text(encoding="utf-8"),
        recipe=recipe,
        out_dir=tmp_path / "out",
        options=SweepOptions(n_ctx=128, max_chunks=2),
    )
    record = report.journal[f"{SWAPPED}@q4_0"]
    m = record["metrics"]
    assert record["tensors"] == [SWAPPED]
    assert record["from_types"] == ["q5_0"]
    assert 0 < m["kld_mean"] < 0.1
    assert m["same_top"] > 0.8
    assert 5 < report.ppl_base < 100, "English text: a plausible perplexity"
    assert record["restored_version"] == record["weight_version"] + 1
    with (tmp_path / "out" / PPL_CSV).open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["QTYPE", SWAPPED]
    assert rows[1][0] == "q4_0"
