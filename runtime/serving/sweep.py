"""The per-tensor quantization sweep: swap, measure against the baseline, restore, verify, record.

:class:`Sweep` is the one implementation of a sweep; what it drives is a :class:`SweepTarget`:
:class:`InProcessTarget` (a runtime and model in this process, ``run_sweep``) or the separate
runtime and agent processes of ``ggufswap sweep --config`` (``ggufswap._sweep_procs``).

1. the baseline: every chunk of the text (llama-perplexity's protocol, :mod:`.kld`) is evaluated
   once; its scored log-probabilities go to ``baseline.logits`` (llama.cpp's
   ``--kl-divergence-base`` format) and a digest of each chunk's logits to ``baseline.json``. A
   restart with the same model tensors, tokens and context reuses them.
2. per round (:class:`~.recipe.Round`): the quantized tensors are swapped in and the committed
   plans must name exactly the round's tensors; the text is evaluated (PPL, KLD, ...); the
   originals are swapped back (again exactly those names), and the logits of the first
   ``verify_chunks`` chunks must equal the baseline's bit for bit. Only then is the round
   appended to the journal (:class:`~.sweep_results.Journal`).
3. a round the runtime refuses (validation, staging) or that commits other tensors than asked is
   reported, never recorded; a restore that fails or does not reproduce the baseline stops the
   sweep (the model is no longer the one the baseline measured).

Tensors the model never computes with (loaded but not in ``model.required``) are skipped and
reported, as are locked tensors and targets equal to the tensor's own type.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from gguf import GGMLQuantizationType

from ggufswap.config import Storage
from ggufswap.ipc import Event, Job, Plan, PlanCommittedEvent
from ggufswap.logs import get_logger
from ggufswap.runtime import HotSwapRuntime, PlanState
from ggufswap.runtime.models import HParams, ModelError, Numerics, build_model
from ggufswap.runtime.serving.errors import ServingError
from ggufswap.runtime.serving.kld import BaseLogProbs, first_scored, text_chunks
from ggufswap.runtime.serving.recipe import Recipe, Round, Skip, plan_rounds, qtype_name
from ggufswap.runtime.serving.sweep_eval import (
    BASELINE_LOGITS,
    BaselineMismatch,
    ChunkEvaluator,
)
from ggufswap.runtime.serving.sweep_plot import PLOT_PNG, PlotResult, write_plot
from ggufswap.runtime.serving.sweep_results import JOURNAL, Journal, write_csvs, write_text
from ggufswap.runtime.serving.sweep_sources import SourceError, TensorSources
from ggufswap.runtime.serving.tokenizer import GgufTokenizer
from ggufswap.shards import ShardSet, TensorRecord, open_shard_set

log = get_logger(__name__)

REPORT_JSON: Final = "report.json"
COMMIT_TIMEOUT_S: Final = 120.0


class SweepError(ServingError):
    """The sweep cannot go on (the model no longer matches its baseline, a restore failed, the
    output directory belongs to another sweep); the message says what was found."""


class RoundRefused(ServingError):
    """A round that cannot be measured; the sweep reports it and goes on. ``changed``: what a
    commit that changed other tensors than asked did change (None: nothing was committed)."""

    def __init__(self, message: str, *, changed: frozenset[str] | None = None) -> None:
        super().__init__(message)
        self.changed = changed


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    n_ctx: int = 512
    max_chunks: int | None = None  # None: every chunk the text fills
    verify_chunks: int = 1  # chunks re-evaluated after each restore; 0: all
    commit_timeout_s: float = COMMIT_TIMEOUT_S
    storage: Storage = Storage.DEQUANTIZED
    plot: bool = False  # write OUT/sweep.png when matplotlib is installed (the CLI does)
    numerics: Numerics = Numerics.EXACT  # "ggml": llama.cpp's CPU rounding (native storage)


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
    plot: PlotResult | None = None  # None: not asked for (SweepOptions.plot)


Progress = Callable[[Iterator[Round], int], Iterator[Round]]


def _no_progress(rounds: Iterator[Round], total: int) -> Iterator[Round]:
    return rounds


@dataclass(frozen=True, slots=True)
class Swapped:
    """A committed swap: the version it made, its plan, the files its tensors came from."""

    weight_version: int
    plan_id: str
    sources: tuple[str, ...]
    nbytes: int


class SweepTarget(Protocol):
    """What a sweep drives: a model it can swap tensors of and evaluate."""

    @property
    def originals(self) -> Mapping[str, TensorRecord]:
        """The model's tensors as loaded (the state every restore returns to)."""
        ...

    @property
    def computed(self) -> frozenset[str]:
        """The tensors the model computes with."""
        ...

    def baseline(self) -> dict[str, Any]:
        """The baseline record (``ppl``, ``digests``); its base file is in the output dir."""
        ...

    def swap(self, names: tuple[str, ...], target: GGMLQuantizationType, what: str) -> Swapped:
        """Swap ``names`` to ``target``; RoundRefused (with ``changed`` when something was
        committed) unless the commits changed exactly ``names``."""
        ...

    def restore(self, names: tuple[str, ...], expect: frozenset[str], what: str) -> Swapped:
        """Swap ``names`` back to their originals; the commits must change exactly
        ``expect``; SweepError otherwise."""
        ...

    def measure(self, version: int, base: BaseLogProbs) -> dict[str, Any]:
        """The figures of weight ``version`` against the baseline."""
        ...

    def digests(self, version: int, n: int) -> list[str]:
        """The digests of the first ``n`` chunks' logits at weight ``version`` (0: all)."""
        ...


