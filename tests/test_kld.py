"""PPL and KL divergence against a compact baseline, as llama-perplexity --kl-divergence computes
them: the 16-bit base rows, the figures against a direct float64 computation, the base file."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ggufswap.runtime.serving.errors import EvalTextError
from ggufswap.runtime.serving.perplexity import first_scored, scored_per_chunk, text_chunks
from ggufswap.sweep.basefile import (
    BaseLogProbs,
    BaseLogProbsWriter,
    encode_base_rows,
    row_width,
)
from ggufswap.sweep.errors import KldError
from ggufswap.sweep.kld import KldStats, median, percentile

N_VOCAB = 301  # odd: the rows carry one pad slot, as llama.cpp's do
N_POS = 400


def pair(seed: int, noise: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Base logits, logits perturbed by ``noise``, and the tokens they predict."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N_POS, N_VOCAB, generator=g) * 3.0
    current = base + noise * torch.randn(N_POS, N_VOCAB, generator=g)
    targets = torch.multinomial(torch.softmax(base, dim=1), 1, generator=g)[:, 0]
    return base, current, targets


def direct(base: torch.Tensor, current: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """The same figures from full logits in float64, no compact rows, no truncation."""
    lp = torch.log_softmax(base.double(), dim=1)
    lq = torch.log_softmax(current.double(), dim=1)
    kld = (lp.exp() * (lp - lq)).sum(dim=1)
    nll = -lq.gather(1, targets[:, None])[:, 0]
    nll_base = -lp.gather(1, targets[:, None])[:, 0]
    p_diff = (-nll).exp() - (-nll_base).exp()
    return {
        "kld": kld,
        "p_diff": p_diff,
        "kld_mean": float(kld.mean()),
        "kld_max": float(kld.max()),
        "ppl": math.exp(float(nll.mean())),
        "ppl_base": math.exp(float(nll_base.mean())),
        "dp_rms": float(p_diff.pow(2).mean().sqrt()),
        "same_top": float((base.argmax(1) == current.argmax(1)).double().mean()),
    }


@pytest.mark.parametrize("noise", [0.05, 0.3, 1.0])
def test_kld_matches_a_direct_float64_computation(noise: float) -> None:
    """Mean KLD, its maximum, PPL, PPL(base), Δp RMS and same-top from the 16-bit base rows agree
    with a float64 computation from the full logits."""
    base, current, targets = pair(1, noise)
    rows, base_nll = encode_base_rows(base, targets)
    assert rows.shape == (N_POS, row_width(N_VOCAB))
    assert rows.dtype == np.uint16
    stats = KldStats()
    stats.add(current, rows, targets)
    got = stats.result()
    m = got.as_metrics()
    want = direct(base, current, targets)
    assert got.count == N_POS
    assert got.kld_mean == pytest.approx(want["kld_mean"], rel=2e-3, abs=2e-6)
    assert m["kld_max"] == pytest.approx(want["kld_max"], rel=2e-3, abs=2e-6)
    assert got.ppl == pytest.approx(want["ppl"], rel=1e-6)
    assert got.ppl_base == pytest.approx(want["ppl_base"], rel=1e-4)
    assert math.exp(base_nll.mean()) == pytest.approx(want["ppl_base"], rel=1e-6)
    assert got.dp_rms == pytest.approx(want["dp_rms"], rel=1e-3, abs=1e-6)
    assert got.same_top == pytest.approx(want["same_top"], abs=1.5 / N_POS)
    assert got.ln_ppl_ratio == pytest.approx(math.log(want["ppl"] / want["ppl_base"]), abs=1e-4)
    assert m["kld_min"] <= m["kld_p01"] <= m["kld_median"] <= m["kld_p90"] <= m["kld_p95"]
    assert m["kld_p95"] <= m["kld_p99"] <= m["kld_p999"] <= m["kld_max"]
    kld = np.sort(want["kld"].numpy())
    assert m["kld_median"] == pytest.approx(float(np.median(kld)), rel=5e-3, abs=2e-6)
    assert m["kld_p90"] == pytest.approx(float(np.quantile(kld, 0.9)), rel=5e-3, abs=2e-6)
    p_diff = want["p_diff"].numpy()
    assert m["dp_median"] == pytest.approx(float(np.median(p_diff)), abs=1e-5)
    assert m["dp_p25"] == pytest.approx(float(np.quantile(p_diff, 0.25)), abs=1e-5)
    assert got.dp_mean == pytest.approx(float(p_diff.mean()), abs=1e-6)
    assert got.kld_unc > 0
    assert got.ppl_unc > 0
    assert got.dp_mean_unc > 0


def test_identical_logits_score_zero() -> None:
    """Logits equal to the baseline's give KLD ~0 (the 16-bit rounding only), 100 % same top and
    the baseline's perplexity."""
    base, _, targets = pair(2, 0.0)
    rows, _ = encode_base_rows(base, targets)
    stats = KldStats()
    stats.add(base, rows, targets)
    got = stats.result()
    assert abs(got.kld_mean) < 1e-6
    assert got.same_top == 1.0
    assert got.ppl == pytest.approx(got.ppl_base, rel=1e-4)


