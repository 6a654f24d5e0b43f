"""PPL and KL divergence against a baseline, as llama.cpp's ``llama-perplexity`` computes them.

The protocol is llama-perplexity's (``tools/perplexity/perplexity.cpp``):

- the text is tokenized once with BOS in front when the vocabulary adds it, and cut into
  ``n_chunk = len(tokens) // n_ctx`` chunks of ``n_ctx`` tokens (at least two chunks' worth);
- each chunk is evaluated from an empty cache with its first token replaced by BOS (when the
  vocabulary adds BOS);
- only the second half of each chunk is scored: the logits at positions ``n_ctx // 2`` to
  ``n_ctx - 2`` predict the tokens at ``n_ctx // 2 + 1`` to ``n_ctx - 1``
  (``n_ctx - 1 - n_ctx // 2`` predictions per chunk), so every prediction has context.

The baseline is kept as llama.cpp's ``--kl-divergence-base`` file keeps it: per scored position,
the log-probabilities of every token in 16 bits, ``log p = scale * q + min_log_prob`` over the
top 16 nats below the maximum (lower ones store 0), with ``scale`` and ``min_log_prob`` as two
float32 in front of the row. That halves float32 logits and makes KLD need no second model in
memory; the file written here is byte-compatible with llama.cpp's (``_logits_`` magic, ``n_ctx``,
``n_vocab``, ``n_chunk``, the tokens, then the rows chunk by chunk).

Every figure follows ``kl_divergence()`` there: KLD per position is ``sum_i p_base_i *
(log p_base_i - log q_i)`` over tokens with ``log p_base_i > -16``; PPL is ``exp(mean NLL)``;
``ln(PPL/PPL_base)`` has the covariance-corrected uncertainty; Δp is the change of the
probability of the actual next token; "same top" compares the argmax tokens.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np
import torch
from torch import Tensor

from ggufswap.runtime.serving.errors import ServingError

LOGITS_MAGIC: Final = b"_logits_"
LOG_PROB_SPAN: Final = 16.0  # nats below the maximum that the base rows keep
_HEADER: Final = struct.Struct("<8sIii")  # magic, n_ctx (u32), n_vocab (i32), n_chunk (i32)
_ROW_HEAD: Final = 4  # uint16 slots of (scale, min_log_prob) in front of each row
_SLICE_ROWS: Final = 16  # positions processed at once (16 x 262144 float32 = 16 MiB)
_MIN_STATS: Final = 10  # llama.cpp reports no uncertainty below this many predictions


class KldError(ServingError, ValueError):
    """A baseline file or a chunking request that cannot be used; the message says why."""


def first_scored(n_ctx: int) -> int:
    """The first position whose logits are scored (llama-perplexity's ``first``)."""
    return n_ctx // 2


def scored_per_chunk(n_ctx: int) -> int:
    return n_ctx - 1 - first_scored(n_ctx)


def row_width(n_vocab: int) -> int:
    """uint16 slots of one stored base row (llama.cpp's ``nv``)."""
    return 2 * ((n_vocab + 1) // 2) + _ROW_HEAD


def text_chunks(tokens: list[int], *, n_ctx: int, max_chunks: int | None = None) -> np.ndarray:
    """``[n_chunk, n_ctx]`` int32: the text's tokens (BOS included when the tokenizer adds it)
    cut as llama-perplexity cuts them; KldError below two chunks' worth of tokens."""
    if n_ctx < 4:
        raise KldError(f"a context of {n_ctx} tokens is too small (need >= 4)")
    if len(tokens) < 2 * n_ctx:
        raise KldError(
            f"the text tokenizes to {len(tokens)} tokens; a context of {n_ctx} needs at least "
            f"{2 * n_ctx} (llama-perplexity's rule): give a longer text or a smaller --ctx"
        )
    n_chunk = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunk = min(n_chunk, max_chunks)
    return np.asarray(tokens[: n_chunk * n_ctx], dtype=np.int32).reshape(n_chunk, n_ctx)


def eval_batch(chunks: np.ndarray, bos_id: int | None) -> Tensor:
    """The chunks as evaluated: the first token of each replaced by BOS when it is given."""
    batch = torch.from_numpy(chunks.astype(np.int64))  # [C, n_ctx]
    if bos_id is not None:
        batch[:, 0] = bos_id
    return batch


def _log_sum_exp(logits: Tensor, max_logit: Tensor) -> Tensor:
    """float32 ``log(sum(exp(l - max)))`` with the sum in float64, as llama.cpp does it."""
    shifted = logits - max_logit[:, None]
    return torch.exp_(shifted).sum(dim=1, dtype=torch.float64).log().float()


def encode_base_rows(logits: Tensor, targets: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(rows [N, nv] uint16, nll [N] float64)`` of float32 logits ``[N, V]`` and the tokens
    ``[N]`` they predict: llama.cpp's ``log_softmax`` that writes a base row."""
    logits = logits.float()
    n, n_vocab = logits.shape
    rows = np.zeros((n, row_width(n_vocab)), dtype=np.uint16)
    nll = np.empty(n, dtype=np.float64)
    for lo in range(0, n, _SLICE_ROWS):
        x = logits[lo : lo + _SLICE_ROWS]  # [n', V]
        max_logit = x.max(dim=1).values
        min_logit = torch.maximum(x.min(dim=1).values, max_logit - LOG_PROB_SPAN)
        lse = _log_sum_exp(x, max_logit)
        min_log_prob = min_logit - max_logit - lse
        scale = (max_logit - min_logit) / 65535.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        # round half to even as nearest_int; below min_logit the value is negative: 0, as there
        q = (x - min_logit[:, None]).mul_(inv[:, None]).round_().clamp_(min=0.0)
        head = torch.stack([scale, min_log_prob], dim=1).numpy().astype(np.float32)
        block = rows[lo : lo + len(x)]
        block[:, :_ROW_HEAD] = head.view(np.uint16)
        np.copyto(block[:, _ROW_HEAD : _ROW_HEAD + n_vocab], q.numpy(), casting="unsafe")
        tok = targets[lo : lo + len(x)].long()
        picked = x.gather(1, tok[:, None])[:, 0]
        nll[lo : lo + len(x)] = (max_logit + lse - picked).double().numpy()
    return rows, nll


def decode_base_rows(rows: np.ndarray, n_vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(scale [N], min_log_prob [N], q [N, V] float32)`` of stored base rows."""
    head = np.ascontiguousarray(rows[:, :_ROW_HEAD]).view(np.float32)  # [N, 2]
    q = torch.from_numpy(np.ascontiguousarray(rows[:, _ROW_HEAD : _ROW_HEAD + n_vocab])).float()
    return torch.from_numpy(head[:, 0].copy()), torch.from_numpy(head[:, 1].copy()), q


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
        lse = _log_sum_exp(x, max_logit)
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
        p_diff = (torch.exp(-nll) - torch.exp(-nll_base)).double()
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
    """llama.cpp's percentile of sorted values: linear between the two nearest ranks."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = np.float32(fraction) * np.float32(len(sorted_values) - 1)
    ip = int(p)
    p = p - ip
    nxt = sorted_values[min(ip + 1, len(sorted_values) - 1)]
    return float((1 - p) * sorted_values[ip] + p * nxt)


@dataclass(frozen=True, kw_only=True)
class KldResult:
    """The figures llama-perplexity prints at the end of a ``--kl-divergence`` run."""

    count: int  # scored predictions
    ppl: float
    ppl_unc: float
    ppl_base: float
    ln_ppl_ratio: float  # ln(PPL(Q)/PPL(base))
    ln_ppl_ratio_unc: float
    kld_mean: float
    kld_unc: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    dp_rms: float  # RMS of Δp, as a fraction (llama.cpp prints it x100 as %)
    dp_rms_unc: float
    same_top: float  # fraction of positions with the same argmax token
    same_top_unc: float

    @classmethod
    def of(cls, s: KldStats) -> KldResult:
        if s.count == 0:
            raise KldError("no positions were scored")
        log_ppl = _mean_and_uncertainty(s.sum_nll, s.sum_nll2, s.count)
        log_base = _mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, s.count)
        cov = _covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count)
        ratio_var = log_ppl[1] ** 2 + log_base[1] ** 2 - 2.0 * cov
        kld = _mean_and_uncertainty(s.sum_kld, s.sum_kld2, s.count)
        mse = _mean_and_uncertainty(s.sum_p_diff2, s.sum_p_diff4, s.count)
        rms = math.sqrt(mse[0])
        same = s.n_same_top / s.count
        values = np.sort(np.concatenate(s.kld_values))
        return cls(
            count=s.count,
            ppl=math.exp(log_ppl[0]),
            ppl_unc=math.exp(log_ppl[0]) * log_ppl[1],
            ppl_base=math.exp(log_base[0]),
            ln_ppl_ratio=log_ppl[0] - log_base[0],
            ln_ppl_ratio_unc=math.sqrt(max(ratio_var, 0.0)),
            kld_mean=kld[0],
            kld_unc=kld[1],
            kld_p99=percentile(values, 0.990),
            kld_p999=percentile(values, 0.999),
            kld_max=float(values[-1]),
            dp_rms=rms,
            dp_rms_unc=0.5 / rms * mse[1] if rms > 0 else 0.0,
            same_top=same,
            same_top_unc=math.sqrt(same * (1 - same) / (s.count - 1)) if s.count > 1 else 0.0,
        )


def logits_digest(logits: Tensor) -> str:
    """A digest of float32 logits' exact bits (the restore check compares these)."""
    data = logits.detach().float().contiguous().cpu().numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


# --- the base file ------------------------------------------------------------------------------


class BaseLogProbsWriter:
    """Writes a llama.cpp ``--kl-divergence-base`` file chunk by chunk (then fsyncs it)."""

    def __init__(self, path: str | os.PathLike[str], *, chunks: np.ndarray, n_vocab: int) -> None:
        self.path = Path(path)
        self.n_chunk, self.n_ctx = chunks.shape
        self.n_vocab = n_vocab
        self._written = 0
        self._f = self.path.open("wb")
        self._f.write(_HEADER.pack(LOGITS_MAGIC, self.n_ctx, n_vocab, self.n_chunk))
        self._f.write(chunks.astype("<i4").tobytes())

    def write_chunk(self, rows: np.ndarray) -> None:
        expected = (scored_per_chunk(self.n_ctx), row_width(self.n_vocab))
        if rows.shape != expected:
            raise KldError(f"{self.path}: a chunk's rows are {list(expected)}, found {rows.shape}")
        self._f.write(rows.astype("<u2").tobytes())
        self._written += 1

    def close(self) -> None:
        if self._written != self.n_chunk:
            self._f.close()
            raise KldError(f"{self.path}: {self._written} of {self.n_chunk} chunks written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


class BaseLogProbs:
    """A llama.cpp ``--kl-divergence-base`` file, memory-mapped: tokens and rows per chunk."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != LOGITS_MAGIC:
            raise KldError(f"{self.path} is not a llama.cpp log-probability file (no _logits_)")
        _, self.n_ctx, self.n_vocab, self.n_chunk = _HEADER.unpack(head)
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1:
            raise KldError(
                f"{self.path}: implausible header n_ctx={self.n_ctx} n_vocab={self.n_vocab} "
                f"n_chunk={self.n_chunk}"
            )
        tokens_bytes = 4 * self.n_ctx * self.n_chunk
        self._rows_per_chunk = scored_per_chunk(self.n_ctx)
        nv = row_width(self.n_vocab)
        expected = _HEADER.size + tokens_bytes + 2 * self.n_chunk * self._rows_per_chunk * nv
        if size != expected:
            raise KldError(
                f"{self.path}: {size} bytes, expected {expected} for n_ctx={self.n_ctx} "
                f"n_vocab={self.n_vocab} n_chunk={self.n_chunk} (truncated or not llama.cpp's)"
            )
        self.tokens = np.fromfile(
            self.path, dtype="<i4", count=self.n_ctx * self.n_chunk, offset=_HEADER.size
        ).reshape(self.n_chunk, self.n_ctx)
        self._rows = np.memmap(
            self.path,
            dtype="<u2",
            mode="r",
            offset=_HEADER.size + tokens_bytes,
            shape=(self.n_chunk, self._rows_per_chunk, nv),
        )

    def rows(self, chunk: int) -> np.ndarray:
        """``[n_ctx - 1 - n_ctx // 2, nv]`` uint16 rows of one chunk."""
        return np.asarray(self._rows[chunk])

    def targets(self, chunk: int) -> Tensor:
        """The tokens the scored positions of ``chunk`` predict."""
        first = first_scored(self.n_ctx)
        return torch.from_numpy(self.tokens[chunk, first + 1 :].astype(np.int64))
