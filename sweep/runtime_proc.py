"""The runtime process of ``ggufswap sweep --config`` (``ggufswap sweep-runtime``).

Loads the model as the config's ``runtime`` section says, computes (or reuses) the sweep's
baseline in ``OUT`` with the same :class:`~.evaluate.ChunkEvaluator` as the in-process sweep,
serves the control endpoint (the agent sends plans to it) and, after every committed plan,
evaluates the text again: the figures against the baseline and the digest of each chunk's
logits are reported per weight version under ``sweep.results`` in ``status``. A version whose
every tensor is back at its original fingerprint (a restore) is only checked: the digests of its
first ``verify_chunks`` chunks, as the in-process restore check. Plans are committed only between
two evaluations, so each result belongs to one version.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Final

from ggufswap.config import Config
from ggufswap.ipc import Event, PlanStagedEvent
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.control import ControlServer
from ggufswap.runtime.models import HParams, Numerics
from ggufswap.runtime.serving.perplexity import text_chunks, text_tokens
from ggufswap.runtime.serving.tokenizer import GgufTokenizer
from ggufswap.runtime.serving.tokenizer_cache import cache_dir
from ggufswap.sweep.basefile import BaseLogProbs
from ggufswap.sweep.evaluate import BASELINE_LOGITS, ChunkEvaluator
from ggufswap.sweep.inprocess import _baseline_evaluator, decoder_of

WAKE_S: Final = 0.5
KEPT_RESULTS: Final = 16  # weight versions whose results status keeps


class Results:
    """What status reports: readiness, the baseline, the figures of recent weight versions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._doc: dict[str, Any] = {"ready": False, "results": {}}

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._doc.update(fields)

    def add(self, version: int, result: dict[str, Any]) -> None:
        with self._lock:
            results = self._doc["results"]
            results[str(version)] = result
            for old in sorted(results, key=int)[:-KEPT_RESULTS]:
                del results[old]

    def status(self) -> dict[str, Any]:
        with self._lock:
            doc = dict(self._doc)
            doc["results"] = dict(doc["results"])
        return {"sweep": doc}


def at_baseline(runtime: HotSwapRuntime) -> bool:
    """Whether every tensor holds its original content (the model the baseline measured)."""
    return all(s.fingerprint == s.original_fingerprint for s in runtime.store.slots.values())


def prepare(
    runtime: HotSwapRuntime,
    *,
    text: str,
    out: Path,
    n_ctx: int,
    max_chunks: int | None,
    numerics: Numerics,
    baseline_model: str | None,
    model_path: str,
) -> tuple[ChunkEvaluator, dict[str, Any], BaseLogProbs]:
    """The evaluator, the baseline record (computed or reused) and its base file."""
    assert runtime.shards is not None, "open() keeps the shard set"
    model = decoder_of(runtime, numerics.value)
    hparams = HParams.from_metadata(runtime.shards.metadata)
    tokens, bos = text_tokens(
        GgufTokenizer.from_file(runtime.shards.first.path, cache=cache_dir()), text
    )
    chunks = text_chunks(tokens, n_ctx=min(n_ctx, hparams.context_length), max_chunks=max_chunks)
    evaluator = ChunkEvaluator(
        model, chunks, bos, numerics=numerics, storage=runtime.store.storage, source=model_path,
        text=text,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    if baseline_model is None:
        baseline = evaluator.baseline(out, runtime.shards.tensors)
    else:
        with _baseline_evaluator(baseline_model, evaluator) as base_eval:
            baseline = evaluator.baseline(out, runtime.shards.tensors, base=base_eval)
    return evaluator, baseline, BaseLogProbs(out / BASELINE_LOGITS)


def serve(
    runtime: HotSwapRuntime,
    config: Config,
    evaluator: ChunkEvaluator,
    baseline: dict[str, Any],
    base: BaseLogProbs,
    *,
    verify_chunks: int,
    stop: threading.Event,
) -> None:
    """Serve the control endpoint; evaluate every committed weight version until ``stop``."""
    staged = threading.Event()

    def on_event(event: Event) -> None:
        if isinstance(event, PlanStagedEvent):
            staged.set()

    runtime.on_event(on_event)
    results = Results()
    version = runtime.weight_version
    results.add(version, {"metrics": None, "digests": baseline["digests"]})
    results.update(ready=True, ppl_base=baseline["ppl"], required=sorted(evaluator.model.required))
    control = ControlServer.from_config(runtime, config, extra_status=results.status).start()
    try:
        while not stop.is_set():
            if not staged.wait(WAKE_S):
                continue
            staged.clear()
            runtime.at_batch_boundary()  # between two evaluations: each runs on one version
            if runtime.weight_version == version:
                continue
            version = runtime.weight_version
            if at_baseline(runtime):  # a restore: the restore check's chunks only
                results.add(version, {"metrics": None, "digests": evaluator.digests(verify_chunks)})
            else:
                metrics, digests = evaluator.measure(base)
                results.add(version, {"metrics": metrics, "digests": digests})
    finally:
        control.close()