class InProcessTarget:
    """A runtime and the model reading its store, in this process: plans are submitted and
    committed here, between two evaluations."""

    def __init__(
        self,
        *,
        runtime: HotSwapRuntime,
        evaluator: ChunkEvaluator,
        sources: TensorSources,
        out_dir: Path,
        commit_timeout_s: float = COMMIT_TIMEOUT_S,
    ) -> None:
        assert runtime.shards is not None, "the sweep needs a runtime opened from files"
        self.runtime = runtime
        self.evaluator = evaluator
        self.sources = sources
        self.out_dir = out_dir
        self.commit_timeout_s = commit_timeout_s
        self._originals: dict[str, TensorRecord] = dict(runtime.shards.tensors)
        self._committed: dict[str, PlanCommittedEvent] = {}
        runtime.on_event(self._on_event)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, PlanCommittedEvent):
            self._committed[event.plan_id] = event

    @property
    def originals(self) -> Mapping[str, TensorRecord]:
        return self._originals

    @property
    def computed(self) -> frozenset[str]:
        return frozenset(self.evaluator.model.required)

    def baseline(self) -> dict[str, Any]:
        try:
            return self.evaluator.baseline(self.out_dir, self._originals)
        except BaselineMismatch as exc:
            raise SweepError(str(exc)) from None

    def measure(self, version: int, base: BaseLogProbs) -> dict[str, Any]:
        assert version == self.runtime.weight_version, "in process, only the current version"
        return self.evaluator.measure(base)[0]

    def digests(self, version: int, n: int) -> list[str]:
        assert version == self.runtime.weight_version, "in process, only the current version"
        return self.evaluator.digests(n)

    def swap(self, names: tuple[str, ...], target: GGMLQuantizationType, what: str) -> Swapped:
        try:
            records = [self.sources.record(n, target) for n in names]
        except SourceError as exc:
            raise RoundRefused(str(exc)) from None
        version, plan_id = self._commit(tuple(Job(r) for r in records), frozenset(names), what)
        return Swapped(
            version, plan_id, tuple(r.path for r in records), sum(r.nbytes for r in records)
        )

    def restore(self, names: tuple[str, ...], expect: frozenset[str], what: str) -> Swapped:
        records = [self._originals[n] for n in names]
        try:
            version, plan_id = self._commit(tuple(Job(r) for r in records), expect, what)
        except RoundRefused as exc:
            raise SweepError(f"{exc}; the model is no longer at its baseline, stopping") from None
        return Swapped(
            version, plan_id, tuple(r.path for r in records), sum(r.nbytes for r in records)
        )

    def _commit(self, jobs: tuple[Job, ...], expect: frozenset[str], what: str) -> tuple[int, str]:
        """Submit and commit a plan; ``(weight_version, plan_id)``. RoundRefused when refused or
        when the commit changed other tensors than ``expect``."""
        plan = Plan(plan_id=uuid.uuid4().hex, model=self.runtime.model_name, jobs=jobs)
        ticket = self.runtime.submit(plan)
        deadline = time.monotonic() + self.commit_timeout_s
        while not ticket.state.final:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SweepError(
                    f"{what}: plan {plan.plan_id} not committed within "
                    f"{self.commit_timeout_s:.0f} s (state {ticket.state.value})"
                )
            self.runtime.wait_staged(timeout=min(remaining, 1.0))
            self.runtime.at_batch_boundary()
        if ticket.state is PlanState.REJECTED:
            reasons = "; ".join(f"{r.tensor}: {r.reason}" for r in ticket.reasons)
            raise RoundRefused(f"{what}: the runtime refused the plan: {reasons}")
        event = self._committed.pop(plan.plan_id, None)
        if event is None:
            raise SweepError(f"{what}: plan {plan.plan_id} committed without a plan.committed")
        check_changed(frozenset(event.changed), expect, what)
        return event.weight_version, plan.plan_id


def _files(records: list[TensorRecord]) -> tuple[tuple[str, ...], int]:
    return tuple(r.path for r in records), sum(r.nbytes for r in records)


def check_changed(changed: frozenset[str], expect: frozenset[str], what: str) -> None:
    """RoundRefused (carrying ``changed``) unless the commits changed exactly ``expect``."""
    if changed != expect:
        raise RoundRefused(
            f"{what}: the commit changed {sorted(changed)}, expected exactly {sorted(expect)}",
            changed=changed,
        )


