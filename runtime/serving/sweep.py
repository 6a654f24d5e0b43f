"""The per-tensor quantization sweep: swap, measure against the baseline, restore, verify, record.

:class:`Sweep` drives one runtime and the model that reads its store, in this process:

1. the baseline: every chunk of the text (llama-perplexity's protocol, :mod:`.kld`) is evaluated
   once; its scored log-probabilities go to ``baseline.logits`` (llama.cpp's
   ``--kl-divergence-base`` format) and a digest of each chunk's logits to ``baseline.json``. A
   restart with the same model tensors, tokens and context reuses them.
2. per round (:class:`~.recipe.Round`): the quantized tensors are made or found
   (:mod:`.sweep_sources`), a plan loading them is submitted and committed, and the committed
   event must name exactly the round's tensors; the text is evaluated (PPL, KLD, ...); a plan
   loading the original records is committed (again exactly those names), and the first
   ``verify_chunks`` chunks are evaluated again: their logits must equal the baseline's bit for
   bit. Only then is the round appended to the journal (:class:`~.sweep_results.Journal`).
3. a round the runtime refuses (validation, staging) or that commits other tensors than asked is
   reported, never recorded; a restore that fails or does not reproduce the baseline stops the
   sweep (the model is no longer the one the baseline measured).

Tensors the model never computes with (loaded but not in ``model.required``) are skipped and
reported, as are locked tensors and targets equal to the tensor's own type.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType
from torch import Tensor

from ggufswap.config import Storage
from ggufswap.ipc import Event, Job, Plan, PlanCommittedEvent
from ggufswap.runtime import HotSwapRuntime, PlanState
from ggufswap.runtime.models import Decoder, HParams, build_model
from ggufswap.runtime.serving.kld import (
    BaseLogProbs,
    BaseLogProbsWriter,
    KldStats,
    encode_base_rows,
    eval_batch,
    first_scored,
    logits_digest,
    text_chunks,
)
from ggufswap.runtime.serving.recipe import Recipe, Round, Skip, plan_rounds, qtype_name
from ggufswap.runtime.serving.sweep_results import JOURNAL, Journal, write_csvs, write_text
from ggufswap.runtime.serving.sweep_sources import SourceError, TensorSources
from ggufswap.runtime.serving.tokenizer import GgufTokenizer
from ggufswap.shards import ShardSet, TensorRecord, open_shard_set

log = structlog.get_logger(__name__)

BASELINE_LOGITS: Final = "baseline.logits"
BASELINE_JSON: Final = "baseline.json"
REPORT_JSON: Final = "report.json"
COMMIT_TIMEOUT_S: Final = 120.0


class SweepError(RuntimeError):
    """The sweep cannot go on (the model no longer matches its baseline, a restore failed, the
    output directory belongs to another sweep); the message says what was found."""


class RoundRefused(Exception):
    """A round that cannot be measured; the sweep reports it and goes on."""


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    n_ctx: int = 512
    max_chunks: int | None = None  # None: every chunk the text fills
    verify_chunks: int = 1  # chunks re-evaluated after each restore; 0: all
    commit_timeout_s: float = COMMIT_TIMEOUT_S
    storage: Storage = Storage.DEQUANTIZED


@dataclass(kw_only=True)
class SweepReport:
    out_dir: Path
    ppl_base: float
    rounds_planned: int
    recorded: list[dict[str, Any]] = field(default_factory=list)  # this run's new rounds
    resumed: int = 0  # rounds found in the journal and not repeated
    skipped: list[Skip] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    journal: dict[str, dict[str, Any]] = field(default_factory=dict)  # every verified round


Progress = Callable[[Iterator[Round], int], Iterator[Round]]


def _no_progress(rounds: Iterator[Round], total: int) -> Iterator[Round]:
    return rounds


class Sweep:
    """One sweep over ``runtime`` (its store read by ``model``) in ``out_dir``."""

    def __init__(
        self,
        *,
        runtime: HotSwapRuntime,
        model: Decoder,
        chunks: np.ndarray,
        bos_id: int | None,
        recipe: Recipe,
        sources: TensorSources,
        out_dir: Path,
        options: SweepOptions,
        progress: Progress = _no_progress,
    ) -> None:
        assert runtime.shards is not None, "the sweep needs a runtime opened from files"
        self.runtime = runtime
        self.model = model
        self.chunks = chunks  # [C, n_ctx] the text's tokens
        self.batch = eval_batch(chunks, bos_id)  # [C, n_ctx] as evaluated
        self.recipe = recipe
        self.sources = sources
        self.out_dir = out_dir
        self.options = options
        self.progress = progress
        self.originals: dict[str, TensorRecord] = dict(runtime.shards.tensors)
        self._committed: dict[str, PlanCommittedEvent] = {}
        runtime.on_event(self._on_event)
        out_dir.mkdir(parents=True, exist_ok=True)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, PlanCommittedEvent):
            self._committed[event.plan_id] = event

    # -- evaluation --------------------------------------------------------------------------

    def _scored_logits(self, chunk: int) -> Tensor:
        """``[n_ctx - 1 - n_ctx // 2, V]`` float32 logits of one chunk's scored positions."""
        n_ctx = self.chunks.shape[1]
        with torch.inference_mode():
            logits = self.model(self.batch[chunk : chunk + 1])  # [1, n_ctx, V]
            return logits[0, first_scored(n_ctx) : n_ctx - 1].float()

    def _targets(self, chunk: int) -> Tensor:
        first = first_scored(self.chunks.shape[1])
        return torch.from_numpy(self.chunks[chunk, first + 1 :].astype(np.int64))

    def _identity(self) -> dict[str, Any]:
        """What the baseline depends on: the loaded tensors (name, type, shape), the tokens."""
        table = hashlib.sha256()
        for name in sorted(self.originals):
            rec = self.originals[name]
            table.update(f"{name}:{rec.ggml_type.name}:{list(rec.ne)}\n".encode())
        return {
            "tensors_sha256": table.hexdigest(),
            "tokens_sha256": hashlib.sha256(self.chunks.astype("<i4").tobytes()).hexdigest(),
            "n_ctx": int(self.chunks.shape[1]),
            "n_chunk": int(self.chunks.shape[0]),
        }

    def baseline(self) -> dict[str, Any]:
        """The baseline's record (computed now, or reused when it matches this sweep)."""
        path = self.out_dir / BASELINE_JSON
        identity = self._identity()
        if path.exists() and (self.out_dir / BASELINE_LOGITS).exists():
            stored = json.loads(path.read_text())
            if stored.get("identity") == identity:
                return dict(stored)
            if (self.out_dir / JOURNAL).exists():
                raise SweepError(
                    f"{self.out_dir} holds the sweep of another model, text or context "
                    f"({path}: {stored.get('identity')} != {identity}); use a new --out"
                )
        started = time.perf_counter()
        n_vocab: int | None = None
        writer: BaseLogProbsWriter | None = None
        digests, nll_sum, count = [], 0.0, 0
        for c in range(len(self.chunks)):
            logits = self._scored_logits(c)
            if writer is None:
                n_vocab = int(logits.shape[1])
                tmp = self.out_dir / f".{BASELINE_LOGITS}.tmp"
                writer = BaseLogProbsWriter(tmp, chunks=self.chunks, n_vocab=n_vocab)
            rows, nll = encode_base_rows(logits, self._targets(c))
            writer.write_chunk(rows)
            digests.append(logits_digest(logits))
            nll_sum += float(nll.sum())
            count += len(nll)
        assert writer is not None, "text_chunks gives at least two chunks"
        writer.close()
        writer.path.replace(self.out_dir / BASELINE_LOGITS)
        record = {
            "identity": identity,
            "n_vocab": n_vocab,
            "ppl": float(np.exp(nll_sum / count)),
            "count": count,
            "digests": digests,
            "eval_s": round(time.perf_counter() - started, 3),
        }
        write_text(path, json.dumps(record, indent=1) + "\n")
        log.info("sweep.baseline", ppl=record["ppl"], chunks=len(digests), eval_s=record["eval_s"])
        return record

    def _measure(self, base: BaseLogProbs) -> dict[str, Any]:
        stats = KldStats()
        for c in range(len(self.chunks)):
            stats.add(self._scored_logits(c), base.rows(c), self._targets(c))
        return asdict(stats.result())

    def _verify_restore(self, digests: list[str], unit: str) -> None:
        n = self.options.verify_chunks or len(self.chunks)
        for c in range(min(n, len(self.chunks))):
            got = logits_digest(self._scored_logits(c))
            if got != digests[c]:
                raise SweepError(
                    f"after restoring {unit}, chunk {c}'s logits differ from the baseline's "
                    f"(digest {got} != {digests[c]}): the model is not back to its original "
                    "weights; stopping (the journal holds every round verified so far)"
                )

    # -- plans -------------------------------------------------------------------------------

    def _commit(self, jobs: tuple[Job, ...], expect: frozenset[str], what: str) -> tuple[int, str]:
        """Submit and commit a plan; ``(weight_version, plan_id)``. RoundRefused when refused or
        when the commit changed other tensors than ``expect``."""
        plan = Plan(plan_id=uuid.uuid4().hex, model=self.runtime.model_name, jobs=jobs)
        ticket = self.runtime.submit(plan)
        deadline = time.monotonic() + self.options.commit_timeout_s
        while not ticket.state.final:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SweepError(
                    f"{what}: plan {plan.plan_id} not committed within "
                    f"{self.options.commit_timeout_s:.0f} s (state {ticket.state.value})"
                )
            self.runtime.wait_staged(timeout=min(remaining, 1.0))
            self.runtime.at_batch_boundary()
        if ticket.state is PlanState.REJECTED:
            reasons = "; ".join(f"{r.tensor}: {r.reason}" for r in ticket.reasons)
            raise RoundRefused(f"{what}: the runtime refused the plan: {reasons}")
        event = self._committed.pop(plan.plan_id, None)
        if event is None:
            raise SweepError(f"{what}: plan {plan.plan_id} committed without a plan.committed")
        changed = frozenset(event.changed)
        if changed != expect:
            raise RoundRefused(
                f"{what}: the commit changed {sorted(changed)}, expected exactly {sorted(expect)}"
            )
        return event.weight_version, plan.plan_id

    def _restore(self, names: tuple[str, ...], unit: str) -> tuple[int, str]:
        jobs = tuple(Job(self.originals[n]) for n in names)
        try:
            return self._commit(jobs, frozenset(names), f"restore of {unit}")
        except RoundRefused as exc:
            raise SweepError(f"{exc}; the model is no longer at its baseline, stopping") from None

    # -- rounds ------------------------------------------------------------------------------

    def run_round(
        self, r: Round, base: BaseLogProbs, digests: list[str], ppl_base: float
    ) -> dict[str, Any]:
        """Swap, measure, restore, verify; the journal record (RoundRefused: nothing changed)."""
        t0 = time.perf_counter()
        try:
            records = [self.sources.record(n, r.target) for n in r.tensors]
        except SourceError as exc:
            raise RoundRefused(str(exc)) from None
        t1 = time.perf_counter()
        try:
            version, plan_id = self._commit(
                tuple(Job(rec) for rec in records), frozenset(r.tensors), f"swap of {r.key}"
            )
        except RoundRefused:
            # A commit of other tensors than asked did happen: put the originals back first.
            if any(self.runtime.store.slots[n].record != self.originals[n] for n in r.tensors):
                self._restore(r.tensors, r.unit)
                self._verify_restore(digests, r.unit)
            raise
        t2 = time.perf_counter()
        metrics = self._measure(base)
        t3 = time.perf_counter()
        restored_version, restore_plan = self._restore(r.tensors, r.unit)
        t4 = time.perf_counter()
        self._verify_restore(digests, r.unit)
        t5 = time.perf_counter()
        return {
            "key": r.key,
            "unit": r.unit,
            "qtype": qtype_name(r.target),
            "tensors": list(r.tensors),
            "from_types": [self.originals[n].ggml_type.name for n in r.tensors],
            "sources": [rec.path for rec in records],
            "bytes": sum(rec.nbytes for rec in records),
            "ppl_base": ppl_base,
            "metrics": metrics,
            "weight_version": version,
            "restored_version": restored_version,
            "plan_id": plan_id,
            "restore_plan_id": restore_plan,
            "verified_chunks": min(self.options.verify_chunks or len(self.chunks), len(digests)),
            "timings": {
                "prepare_s": round(t1 - t0, 4),
                "swap_s": round(t2 - t1, 4),
                "eval_s": round(t3 - t2, 4),
                "restore_s": round(t4 - t3, 4),
                "verify_s": round(t5 - t4, 4),
            },
            "recorded_at": time.time(),
        }

    def run(self) -> SweepReport:
        required = frozenset(self.model.required)
        types = {n: rec.ggml_type for n, rec in self.originals.items()}
        rounds, skipped = plan_rounds(self.recipe, self.originals, computed=required, types=types)
        base_record = self.baseline()
        base = BaseLogProbs(self.out_dir / BASELINE_LOGITS)
        journal = Journal(self.out_dir / JOURNAL)
        report = SweepReport(
            out_dir=self.out_dir,
            ppl_base=float(base_record["ppl"]),
            rounds_planned=len(rounds),
            skipped=skipped,
        )
        todo = [r for r in rounds if r.key not in journal]
        report.resumed = len(rounds) - len(todo)
        for r in self.progress(iter(todo), len(todo)):
            try:
                record = self.run_round(r, base, base_record["digests"], report.ppl_base)
            except RoundRefused as exc:
                report.refused.append({"key": r.key, "tensors": list(r.tensors), "why": str(exc)})
                log.warning("sweep.round_refused", round=r.key, why=str(exc))
                continue
            journal.append(record)
            report.recorded.append(record)
            write_csvs(self.out_dir, journal.records.values())
            log.info("sweep.round", round=r.key, kld=record["metrics"]["kld_mean"])
        report.journal = dict(journal.records)
        write_csvs(self.out_dir, journal.records.values())
        summary = {
            "ppl_base": report.ppl_base,
            "rounds_planned": report.rounds_planned,
            "recorded": len(journal.records),
            "resumed": report.resumed,
            "skipped": [asdict(s) for s in report.skipped],
            "refused": report.refused,
        }
        write_text(self.out_dir / REPORT_JSON, json.dumps(summary, indent=1) + "\n")
        return report


def text_tokens(tokenizer: GgufTokenizer, text: str) -> tuple[list[int], int | None]:
    """``(tokens, bos_id)``: the text tokenized as llama-perplexity does (BOS in front when the
    vocabulary adds it); ``bos_id`` is None when it does not."""
    bos = tokenizer.bos_id if tokenizer.vocab.add_bos else None
    ids = tokenizer.encode(text, add_bos=False, add_eos=False)
    return ([bos] if bos is not None else []) + ids, bos


def run_sweep(
    model_path: str | os.PathLike[str],
    *,
    text: str,
    recipe: Recipe,
    out_dir: Path,
    options: SweepOptions,
    models: Mapping[GGMLQuantizationType, ShardSet] | None = None,
    progress: Progress = _no_progress,
    announce: Callable[[str], None] | None = None,
) -> SweepReport:
    """Load ``model_path`` in this process and run the whole sweep (the library's one call).

    The runtime may read the model's own directories, the scratch directory under ``out_dir``
    and those of the ``models`` given as sources; nothing else, and it never writes the model.
    """
    shards = open_shard_set(model_path)
    sources = TensorSources(scratch=out_dir / "scratch", originals=shards.tensors, models=models)
    roots = sorted({os.path.dirname(p) for p in shards.paths} | set(sources.roots))
    runtime = HotSwapRuntime.open(model_path, storage=options.storage, allowed_roots=roots)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        hparams = HParams.from_metadata(runtime.shards.metadata)
        model = build_model(hparams, runtime.store, store=runtime.store)
        tokens, bos = text_tokens(GgufTokenizer.from_file(runtime.shards.first.path), text)
        n_ctx = min(options.n_ctx, hparams.context_length)
        chunks = text_chunks(tokens, n_ctx=n_ctx, max_chunks=options.max_chunks)
        if announce is not None:
            announce(
                f"{runtime.model_name}: {len(chunks)} chunks of {n_ctx} tokens "
                f"({n_ctx - 1 - first_scored(n_ctx)} scored each), results in {out_dir}"
            )
        sweep = Sweep(
            runtime=runtime,
            model=model,
            chunks=chunks,
            bos_id=bos,
            recipe=recipe,
            sources=sources,
            out_dir=out_dir,
            options=options,
            progress=progress,
        )
        return sweep.run()
    finally:
        runtime.close()
