"""A worker of the Ray sweep (:mod:`.ray_driver`): one Ray actor holding an in-process runtime over
its node's copy of the model, its own baseline, and :meth:`.sweep.Sweep.run_round`.

The worker computes the baseline itself, on its node, with the single-host sweep's code
(:meth:`.inprocess.InProcessTarget.baseline`, reused from its work directory when that holds the
same one): the baseline's log-probabilities never pass through the driver, which compares what
each worker reports (:func:`baseline_mismatch`: the record, the digest of every chunk's logits,
the base file's sha256) and copies one worker's base file into ``--out`` piece by piece
(:meth:`SweepWorker.read_baseline`).

Ray restarts a worker that died (``max_restarts``) with the same arguments, and retries the round
it held on the replacement (``max_task_retries``). The replacement knows it is one
(``was_current_actor_reconstructed``), loads its baseline again before its first round and
checks it against the sweep's; the round marker it finds in its work directory counts the
round's attempts.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import ray

from ggufswap.sweep.basefile import BaseLogProbs
from ggufswap.sweep.errors import RoundRefused, SweepError
from ggufswap.sweep.evaluate import BASELINE_LOGITS
from ggufswap.sweep.recipe import Recipe, Round, Skip
from ggufswap.sweep.results import write_text
from ggufswap.sweep.sweep import SweepOptions

CURRENT_ROUND: Final = "current_round"  # in a worker's work dir: "key attempt" of the round held
PIECE_BYTES: Final = 8 << 20  # the base file is copied to the driver in pieces of this size
# What two baselines must agree on: what they measured (the tensor table, the tokens, ctx and
# chunks, the numerics) and what they computed. Not eval_s (the time it took) nor the protocol's
# paths, spelled as each run was given them (a single-host sweep resumed with --ray).
SAME_BASELINE: Final = (
    "identity", "numerics", "n_vocab", "ppl", "ppl_unc", "count", "digests", "model_vs_baseline",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker process, as it reports itself (a restarted worker has a new ``pid``)."""

    name: str
    node_id: str
    host: str
    pid: int
    work_dir: str
    restarted: bool = False  # Ray restarted this worker after its predecessor died


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(PIECE_BYTES):
            digest.update(piece)
    return digest.hexdigest()


def baseline_mismatch(got: Mapping[str, Any], expect: Mapping[str, Any]) -> str | None:
    """Why the baseline ``got`` (a :meth:`SweepWorker.baseline` answer) is not ``expect``, or
    None when it is the same: the first differing chunk digest, else the fields that differ."""
    ours, theirs = got["record"], expect["record"]
    for c, (a, b) in enumerate(zip(ours["digests"], theirs["digests"], strict=False)):
        if a != b:
            return f"chunk {c}'s logits differ from the baseline's (digest {a} != {b})"
    fields = [k for k in SAME_BASELINE if ours.get(k) != theirs.get(k)]
    if got["sha256"] != expect["sha256"]:
        fields.append(f"{BASELINE_LOGITS} sha256 {got['sha256']} != {expect['sha256']}")
    return f"the baseline differs in {', '.join(fields)}" if fields else None


