"""The one perplexity protocol, llama-perplexity's (``tools/perplexity/perplexity.cpp``), and the
loops that apply it.

- **Tokens.** The text is tokenized once, BOS in front when the vocabulary adds it
  (``tokenizer.ggml.add_bos_token``), and cut into ``len(tokens) // n_ctx`` chunks of ``n_ctx``
  tokens; a text of fewer than ``2 * n_ctx`` tokens is refused, as llama.cpp refuses it.
- **Context.** Each chunk is evaluated alone from an empty cache, its first token replaced by BOS
  when the vocabulary adds BOS.
- **Scored positions.** Only the second half of each chunk: the logits at positions
  ``n_ctx // 2`` to ``n_ctx - 2`` predict the tokens at ``n_ctx // 2 + 1`` to ``n_ctx - 1``,
  ``n_ctx - 1 - n_ctx // 2`` predictions a chunk, each with at least ``n_ctx // 2`` tokens of
  context.
- **NLL.** ``max + log(sum(exp(logit - max))) - logit[token]`` per prediction, the sum of
  exponentials in float64 (:func:`token_nll`); PPL is ``exp(mean NLL)``.

``ggufswap perplexity``, the sweep's baseline and rounds (``ggufswap.sweep``) and the runtime's
perplexity mode (:mod:`.serve`) all score through :func:`token_nll` on these positions. All sums
run in float64 in a fixed order, so two evaluations of the same weights on CPU give the same
figure bit for bit.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ggufswap.logs import get_logger
from ggufswap.runtime.serving.errors import EvalTextError

if TYPE_CHECKING:
    from ggufswap.runtime.serving.tokenizer import GgufTokenizer

log = get_logger(__name__)

LanguageModel = Callable[[Tensor], Tensor]  # tokens [B, T] int64 -> logits [B, T, V]

# make_eval_tokens: each token has this many likely successors, and with this probability the
# next token is drawn uniformly instead (so every token stays possible and the NLL is finite).
_MARKOV_BRANCHING = 4
_MARKOV_NOISE = 0.05
_SLICE_ROWS = 16  # positions whose log-sum-exp is taken at once (16 x 262144 float32 = 16 MiB)
MIN_CTX = 4


def first_scored(n_ctx: int) -> int:
    """The first position whose logits are scored (llama-perplexity's ``first``)."""
    return n_ctx // 2


def scored_per_chunk(n_ctx: int) -> int:
    """Predictions scored in one chunk of ``n_ctx`` tokens."""
    return n_ctx - 1 - first_scored(n_ctx)


def text_tokens(tokenizer: GgufTokenizer, text: str) -> tuple[list[int], int | None]:
    """``(tokens, bos_id)``: the text tokenized as llama-perplexity does (BOS in front when the
    vocabulary adds it); ``bos_id`` is None when it does not."""
    bos = tokenizer.bos_id if tokenizer.vocab.add_bos else None
    ids = tokenizer.encode(text, add_bos=False, add_eos=False)
    return ([bos] if bos is not None else []) + list(ids), bos


def text_chunks(tokens: list[int], *, n_ctx: int, max_chunks: int | None = None) -> np.ndarray:
    """``[n_chunk, n_ctx]`` int32: the text's tokens (BOS included when the tokenizer adds it)
    cut as llama-perplexity cuts them; EvalTextError below two chunks' worth of tokens."""
    if n_ctx < MIN_CTX:
        raise EvalTextError(f"a context of {n_ctx} tokens is too small (need >= {MIN_CTX})")
    if len(tokens) < 2 * n_ctx:
        raise EvalTextError(
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


def log_sum_exp(logits: Tensor, max_logit: Tensor) -> Tensor:
    """float32 ``log(sum(exp(l - max)))`` of ``[N, V]`` logits, the sum in float64, as llama.cpp
    takes it."""
    shifted = logits - max_logit[:, None]
    return torch.exp_(shifted).sum(dim=1, dtype=torch.float64).log().float()


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """``[N]`` float64 NLL of float32 logits ``[N, V]`` for the tokens ``[N]`` they predict:
    llama.cpp's ``max + log_sum_exp - logit[token]``, in float32 as it computes it."""
    logits = logits.float()
    out = torch.empty(len(logits), dtype=torch.float64)
    for lo in range(0, len(logits), _SLICE_ROWS):
        x = logits[lo : lo + _SLICE_ROWS]  # [n, V]
        max_logit = x.max(dim=1).values
        picked = x.gather(1, targets[lo : lo + len(x)].long()[:, None])[:, 0]
        out[lo : lo + len(x)] = (max_logit + log_sum_exp(x, max_logit) - picked).double()
    return out


def scored_logits(logits: Tensor) -> Tensor:
    """``[B, T - 1 - T // 2, V]``: the logits of the scored positions of ``[B, T, V]`` logits."""
    n_ctx = logits.shape[1]
    return logits[:, first_scored(n_ctx) : n_ctx - 1]


def scored_targets(tokens: Tensor) -> Tensor:
    """``[B, T - 1 - T // 2]``: the tokens the scored positions of ``[B, T]`` tokens predict."""
    return tokens[:, first_scored(tokens.shape[1]) + 1 :]


@dataclass(frozen=True, slots=True)
class NllStats:
    """Summed next-token negative log-likelihood (nats) over ``n_tokens`` predictions."""

    nll_sum: float = 0.0
    n_tokens: int = 0
    n_batches: int = 0
    nll2_sum: float = 0.0  # sum of squares: the uncertainty llama-perplexity prints

    def __add__(self, other: NllStats) -> NllStats:
        return NllStats(
            self.nll_sum + other.nll_sum,
            self.n_tokens + other.n_tokens,
            self.n_batches + other.n_batches,
            self.nll2_sum + other.nll2_sum,
        )

    @classmethod
    def of(cls, nll: Tensor) -> NllStats:
        """The stats of one batch's ``[N]`` float64 NLLs."""
        return cls(float(nll.sum()), int(nll.numel()), 1, float((nll * nll).sum()))

    @property
    def mean_nll(self) -> float:
        if self.n_tokens == 0:
            raise ValueError("no tokens were scored: mean NLL is undefined")
        return self.nll_sum / self.n_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def perplexity_unc(self) -> float:
        """``PPL * sqrt(var(NLL) / (N - 1))``, llama-perplexity's ``+/-`` (0 below 2 tokens)."""
        if self.n_tokens < 2:
            return 0.0
        var = self.nll2_sum / self.n_tokens - self.mean_nll**2
        return self.perplexity * math.sqrt(var / (self.n_tokens - 1)) if var > 0 else 0.0


def batch_nll(model: LanguageModel, tokens: Tensor) -> NllStats:
    """NLL of the scored positions of one batch ``[B, T]`` (the second half of each row, as
    llama-perplexity scores a chunk); the rows are evaluated as given (BOS already in place)."""
    if tokens.dim() != 2 or tokens.shape[1] < MIN_CTX:
        raise ValueError(
            f"expected a token batch [B, T] with T >= {MIN_CTX}, found {list(tokens.shape)}"
        )
    with torch.inference_mode():
        logits = scored_logits(model(tokens)).float()  # [B, S, V]
        targets = scored_targets(tokens).to(logits.device)  # [B, S]
        return NllStats.of(token_nll(logits.flatten(0, 1).cpu(), targets.flatten().cpu()))


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
    """exp(mean NLL) over non-overlapping ``ctx`` windows of ``tokens`` (each window scores the
    second half of its predictions, :func:`batch_nll`)."""
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
