"""Perplexity evaluation: a plain loop over token windows, and a sweep loop that attributes each
batch's NLL to the weight version it ran on.

All sums run in float64 in a fixed order, so two evaluations of the same weights on CPU give the
same figure bit for bit.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor

from ggufswap.logs import get_logger

log = get_logger(__name__)

LanguageModel = Callable[[Tensor], Tensor]  # tokens [B, T] int64 -> logits [B, T, V]

# make_eval_tokens: each token has this many likely successors, and with this probability the
# next token is drawn uniformly instead (so every token stays possible and the NLL is finite).
_MARKOV_BRANCHING = 4
_MARKOV_NOISE = 0.05


@dataclass(frozen=True, slots=True)
class NllStats:
    """Summed next-token negative log-likelihood (nats) over ``n_tokens`` predictions."""

    nll_sum: float = 0.0
    n_tokens: int = 0
    n_batches: int = 0

    def __add__(self, other: NllStats) -> NllStats:
        return NllStats(
            self.nll_sum + other.nll_sum,
            self.n_tokens + other.n_tokens,
            self.n_batches + other.n_batches,
        )

    @property
    def mean_nll(self) -> float:
        if self.n_tokens == 0:
            raise ValueError("no tokens were scored: mean NLL is undefined")
        return self.nll_sum / self.n_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def batch_nll(model: LanguageModel, tokens: Tensor) -> NllStats:
    """NLL of predicting ``tokens[:, 1:]`` from each prefix, for one batch ``[B, T]``."""
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"expected a token batch [B, T] with T >= 2, found {list(tokens.shape)}")
    with torch.inference_mode():
        logits = model(tokens)  # [B, T, V]
        targets = tokens[:, 1:].to(logits.device)  # [B, T-1]
        nll = F.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="none"
        )  # [B*(T-1)]
        return NllStats(float(nll.double().sum()), nll.numel(), 1)


def token_windows(tokens: Tensor, *, ctx: int, batch_size: int) -> list[Tensor]:
    """Split a 1-D token stream into non-overlapping ``ctx`` windows, grouped into batches
    ``[<= batch_size, ctx]``; a trailing partial window is dropped."""
    if tokens.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, found shape {list(tokens.shape)}")
    if ctx < 2 or batch_size < 1:
        raise ValueError(f"need ctx >= 2 and batch_size >= 1, found ctx={ctx} batch={batch_size}")
    n_windows = tokens.numel() // ctx
    if n_windows == 0:
        raise ValueError(f"{tokens.numel()} tokens do not fill one window of ctx={ctx}")
    windows = tokens[: n_windows * ctx].view(n_windows, ctx)  # [W, ctx]
    return list(windows.split(batch_size))


def perplexity(model: LanguageModel, tokens: Tensor, *, ctx: int, batch_size: int) -> float:
    """exp(mean NLL) over non-overlapping ``ctx`` windows of ``tokens`` (each window scores its
    ``ctx - 1`` next-token predictions)."""
    total = NllStats()
    for batch in token_windows(tokens, ctx=ctx, batch_size=batch_size):
        total += batch_nll(model, batch)
    return total.perplexity


def evaluate_batches(
    model: LanguageModel, batches: Iterable[Tensor], *, between_batches: Callable[[], int]
) -> dict[int, NllStats]:
    """Run each batch, calling ``between_batches()`` (the runtime's ``at_batch_boundary``, which
    returns the weight version) before it; NLL is summed per weight version, in first-seen order."""
    per_version: dict[int, NllStats] = {}
    for batch in batches:
        version = between_batches()
        stats = batch_nll(model, batch)
        per_version[version] = per_version.get(version, NllStats()) + stats
        log.debug("eval_batch", weight_version=version, mean_nll=stats.mean_nll)
    return per_version


def make_eval_tokens(n_vocab: int, n_tokens: int, seed: int) -> Tensor:
    """A deterministic token stream ``[n_tokens]`` from a sparse random Markov chain: each token
    has a few likely successors, so a model that learnt the chain scores far below ``n_vocab``."""
    if n_vocab < 2 or n_tokens < 1:
        raise ValueError(f"need n_vocab >= 2 and n_tokens >= 1, found {n_vocab}, {n_tokens}")
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, n_vocab, size=(n_vocab, _MARKOV_BRANCHING))  # [V, k]
    cdf = rng.dirichlet(np.ones(_MARKOV_BRANCHING), size=n_vocab).cumsum(axis=1)  # [V, k]
    noisy = rng.random(n_tokens) < _MARKOV_NOISE
    uniform = rng.integers(0, n_vocab, size=n_tokens)
    pick = rng.random(n_tokens)
    succ, cdf_rows = successors.tolist(), cdf.tolist()  # python lists: ~10x faster to walk
    out: list[int] = []
    state = int(rng.integers(0, n_vocab))
    for is_noise, u_token, u_pick in zip(
        noisy.tolist(), uniform.tolist(), pick.tolist(), strict=True
    ):
        if is_noise:
            state = u_token
        else:
            slot = min(bisect.bisect_right(cdf_rows[state], u_pick), _MARKOV_BRANCHING - 1)
            state = succ[state][slot]
        out.append(state)
    return torch.tensor(out, dtype=torch.int64)
