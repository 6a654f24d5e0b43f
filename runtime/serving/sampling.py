"""How the next token is chosen from a sequence's logits: the OpenAI and llama-server sampling
parameters, and the log-probabilities a response may carry.

The order is llama.cpp's and vLLM's: ``logit_bias``, then the penalties (``repetition_penalty``
over the prompt and the completion, ``frequency_penalty`` and ``presence_penalty`` over the
completion, as OpenAI defines them), then either the first maximal logit (``temperature == 0``,
greedy) or ``temperature``, ``top_k``, ``top_p``, ``min_p`` and a draw from a
``torch.Generator`` seeded from the request's ``seed``. Every parameter at its default leaves the
logits untouched, so a request that names only defaults gets exactly the text of one that names
none. Log-probabilities are those of the model's own distribution (``log_softmax`` of the raw
logits, as OpenAI and vLLM report them), whatever the sampler did after.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ggufswap.runtime.serving.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

MAX_TOP_LOGPROBS: Final = 20  # as OpenAI's chat API (completions: 5)
MAX_LOGIT_BIAS: Final = 100.0  # as OpenAI's API: a bias is within [-100, 100]


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How to decode one request. Defaults are the no-op of each parameter."""

    max_tokens: int | None = 16  # None: to the end of the model's context
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    n: int = 1  # completions per prompt

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, found {self.max_tokens}")
        if not self.temperature >= 0.0:
            problems.append(f"temperature must be >= 0, found {self.temperature}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0: off), found {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], found {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], found {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                problems.append(f"{name} must be in [-2, 2], found {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            problems.append(f"repetition_penalty must be > 0, found {self.repetition_penalty}")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            problems.append(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], found {self.logprobs}")
        if self.n < 1:
            problems.append(f"n must be >= 1, found {self.n}")
        if problems:
            raise InvalidRequest("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, log-probability and the ``k`` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def new_generator(sampling: Sampling, index: int) -> torch.Generator | None:
    """The sampler of one sequence (``index``: its place in the request), or None when greedy."""
    import torch  # here, not at import: the HTTP server's modules load without torch

    if sampling.greedy:
        return None
    generator = torch.Generator()
    seed = sampling.seed if sampling.seed is not None else random.SystemRandom().getrandbits(63)
    generator.manual_seed((seed + index) % (1 << 63))
    return generator


def pick(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    *,
    prompt: Sequence[int],
    completion: Sequence[int],
) -> tuple[int, TokenLogprob | None]:
    """The next token of a sequence and, if asked, its log-probabilities."""
    # logits: [V] float32, the model's raw output
    import torch

    processed = _processed(logits, sampling, prompt=prompt, completion=completion)
    if sampling.greedy or generator is None:
        token = int(torch.argmax(processed))  # the first maximal logit
    else:
        probs = _distribution(processed, sampling)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if sampling.logprobs is None:
        return token, None
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if sampling.logprobs > 0:
        values, ids = torch.topk(logprobs, sampling.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return token, TokenLogprob(token, float(logprobs[token]), top)


def _processed(
    logits: torch.Tensor, sampling: Sampling, *, prompt: Sequence[int], completion: Sequence[int]
) -> torch.Tensor:
    """The logits after ``logit_bias`` and the penalties (the input itself when all are off)."""
    import torch

    if not sampling.logit_bias and not sampling.penalised:
        return logits
    out = logits.clone()
    if sampling.logit_bias:
        ids = torch.tensor([i for i, _ in sampling.logit_bias], dtype=torch.long)
        out[ids] += torch.tensor([b for _, b in sampling.logit_bias], dtype=out.dtype)
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt, *completion}), dtype=torch.long)
        if len(seen):
            picked = out[seen]
            p = sampling.repetition_penalty
            out[seen] = torch.where(picked > 0, picked / p, picked * p)
    if completion and (sampling.frequency_penalty or sampling.presence_penalty):
        counts = torch.bincount(
            torch.tensor(completion, dtype=torch.long), minlength=out.shape[0]
        ).to(out.dtype)
        out -= counts * sampling.frequency_penalty + (counts > 0) * sampling.presence_penalty
    return out


def _distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The probabilities to draw from: temperature, then top-k, top-p and min-p."""
    import torch

    scaled = logits.double() / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the better tokens
        drop = order[before >= sampling.top_p]  # the first token is always kept
        probs = probs.index_fill(0, drop, 0.0)
    if sampling.min_p > 0.0:
        probs = probs.masked_fill(probs < sampling.min_p * probs.max(), 0.0)
    return probs