class Sweep:
    """One sweep of ``recipe`` over ``target``, recorded in ``out_dir``."""

    def __init__(
        self,
        *,
        target: SweepTarget,
        recipe: Recipe,
        out_dir: Path,
        options: SweepOptions,
        progress: Progress = _no_progress,
    ) -> None:
        self.target = target
        self.recipe = recipe
        self.out_dir = out_dir
        self.options = options
        self.progress = progress
        out_dir.mkdir(parents=True, exist_ok=True)

    def _verify_restore(self, version: int, digests: list[str], unit: str) -> int:
        got = self.target.digests(version, self.options.verify_chunks)
        for c, digest in enumerate(got):
            if digest != digests[c]:
                raise SweepError(
                    f"after restoring {unit}, chunk {c}'s logits differ from the baseline's "
                    f"(digest {digest} != {digests[c]}): the model is not back to its original "
                    "weights; stopping (the journal holds every round verified so far)"
                )
        return len(got)

    def run_round(
        self, r: Round, base: BaseLogProbs, digests: list[str], ppl_base: float
    ) -> dict[str, Any]:
        """Swap, measure, restore, verify; the journal record (RoundRefused: nothing changed)."""
        originals = self.target.originals
        # A group member already in the target type stays as it is.
        names = tuple(n for n in r.tensors if int(originals[n].ggml_type) != int(r.target))
        if not names:
            raise RoundRefused(f"{r.key}: every tensor is already {qtype_name(r.target)}")
        t0 = time.perf_counter()
        try:
            swapped = self.target.swap(names, r.target, f"swap of {r.key}")
        except RoundRefused as exc:
            if exc.changed is not None:  # committed, but not as asked: put the originals back
                back = self.target.restore(names, exc.changed, f"restore of {r.unit}")
                self._verify_restore(back.weight_version, digests, r.unit)
            raise
        t1 = time.perf_counter()
        metrics = self.target.measure(swapped.weight_version, base)
        t2 = time.perf_counter()
        back = self.target.restore(names, frozenset(names), f"restore of {r.unit}")
        t3 = time.perf_counter()
        verified = self._verify_restore(back.weight_version, digests, r.unit)
        t4 = time.perf_counter()
        return {
            "key": r.key,
            "unit": r.unit,
            "qtype": qtype_name(r.target),
            "tensors": list(names),
            "unchanged": [n for n in r.tensors if n not in names],
            "from_types": [originals[n].ggml_type.name for n in names],
            "sources": list(swapped.sources),
            "bytes": swapped.nbytes,
            "ppl_base": ppl_base,
            "metrics": metrics,
            "weight_version": swapped.weight_version,
            "restored_version": back.weight_version,
            "plan_id": swapped.plan_id,
            "restore_plan_id": back.plan_id,
            "verified_chunks": verified,
            "timings": {
                "swap_s": round(t1 - t0, 4),
                "eval_s": round(t2 - t1, 4),
                "restore_s": round(t3 - t2, 4),
                "verify_s": round(t4 - t3, 4),
            },
            "recorded_at": time.time(),
        }

    def run(self) -> SweepReport:
        originals = self.target.originals
        types = {n: rec.ggml_type for n, rec in originals.items()}
        rounds, skipped = plan_rounds(
            self.recipe, originals, computed=self.target.computed, types=types
        )
        base_record = self.target.baseline()
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
        if self.options.plot:
            report.plot = write_plot(
                journal.records.values(),
                self.out_dir / PLOT_PNG,
                title=f"ggufswap sweep (PPL_base {report.ppl_base:.4f})",
            )
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
        hparams = HParams.from_metadata(runtime.shards.metadata, source=runtime.shards.first.path)
        try:
            model = build_model(
                hparams, runtime.store, store=runtime.store, numerics=options.numerics
            )
        except ModelError as exc:
            raise SweepError(str(exc)) from None
        tokens, bos = text_tokens(GgufTokenizer.from_file(runtime.shards.first.path), text)
        n_ctx = min(options.n_ctx, hparams.context_length)
        chunks = text_chunks(tokens, n_ctx=n_ctx, max_chunks=options.max_chunks)
        if announce is not None:
            announce(
                f"{runtime.model_name}: {len(chunks)} chunks of {n_ctx} tokens "
                f"({n_ctx - 1 - first_scored(n_ctx)} scored each), results in {out_dir}"
            )
        target = InProcessTarget(
            runtime=runtime,
            evaluator=ChunkEvaluator(model, chunks, bos, numerics=options.numerics),
            sources=sources,
            out_dir=out_dir,
            commit_timeout_s=options.commit_timeout_s,
        )
        sweep = Sweep(
            target=target, recipe=recipe, out_dir=out_dir, options=options, progress=progress
        )
        return sweep.run()
    finally:
        runtime.close()
