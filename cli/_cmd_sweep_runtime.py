"""``ggufswap sweep-runtime``: the runtime process of ``ggufswap sweep --config``.

Loads the model as the config's ``runtime`` section says, computes (or reuses) the sweep's
baseline in ``--out`` with the same :class:`~ggufswap.runtime.serving.sweep_eval.ChunkEvaluator`
as the in-process sweep, serves the control endpoint (the agent sends plans to it) and, after
every committed plan, evaluates the text again: the figures against the baseline and the digest
of each chunk's logits are reported per weight version under ``sweep.results`` in ``status``.
Plans are committed only between two evaluations, so each result belongs to one version.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any, Final

from ggufswap._cmd_runtime import add_threads_option
from ggufswap._signals import ProcessSignals

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
WAKE_S: Final = 0.5
KEPT_RESULTS: Final = 16  # weight versions whose results status keeps


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep-runtime",
        help="the runtime process of `ggufswap sweep --config` (evaluates every weight version)",
    )
    parser.add_argument("--config", required=True, metavar="FILE")
    parser.add_argument("--text", required=True, metavar="FILE")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")
    parser.add_argument("--ctx", type=int, required=True, metavar="N")
    parser.add_argument("--chunks", type=int, metavar="N")
    parser.add_argument("--numerics", choices=("exact", "ggml"), default="exact")
    add_threads_option(parser)
    parser.set_defaults(func=run)


class _Results:
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


def run(args: argparse.Namespace) -> int:
    """Size: being reworked by issue 24; split there."""
    from ggufswap.config import ConfigError, load_config
    from ggufswap.ipc import Event, PlanStagedEvent
    from ggufswap.runtime.control import ControlServer
    from ggufswap.runtime.models import HParams, ModelError, Numerics, build_model
    from ggufswap.runtime.serving import GgufTokenizer
    from ggufswap.runtime.serving.daemon import open_runtime
    from ggufswap.runtime.serving.kld import BaseLogProbs, KldError, text_chunks
    from ggufswap.runtime.serving.sweep import text_tokens
    from ggufswap.runtime.serving.sweep_eval import (
        BASELINE_LOGITS,
        BaselineMismatch,
        ChunkEvaluator,
    )
    from ggufswap.runtime.threads import apply_thread_policy, resolve_threads

    try:
        config = load_config(args.config)
        rc = config.require_runtime()
        text = Path(args.text).read_text(encoding="utf-8")
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        print(f"ggufswap sweep-runtime: {exc}", file=sys.stderr)
        return EXIT_FAILED
    apply_thread_policy(resolve_threads(flag=args.threads, config=rc.threads))
    signals = ProcessSignals().install()
    runtime = open_runtime(config)
    results = _Results()
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        hparams = HParams.from_metadata(runtime.shards.metadata, source=runtime.shards.first.path)
        numerics = Numerics(args.numerics)
        model = build_model(hparams, runtime.store, store=runtime.store, numerics=numerics)
        tokens, bos = text_tokens(GgufTokenizer.from_file(runtime.shards.first.path), text)
        chunks = text_chunks(
            tokens, n_ctx=min(args.ctx, hparams.context_length), max_chunks=args.chunks
        )
        evaluator = ChunkEvaluator(model, chunks, bos, numerics=numerics)
        args.out.mkdir(parents=True, exist_ok=True)
        baseline = evaluator.baseline(args.out, runtime.shards.tensors)
        base = BaseLogProbs(args.out / BASELINE_LOGITS)
    except (BaselineMismatch, KldError, ModelError) as exc:
        runtime.close()
        print(f"ggufswap sweep-runtime: {exc}", file=sys.stderr)
        return EXIT_FAILED
    staged = threading.Event()

    def on_event(event: Event) -> None:
        if isinstance(event, PlanStagedEvent):
            staged.set()

    runtime.on_event(on_event)
    version = runtime.weight_version
    results.add(version, {"metrics": None, "digests": baseline["digests"]})
    results.update(ready=True, ppl_base=baseline["ppl"], required=sorted(model.required))
    control = ControlServer.from_config(runtime, config, extra_status=results.status).start()
    try:
        while not signals.stop.is_set():
            if not staged.wait(WAKE_S):
                continue
            staged.clear()
            runtime.at_batch_boundary()  # between two evaluations: each runs on one version
            if runtime.weight_version != version:
                version = runtime.weight_version
                metrics, digests = evaluator.measure(base)
                results.add(version, {"metrics": metrics, "digests": digests})
    finally:
        control.close()
        runtime.close()
    return EXIT_OK