def test_split_accumulation_equals_one_pass() -> None:
    """Scoring positions in two calls gives the same sums as one call (chunks accumulate)."""
    base, current, targets = pair(3, 0.5)
    rows, _ = encode_base_rows(base, targets)
    one, two = KldStats(), KldStats()
    one.add(current, rows, targets)
    two.add(current[:123], rows[:123], targets[:123])
    two.add(current[123:], rows[123:], targets[123:])
    assert two.result().kld_mean == pytest.approx(one.result().kld_mean, rel=1e-12)
    assert two.result().count == one.result().count


def test_base_file_round_trip(tmp_path: Path) -> None:
    """The base file holds the header, the tokens and each chunk's rows, as llama.cpp's does."""
    n_ctx = 16
    tokens = list(range(100, 100 + 3 * n_ctx + 5))
    chunks = text_chunks(tokens, n_ctx=n_ctx)
    assert chunks.shape == (3, n_ctx)
    n = scored_per_chunk(n_ctx)
    assert n == n_ctx - 1 - first_scored(n_ctx) == 7
    writer = BaseLogProbsWriter(tmp_path / "base.bin", chunks=chunks, n_vocab=N_VOCAB)
    written = []
    for c in range(3):
        logits = torch.randn(n, N_VOCAB, generator=torch.Generator().manual_seed(c))
        rows, _ = encode_base_rows(logits, torch.tensor(chunks[c, first_scored(n_ctx) + 1 :]))
        writer.write_chunk(rows)
        written.append(rows)
    writer.close()
    size = (tmp_path / "base.bin").stat().st_size
    assert size == 20 + 4 * 3 * n_ctx + 2 * 3 * n * row_width(N_VOCAB)
    base = BaseLogProbs(tmp_path / "base.bin")
    assert (base.n_ctx, base.n_vocab, base.n_chunk) == (n_ctx, N_VOCAB, 3)
    assert np.array_equal(base.tokens, chunks)
    for c in range(3):
        assert np.array_equal(base.rows(c), written[c])
        assert base.targets(c).tolist() == chunks[c, n_ctx // 2 + 1 :].tolist()


def test_truncated_base_file_is_refused(tmp_path: Path) -> None:
    """A base file cut short is refused with its size and what was expected."""
    chunks = text_chunks(list(range(64)), n_ctx=16)
    writer = BaseLogProbsWriter(tmp_path / "base.bin", chunks=chunks, n_vocab=N_VOCAB)
    for _ in range(len(chunks)):
        writer.write_chunk(np.zeros((scored_per_chunk(16), row_width(N_VOCAB)), np.uint16))
    writer.close()
    data = (tmp_path / "base.bin").read_bytes()
    (tmp_path / "base.bin").write_bytes(data[:-2])
    with pytest.raises(KldError, match="truncated"):
        BaseLogProbs(tmp_path / "base.bin")


def test_too_short_text_is_refused() -> None:
    """Fewer than two contexts' worth of tokens is refused, naming both numbers."""
    with pytest.raises(EvalTextError, match=r"30 tokens.*at least 32"):
        text_chunks(list(range(30)), n_ctx=16)


def test_percentiles_and_median_as_llama_cpp_takes_them() -> None:
    """Percentiles interpolate linearly between the two nearest ranks in float32, the median of
    an even count is the mean of the two middle values (llama-perplexity's definitions)."""
    values = np.array([0.0, 1.0, 2.0, 10.0], dtype=np.float32)
    assert median(values) == 1.5
    assert median(values[:3]) == 1.0
    assert percentile(values, 0.5) == pytest.approx(1.5)
    assert percentile(values, 0.9) == pytest.approx(2.0 + 0.7 * 8.0, rel=1e-6)
    assert percentile(values, 0.0) == 0.0
    assert percentile(values, 1.0) == 10.0
