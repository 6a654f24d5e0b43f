"""PPL and KL divergence against a baseline, as llama.cpp's ``llama-perplexity --kl-divergence``
computes and prints them.

Every figure follows ``kl_divergence()`` in ``tools/perplexity/perplexity.cpp``: per scored
position (the protocol of :mod:`ggufswap.runtime.serving.perplexity`), KLD is ``sum_i p_base_i *
(log p_base_i - log q_i)`` over the tokens with ``log p_base_i > -16`` (the base file keeps no
lower ones, :mod:`.basefile`); PPL is ``exp(mean NLL)``; ``ln(PPL/PPL_base)`` has the
covariance-corrected uncertainty; Δp is the change of the probability of the actual next token;
"same top" compares the argmax tokens. The summary is the one llama-perplexity prints at the end:
mean KLD ± its standard error, its median, 90/95/99/99.9 % and maximum (and the lower
percentiles), Δp mean ± error and percentiles, RMS Δp and same top ± error.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import torch
from torch import Tensor

from ggufswap.runtime.serving.perplexity import log_sum_exp
from ggufswap.sweep.basefile import LOG_PROB_SPAN, decode_base_rows, row_width
from ggufswap.sweep.errors import KldError

_SLICE_ROWS: Final = 16  # positions processed at once (16 x 262144 float32 = 16 MiB)
_MIN_STATS: Final = 10  # llama.cpp reports no uncertainty below this many predictions
# The percentiles llama-perplexity prints (name suffix -> fraction), KLD and Δp alike.
KLD_PERCENTILES: Final = {
    "p999": 0.999, "p99": 0.990, "p95": 0.950, "p90": 0.900,
    "p10": 0.100, "p5": 0.050, "p1": 0.010, "p01": 0.001,
}  # fmt: skip
DP_PERCENTILES: Final = {
    "p999": 0.999, "p99": 0.990, "p95": 0.950, "p90": 0.900, "p75": 0.750,
    "p25": 0.250, "p10": 0.100, "p5": 0.050, "p1": 0.010, "p01": 0.001,
}  # fmt: skip


@dataclass
class KldStats:
    """Running sums of llama.cpp's ``kl_divergence_result`` plus the per-position values."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: Tensor, base_rows: np.ndarray, targets: Tensor) -> None:
        """Score float32 logits ``[N, V]`` of the current model against base rows ``[N, nv]``
        for the tokens ``[N]`` they predict."""
        logits = logits.float()
        n, n_vocab = logits.shape
        if base_rows.shape != (n, row_width(n_vocab)):
            raise KldError(
                f"base rows of shape {list(base_rows.shape)} do not fit logits of "
                f"{n} positions x {n_vocab} tokens (expected {[n, row_width(n_vocab)]})"
            )
        for lo in range(0, n, _SLICE_ROWS):
            hi = min(n, lo + _SLICE_ROWS)
            self._add_slice(logits[lo:hi], base_rows[lo:hi], targets[lo:hi].long())

    def _add_slice(self, x: Tensor, rows: np.ndarray, tok: Tensor) -> None:
        n_vocab = x.shape[1]
        max_logit, imax = x.max(dim=1)  # first maximum, as llama.cpp's strict '>'
        lse = log_sum_exp(x, max_logit)
        scale, min_log_prob, q = decode_base_rows(rows, n_vocab)
        nll = max_logit + lse - x.gather(1, tok[:, None])[:, 0]  # [n] float32
        nll_base = -(scale * q.gather(1, tok[:, None])[:, 0] + min_log_prob)
        log_p_base = torch.addcmul(min_log_prob[:, None], scale[:, None], q)  # [n, V]
        imax_base = q.argmax(dim=1)  # scale >= 0: the first maximum of log p_base
        # Only tokens within 16 nats of the top count (most of a large vocabulary is not).
        row, col = (log_p_base > -LOG_PROB_SPAN).nonzero(as_tuple=True)
        lp = log_p_base[row, col]
        terms = torch.exp(lp) * (lp - x[row, col] + (max_logit + lse)[row])
        kld64 = torch.zeros(len(x), dtype=torch.float64).index_add_(0, row, terms.double())
        p_diff32 = torch.exp(-nll) - torch.exp(-nll_base)  # float, as llama.cpp's
        p_diff = p_diff32.double()
        nll64, base64 = nll.double(), nll_base.double()
        self.sum_nll += float(nll64.sum())
        self.sum_nll2 += float((nll64 * nll64).sum())
        self.sum_nll_base += float(base64.sum())
        self.sum_nll_base2 += float((base64 * base64).sum())
        self.sum_nll_nll_base += float((nll64 * base64).sum())
        self.sum_kld += float(kld64.sum())
        self.sum_kld2 += float((kld64 * kld64).sum())
        self.sum_p_diff += float(p_diff.sum())
        self.sum_p_diff2 += float((p_diff * p_diff).sum())
        self.sum_p_diff4 += float((p_diff**4).sum())
        self.max_p_diff = max(self.max_p_diff, float(p_diff.abs().max()))
        self.n_same_top += int((imax == imax_base).sum())
        self.count += int(x.shape[0])
        self.kld_values.append(kld64.float().numpy())
        self.p_diff_values.append(p_diff32.numpy().copy())

    def result(self) -> KldResult:
        return KldResult.of(self)