class SweepWorker:
    """One Ray actor: an in-process runtime over the node-local model, running rounds."""

    def __init__(self, *, name: str, work_dir: str, **kwargs: Any) -> None:
        # Never raises: an actor whose __init__ raised only says so in its next call's error,
        # whose exception may not even unpickle in the driver; describe() reports it instead.
        self.name = name
        self.work_dir = Path(work_dir)
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.error: str | None = None
        self.base: BaseLogProbs | None = None
        self.record: dict[str, Any] = {}
        try:
            self._open(**kwargs)
        except Exception as exc:  # noqa: BLE001 (reported by describe, the sweep stops)
            self.error = f"{type(exc).__name__}: {exc}"

    def _open(
        self,
        *,
        model_path: str,
        text: str,
        options: SweepOptions,
        recipe: Recipe,
        threads: int | None,
        cpu: int | None,
        sources: Mapping[int, str],
        baseline_model: str | None,
        imatrix: str | None,
    ) -> None:
        # torch is imported by the worker only (the driver holds no model)
        from ggufswap.runtime import HotSwapRuntime
        from ggufswap.runtime.threads import apply_thread_policy, resolve_threads
        from ggufswap.shards import open_shard_set
        from ggufswap.sweep.inprocess import (
            InProcessTarget,
            open_sources,
            select_products,
            sweep_types,
        )
        from ggufswap.sweep.suite_dir import open_source
        from ggufswap.sweep.sweep import Sweep

        if cpu is not None:
            mask = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {mask[cpu % len(mask)]})
        apply_thread_policy(resolve_threads(flag=threads, environ={}))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if not self.restarted:  # a replacement keeps its predecessor's marker: a retried round
            (self.work_dir / CURRENT_ROUND).unlink(missing_ok=True)
        shards = open_shard_set(model_path)
        select_products(options.numerics, options.ggml, sweep_types(shards.tensors, recipe))
        models = {int(t): open_source(p, t) for t, p in sources.items()}
        self.sources = open_sources(
            model_path, out_dir=self.work_dir, originals=shards.tensors, models=models,
            imatrix=Path(imatrix) if imatrix is not None else None,
        )  # fmt: skip
        roots = sorted({os.path.dirname(p) for p in shards.paths} | set(self.sources.roots))
        self.runtime = HotSwapRuntime.open(model_path, storage=options.storage, allowed_roots=roots)
        self.evaluator = self._evaluator(model_path, text, options)
        self.target = InProcessTarget(
            runtime=self.runtime,
            evaluator=self.evaluator,
            sources=self.sources,
            out_dir=self.work_dir,
            commit_timeout_s=options.commit_timeout_s,
            baseline_model=baseline_model,
        )
        self.sweep = Sweep(
            target=self.target, recipe=recipe, out_dir=self.work_dir, options=options
        )

    def _evaluator(self, model_path: str, text: str, options: SweepOptions) -> Any:
        """The text's chunks over the runtime's model, as ``run_sweep`` makes them."""
        from ggufswap.runtime.models import HParams
        from ggufswap.runtime.serving.perplexity import text_chunks, text_tokens
        from ggufswap.runtime.serving.tokenizer import GgufTokenizer
        from ggufswap.runtime.serving.tokenizer_cache import cache_dir
        from ggufswap.sweep.evaluate import ChunkEvaluator
        from ggufswap.sweep.inprocess import decoder_of

        shards = self.runtime.shards
        assert shards is not None, "open() keeps the shard set"
        hparams = HParams.from_metadata(shards.metadata, source=shards.first.path)
        model = decoder_of(self.runtime, options.numerics.value)
        tokens, bos = text_tokens(
            GgufTokenizer.from_file(shards.first.path, cache=cache_dir()), text
        )
        n_ctx = min(options.n_ctx, hparams.context_length)
        chunks = text_chunks(tokens, n_ctx=n_ctx, max_chunks=options.max_chunks)
        return ChunkEvaluator(
            model, chunks, bos, numerics=options.numerics, storage=options.storage,
            source=model_path, text=text,
        )  # fmt: skip

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            name=self.name,
            node_id=ray.get_runtime_context().get_node_id(),
            host=socket.gethostname(),
            pid=os.getpid(),
            work_dir=str(self.work_dir),
            restarted=self.restarted,
        )

    def describe(self) -> dict[str, Any]:
        """Who and where this worker is, and what it loaded (the driver compares them), or
        ``error``: why it could not load it."""
        if self.error is not None:
            return {"info": self.info(), "error": self.error}
        return {
            "info": self.info(),
            "error": None,
            "identity": self.evaluator.identity(self.target.originals),
            "originals": dict(self.target.originals),
            "model_name": self.runtime.model_name,
        }

    def plan(self) -> tuple[list[Round], list[Skip]]:
        """The sweep's rounds and skips, checked as on one host (a source for every target
        type; ggml numerics that know every type): SweepError otherwise."""
        return self.sweep.plan()

    def baseline(self) -> dict[str, Any]:
        """The baseline, evaluated on this node (or this work directory's, when it holds the
        same): ``{"record": baseline.json's record, "sha256": of baseline.logits, "bytes"}``."""
        self.record = self.target.baseline()
        path = self.work_dir / BASELINE_LOGITS
        self.base = BaseLogProbs(path)
        return {"record": self.record, "sha256": file_sha256(path), "bytes": path.stat().st_size}

    def read_baseline(self, offset: int) -> bytes:
        """``PIECE_BYTES`` of this worker's base file from ``offset`` (b"" past its end)."""
        with (self.work_dir / BASELINE_LOGITS).open("rb") as f:
            f.seek(offset)
            return f.read(PIECE_BYTES)

    def _attempt(self, key: str) -> int:
        """This round's attempt: 1, or one more than the marker a dead predecessor left."""
        marker = self.work_dir / CURRENT_ROUND
        held, _, attempt = marker.read_text().partition(" ") if marker.exists() else ("", "", "")
        n = int(attempt) + 1 if held == key and attempt.isdigit() else 1
        write_text(marker, f"{key} {n}")
        return n

    def run_round(self, r: Round, expect: Mapping[str, Any]) -> tuple[str, Any, dict[str, Any]]:
        """``(outcome, payload, about)``: ``("recorded", record)``, ``("refused", why)`` or
        ``("failed", why)`` (the model is not back to its baseline, or a replacement cannot
        load the sweep's: the sweep must stop); ``about``: this worker and the attempt.
        ``expect``: the sweep's baseline, as :meth:`baseline` answers it."""
        about = {"worker": asdict(self.info()), "attempt": 1}
        if self.error is not None:
            return "failed", f"worker {self.name} (restarted) cannot load: {self.error}", about
        if self.base is None:  # a replacement Ray started: its baseline first
            why = baseline_mismatch(self.baseline(), expect)
            if why is not None:
                where = f"worker {self.name} (restarted on {socket.gethostname()})"
                return "failed", f"{where}: {why}", about
        assert self.base is not None, "baseline() sets it"
        about["attempt"] = self._attempt(r.key)
        try:
            record = self.sweep.run_round(
                r, self.base, self.record["digests"], float(self.record["ppl"])
            )
        except RoundRefused as exc:
            return "refused", str(exc), about
        except SweepError as exc:
            return "failed", f"worker {self.name}: {exc}", about
        except Exception as exc:  # noqa: BLE001 (the model may be left swapped: stop)
            return "failed", f"worker {self.name}: {r.key}: {type(exc).__name__}: {exc}", about
        finally:
            (self.work_dir / CURRENT_ROUND).unlink(missing_ok=True)
        record["worker"] = about["worker"]
        return "recorded", record, about

    def close(self) -> None:
        self.runtime.close()
