"""The sweep in this process: a runtime and the model that reads its store, plans submitted and
committed here between two evaluations (``run_sweep``, ``ggufswap sweep --model``)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ggufswap.ipc import Event, Job, Plan, PlanCommittedEvent
from ggufswap.runtime import HotSwapRuntime, PlanState
from ggufswap.runtime.errors import GgmlLibraryError
from ggufswap.runtime.kernels import ggml_select
from ggufswap.runtime.models import Decoder, HParams, ModelError, Numerics, build_model
from ggufswap.runtime.serving.perplexity import first_scored, text_chunks, text_tokens
from ggufswap.runtime.serving.tokenizer import GgufTokenizer
from ggufswap.runtime.serving.tokenizer_cache import cache_dir
from ggufswap.shards import TensorRecord, open_shard_set
from ggufswap.sweep.basefile import BaseLogProbs
from ggufswap.sweep.errors import RoundRefused, SourceError, SweepError
from ggufswap.sweep.evaluate import ChunkEvaluator
from ggufswap.sweep.ik_quantize import IkQuantizer
from ggufswap.sweep.libggml import AUTO, choose
from ggufswap.sweep.recipe import Recipe
from ggufswap.sweep.sources import SCRATCH, TensorSet, TensorSources
from ggufswap.sweep.sweep import (
    COMMIT_TIMEOUT_S,
    Progress,
    Swapped,
    Sweep,
    SweepOptions,
    SweepReport,
    _no_progress,
    check_changed,
)


class InProcessTarget:
    """A runtime and the model reading its store, in this process."""

    def __init__(
        self,
        *,
        runtime: HotSwapRuntime,
        evaluator: ChunkEvaluator,
        sources: TensorSources,
        out_dir: Path,
        commit_timeout_s: float = COMMIT_TIMEOUT_S,
        baseline_model: str | None = None,
    ) -> None:
        assert runtime.shards is not None, "the sweep needs a runtime opened from files"
        self.runtime = runtime
        self.evaluator = evaluator
        self.sources = sources
        self.out_dir = out_dir
        self.commit_timeout_s = commit_timeout_s
        self.baseline_model = baseline_model
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

    def source_problems(self, targets: set[int], example: str) -> list[str]:
        return self.sources.problems(targets, example)

    def baseline(self) -> dict[str, Any]:
        if self.baseline_model is None:
            return self.evaluator.baseline(self.out_dir, self._originals)
        with _baseline_evaluator(self.baseline_model, self.evaluator) as base_eval:
            return self.evaluator.baseline(self.out_dir, self._originals, base=base_eval)

    def measure(self, version: int, base: BaseLogProbs) -> dict[str, Any]:
        assert version == self.runtime.weight_version, "in process, only the current version"
        return self.evaluator.measure(base)[0]

    def digests(self, version: int, n: int) -> list[str]:
        assert version == self.runtime.weight_version, "in process, only the current version"
        return self.evaluator.digests(n)

    def swap(self, names: tuple[str, ...], target: int, what: str) -> Swapped:
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

    def release(self, names: tuple[str, ...], target: int) -> None:
        self.sources.release(names, target)

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


class _baseline_evaluator:  # noqa: N801 (a context manager used as a function)
    """The ``--baseline`` model loaded on its own for as long as its logits are computed, with
    the swept model's chunks and numerics; closed (its memory freed) right after."""

    def __init__(self, path: str, like: ChunkEvaluator) -> None:
        self.path = path
        self.like = like
        self.runtime: HotSwapRuntime | None = None

    def __enter__(self) -> ChunkEvaluator:
        storage = self.like.storage
        self.runtime = HotSwapRuntime.open(self.path, storage=storage, allowed_roots=[])
        model = decoder_of(self.runtime, self.like.numerics.value)
        return ChunkEvaluator(
            model, self.like.chunks, self.like.bos_id, numerics=self.like.numerics,
            source=self.path,
        )  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        if self.runtime is not None:
            self.runtime.close()