def _mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > _MIN_STATS else 0.0


def _covariance(a: float, b: float, ab: float, count: int) -> float:
    if count < _MIN_STATS:
        return 0.0
    return (ab / count - (a / count) * (b / count)) / (count - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile of sorted float32 values: linear between the two nearest ranks, in
    float32 as it computes it."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = np.float32(fraction) * np.float32(len(sorted_values) - 1)
    ip = int(p)
    p = p - np.float32(ip)
    nxt = sorted_values[min(ip + 1, len(sorted_values) - 1)]
    return float((np.float32(1) - p) * sorted_values[ip] + p * nxt)


def median(sorted_values: np.ndarray) -> float:
    """llama.cpp's median: the middle value, or the float32 mean of the two middle ones."""
    n = len(sorted_values)
    if n % 2:
        return float(sorted_values[n // 2])
    return float(np.float32(0.5) * (sorted_values[n // 2] + sorted_values[n // 2 - 1]))


def _distribution(prefix: str, values: np.ndarray, points: dict[str, float]) -> dict[str, float]:
    """``{prefix_max, prefix_pNN..., prefix_median, prefix_min}`` of sorted ``values``."""
    out = {f"{prefix}_max": float(values[-1])}
    out.update({f"{prefix}_{k}": percentile(values, f) for k, f in points.items()})
    out[f"{prefix}_median"] = median(values)
    out[f"{prefix}_min"] = float(values[0])
    return out


@dataclass(frozen=True, kw_only=True)
class KldResult:
    """The figures llama-perplexity prints at the end of a ``--kl-divergence`` run
    (``percentiles``: the KLD and Δp distributions, ``kld_p99``, ``dp_median``... by name)."""

    count: int  # scored predictions
    ppl: float
    ppl_unc: float
    ppl_base: float
    ppl_base_unc: float
    ln_ppl_ratio: float  # ln(PPL(Q)/PPL(base))
    ln_ppl_ratio_unc: float
    ppl_ratio: float  # PPL(Q)/PPL(base)
    ppl_ratio_unc: float
    ppl_diff: float  # PPL(Q)-PPL(base)
    ppl_diff_unc: float
    kld_mean: float
    kld_unc: float
    dp_mean: float  # mean Δp, as a fraction (llama.cpp prints it x100 as %)
    dp_mean_unc: float
    dp_rms: float  # RMS of Δp, as a fraction
    dp_rms_unc: float
    same_top: float  # fraction of positions with the same argmax token
    same_top_unc: float
    percentiles: dict[str, float]

    def as_metrics(self) -> dict[str, float | int]:
        """One flat record (the journal's ``metrics``): every field, the percentiles inlined."""
        out: dict[str, float | int] = {k: v for k, v in self.__dict__.items() if k != "percentiles"}
        out.update(self.percentiles)
        return out

    @classmethod
    def of(cls, s: KldStats) -> KldResult:
        if s.count == 0:
            raise KldError("no positions were scored")
        log_ppl = _mean_and_uncertainty(s.sum_nll, s.sum_nll2, s.count)
        log_base = _mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, s.count)
        cov = _covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count)
        ratio_unc = math.sqrt(max(log_ppl[1] ** 2 + log_base[1] ** 2 - 2.0 * cov, 0.0))
        ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
        ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
        diff_var = ppl_unc**2 + base_unc**2 - 2.0 * ppl * ppl_base * cov
        kld = _mean_and_uncertainty(s.sum_kld, s.sum_kld2, s.count)
        dp = _mean_and_uncertainty(s.sum_p_diff, s.sum_p_diff2, s.count)
        mse = _mean_and_uncertainty(s.sum_p_diff2, s.sum_p_diff4, s.count)
        rms = math.sqrt(mse[0])
        same = s.n_same_top / s.count
        klds = np.sort(np.concatenate(s.kld_values))
        p_diffs = np.sort(np.concatenate(s.p_diff_values))
        return cls(
            count=s.count,
            ppl=ppl,
            ppl_unc=ppl_unc,
            ppl_base=ppl_base,
            ppl_base_unc=base_unc,
            ln_ppl_ratio=log_ppl[0] - log_base[0],
            ln_ppl_ratio_unc=ratio_unc,
            ppl_ratio=math.exp(log_ppl[0] - log_base[0]),
            ppl_ratio_unc=math.exp(log_ppl[0] - log_base[0]) * ratio_unc,
            ppl_diff=ppl - ppl_base,
            ppl_diff_unc=math.sqrt(max(diff_var, 0.0)),
            kld_mean=kld[0],
            kld_unc=kld[1],
            dp_mean=dp[0],
            dp_mean_unc=dp[1],
            dp_rms=rms,
            dp_rms_unc=0.5 / rms * mse[1] if rms > 0 else 0.0,
            same_top=same,
            same_top_unc=math.sqrt(same * (1 - same) / (s.count - 1)) if s.count > 1 else 0.0,
            percentiles={
                **_distribution("kld", klds, KLD_PERCENTILES),
                **_distribution("dp", p_diffs, DP_PERCENTILES),
            },
        )


def logits_digest(logits: Tensor) -> str:
    """A digest of float32 logits' exact bits (the restore check compares these)."""
    data = logits.detach().float().contiguous().cpu().numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
