"""The reference runtime's inference loop: batches, with plans committed between them.

Two modes, both of which call :meth:`HotSwapRuntime.at_batch_boundary` before every batch and
record what each ``weight_version`` produced:

- ``probe``: every batch is the same fixed token batch; the loop records an xxh3 digest of its
  logits per version. A client compares it with a fresh load of the same files (bit-exactness
  across processes, without shipping logits).
- ``perplexity``: batches walk a deterministic evaluation stream cut in windows of ``eval_ctx``
  tokens, each scored as the one protocol scores a chunk (its second half,
  :func:`~.perplexity.batch_nll`: the figure ``ggufswap perplexity`` and the sweep give for the
  same tokens); a pass completed entirely on one version gives that version's perplexity (a pass
  interrupted by a commit starts over). The loop then runs no batch until the next commit (the
  same weights would give the same figure): it only wakes to commit. This is the per-expert
  sweep's measurement.

A third mode, ``http``, serves completions over HTTP instead of this loop (``runtime.generate``
and ``runtime.http``); its options live here too so that the daemon takes one options record.
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.errors import WeightsLost
from ggufswap.runtime.models.registry import Decoder
from ggufswap.runtime.serving.perplexity import NllStats, batch_nll, make_eval_tokens, token_windows
from ggufswap.shards import fingerprint_bytes

RESULTS_KEPT: Final = 256


class Mode(enum.Enum):
    PROBE = "probe"
    PERPLEXITY = "perplexity"
    HTTP = "http"


@dataclass(frozen=True)
class ServeOptions:
    mode: Mode = Mode.PROBE
    batch_interval_s: float = 0.01  # pause between batches (the loop still wakes to commit)
    probe_batch: int = 2
    probe_tokens: int = 16
    eval_tokens: int = 2048
    eval_ctx: int = 64
    eval_batch: int = 4
    seed: int = 0
    # http mode
    http_host: str = "127.0.0.1"
    http_port: int = 8000  # 0 picks a free port; status reports the bound one
    max_batch: int = 8
    max_queue: int = 64
    request_timeout_s: float = 60.0


def probe_tokens(n_vocab: int, *, batch: int, tokens: int) -> torch.Tensor:
    """The fixed probe batch: ``[batch, tokens]`` ids spread over the vocabulary."""
    ids = torch.arange(batch * tokens, dtype=torch.long) * 7919 % n_vocab
    return ids.reshape(batch, tokens)


def logits_digest(logits: torch.Tensor) -> str:
    """xxh3-128 of the float32 logits' bytes: equal digests mean bit-identical outputs."""
    flat = logits.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    return fingerprint_bytes(flat.numpy().data.cast("B"))


class ServeLoop:
    """Runs batches until ``stop`` is set; thread-safe ``status()`` for the control server."""

    def __init__(self, runtime: HotSwapRuntime, model: Decoder, *, options: ServeOptions) -> None:
        self.runtime = runtime
        self.model = model
        self.options = options
        n_vocab = model.config.n_vocab
        self._probe = probe_tokens(n_vocab, batch=options.probe_batch, tokens=options.probe_tokens)
        stream = make_eval_tokens(n_vocab, options.eval_tokens, options.seed)
        self._windows = token_windows(stream, ctx=options.eval_ctx, batch_size=options.eval_batch)
        self._lock = threading.Lock()
        self._results: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()
        self._digests: dict[int, set[str]] = {}
        self.batches = 0
        self.failed_batches = 0
        self.refused_batches = 0  # not run: served tensors were out of service (WeightsLost)
        self.last_batch_s: float | None = None
        self._pass_version: int | None = None
        self._pass_index = 0
        self._pass_stats = NllStats()
        self._measured_version: int | None = None  # perplexity: the last version a pass completed

    def run(self, stop: threading.Event, *, on_iteration: Callable[[], None] | None = None) -> None:
        while not stop.is_set():
            self.step()
            if on_iteration is not None:
                on_iteration()
            stop.wait(self.options.batch_interval_s)

    def step(self) -> int:
        """Commit what is staged, then run one batch; return the version it ran on (a batch
        is refused, not run, while served tensors are out of service: ``WeightsLost``)."""
        try:
            version = self.runtime.at_batch_boundary()
        except WeightsLost:  # logged by the runtime; a commit of the agent's plan ends it
            self.refused_batches += 1
            return self.runtime.weight_version
        if self.options.mode is Mode.PERPLEXITY and version == self._measured_version:
            return version  # measured: nothing to run until a commit changes the weights
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                if self.options.mode is Mode.PROBE:
                    digest = logits_digest(self.model(self._probe))
                    if not self.runtime.batch_intact():  # served bytes changed meanwhile
                        self.refused_batches += 1
                        return version
                    self._record(version, digest=digest)
                else:
                    self._perplexity_step(version)
        except Exception:
            self.failed_batches += 1
            raise
        self.last_batch_s = time.perf_counter() - started
        self.batches += 1
        return version

    def _perplexity_step(self, version: int) -> None:
        if version != self._pass_version:  # a commit interrupted the pass: start over
            self._pass_version, self._pass_index, self._pass_stats = version, 0, NllStats()
        stats = batch_nll(self.model, self._windows[self._pass_index])
        if not self.runtime.batch_intact():  # served bytes changed meanwhile: start over
            self._pass_version = -1
            self.refused_batches += 1
            return
        self._pass_stats = self._pass_stats + stats
        self._pass_index += 1
        if self._pass_index == len(self._windows):
            stats = self._pass_stats
            self._record(version, perplexity=stats.perplexity, tokens=stats.n_tokens)
            self._pass_index, self._pass_stats = 0, NllStats()
            self._measured_version = version

    def _record(self, version: int, **values: Any) -> None:
        with self._lock:
            entry = self._results.setdefault(version, {"batches": 0})
            digest = values.get("digest")
            if digest is not None:
                # One version must always give the same output: more than one distinct digest
                # for a version would mean a batch ran on a mix of weights.
                seen = self._digests.setdefault(version, set())
                seen.add(digest)
                entry["distinct_digests"] = len(seen)
            entry.update(values)
            entry["batches"] += 1
            self._results.move_to_end(version)
            while len(self._results) > RESULTS_KEPT:
                old, _ = self._results.popitem(last=False)
                self._digests.pop(old, None)

    def close(self) -> None:
        """Nothing to release (the daemon closes every serving mode the same way)."""

    def status(self) -> dict[str, Any]:
        with self._lock:
            results = {str(v): dict(r) for v, r in self._results.items()}
        return {
            "serve": {
                "mode": self.options.mode.value,
                "batches": self.batches,
                "failed_batches": self.failed_batches,
                "refused_batches": self.refused_batches,
                "last_batch_ms": None
                if self.last_batch_s is None
                else round(self.last_batch_s * 1e3, 3),
                "results": results,
            }
        }