def select_products(numerics: Numerics, option: str, types: Iterable[int]) -> str:
    """Before the runtime loads: the libggml ggml numerics multiply with, ``option`` (``--ggml``)
    resolved for the sweep's ``types`` (:func:`.libggml.choose`), made this process's; its choice
    word. SweepError when it cannot be (its package absent, another already loaded)."""
    if numerics is not Numerics.GGML:
        return option
    chosen = choose(option, types)
    try:  # auto: the library this process already multiplies with, if any, stays
        ggml_select(chosen, preferred=option == AUTO)
    except GgmlLibraryError as exc:
        raise SweepError(str(exc)) from None
    return chosen


def sweep_types(tensors: Mapping[str, TensorRecord], recipe: Recipe) -> set[int]:
    """The types a sweep multiplies: the model's and the recipe's targets."""
    return {int(r.ggml_type) for r in tensors.values()} | {int(t) for t in recipe.targets}


def decoder_of(runtime: HotSwapRuntime, numerics: str) -> Decoder:
    """The model over ``runtime``'s store; SweepError when the architecture or numerics do not
    fit (ggml numerics need native storage)."""
    assert runtime.shards is not None, "open() keeps the shard set"
    hparams = HParams.from_metadata(runtime.shards.metadata)
    try:
        return build_model(hparams, runtime.store, store=runtime.store, numerics=numerics)
    except ModelError as exc:
        raise SweepError(str(exc)) from None


def open_sources(
    model_path: str,
    *,
    out_dir: Path,
    originals: Mapping[str, TensorRecord],
    models: Mapping[int, TensorSet] | None,
    imatrix: Path | None = None,
) -> TensorSources:
    """The sweep's sources: the user's files, requant, and ik's quantizer when installed."""
    first = open_shard_set(model_path).first.path
    ik = IkQuantizer.find(metadata_shard=first, work=out_dir / SCRATCH, imatrix=imatrix)
    return TensorSources(scratch=out_dir / SCRATCH, originals=originals, models=models, ik=ik)


def run_sweep(
    model_path: str | os.PathLike[str],
    *,
    text: str,
    recipe: Recipe,
    out_dir: Path,
    options: SweepOptions,
    models: Mapping[int, TensorSet] | None = None,
    baseline_model: str | None = None,
    imatrix: Path | None = None,
    progress: Progress = _no_progress,
    announce: Callable[[str], None] | None = None,
) -> SweepReport:
    """Load ``model_path`` in this process and run the whole sweep (the library's one call).

    The runtime may read the model's own directories, the scratch directory under ``out_dir``
    and those of the ``models`` given as sources; nothing else, and it never writes the model.
    ``baseline_model``: the KLD's reference (default: the swept model itself).
    """
    shards = open_shard_set(model_path)
    select_products(options.numerics, options.ggml, sweep_types(shards.tensors, recipe))
    sources = open_sources(
        str(model_path), out_dir=out_dir, originals=shards.tensors, models=models, imatrix=imatrix
    )
    roots = sorted({os.path.dirname(p) for p in shards.paths} | set(sources.roots))
    runtime = HotSwapRuntime.open(model_path, storage=options.storage, allowed_roots=roots)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = decoder_of(runtime, options.numerics.value)
        context_length = HParams.from_metadata(runtime.shards.metadata).context_length
        tokens, bos = text_tokens(
            GgufTokenizer.from_file(runtime.shards.first.path, cache=cache_dir()), text
        )
        n_ctx = min(options.n_ctx, context_length)
        chunks = text_chunks(tokens, n_ctx=n_ctx, max_chunks=options.max_chunks)
        if announce is not None:
            announce(
                f"{runtime.model_name}: {len(chunks)} chunks of {n_ctx} tokens "
                f"({n_ctx - 1 - first_scored(n_ctx)} scored each), {options.numerics.value} "
                f"numerics, results in {out_dir}"
            )
        evaluator = ChunkEvaluator(
            model, chunks, bos, numerics=options.numerics, storage=options.storage,
            source=str(model_path), text=text,
        )  # fmt: skip
        target = InProcessTarget(
            runtime=runtime,
            evaluator=evaluator,
            sources=sources,
            out_dir=out_dir,
            commit_timeout_s=options.commit_timeout_s,
            baseline_model=baseline_model,
        )
        sweep = Sweep(
            target=target, recipe=recipe, out_dir=out_dir, options=options, progress=progress
        )
        return sweep.run()
    finally:
        runtime.close()
