"""The per-tensor quantization sweep: swap, measure against the baseline, restore, verify, record.

:class:`Sweep` is the one implementation of a sweep; what it drives is a :class:`SweepTarget`:
:class:`~.inprocess.InProcessTarget` (a runtime and model in this process, ``run_sweep``) or the
separate runtime and agent processes of ``ggufswap sweep --config`` (:mod:`.procs`).

1. before the first round: every target type must have a source (:mod:`.sources`); one that
   has none is refused with how to make it, and nothing runs.
2. the baseline: every chunk of the text (llama-perplexity's protocol,
   :mod:`ggufswap.runtime.serving.perplexity`) is evaluated once; its scored log-probabilities go
   to ``baseline.logits`` (llama.cpp's ``--kl-divergence-base`` format) and a digest of each
   chunk's logits to ``baseline.json``. A restart with the same model tensors, tokens, context and
   numerics reuses them.
3. per round (:class:`~.recipe.Round`): the quantized tensors are swapped in and the committed
   plans must name exactly the round's tensors; the text is evaluated (PPL, KLD, ...); the
   originals are swapped back (again exactly those names), the first ``verify_chunks`` chunks'
   logits must equal the baseline's bit for bit, and the round's scratch files are removed. Only
   then is the round appended to the journal (:class:`~.results.Journal`).
4. a round the runtime refuses (validation, staging) or that commits other tensors than asked is
   reported, never recorded; a restore that fails or does not reproduce the baseline stops the
   sweep (the model is no longer the one the baseline measured).

Tensors the model never computes with (loaded but not in ``model.required``) and targets equal
to a tensor's own type get no round: they are recorded as baseline-equivalent, as the Tool Suite
records them. Locked tensors are left out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from ggufswap.config import Storage
from ggufswap.logs import get_logger
from ggufswap.runtime.kernels import ggml_describe, ggml_library
from ggufswap.runtime.models import Numerics
from ggufswap.runtime.models.ggml_numerics import VEC_DOT
from ggufswap.shards import TensorRecord
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.sweep.basefile import BaseLogProbs
from ggufswap.sweep.errors import RoundRefused, SweepError
from ggufswap.sweep.evaluate import BASELINE_LOGITS
from ggufswap.sweep.plot import PLOT_PNG, PlotResult, write_plot
from ggufswap.sweep.qtypes import qtype_name
from ggufswap.sweep.recipe import Recipe, Round, Skip, plan_rounds
from ggufswap.sweep.results import JOURNAL, Journal, chunks, write_text
from ggufswap.sweep.sources import SCRATCH, scratch_bytes
from ggufswap.sweep.suite import ORIGINALS, SuiteLayout, write_outputs

log = get_logger(__name__)

REPORT_JSON: Final = "report.json"
COMMIT_TIMEOUT_S: Final = 120.0


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    n_ctx: int = 512
    max_chunks: int | None = None  # None: every chunk the text fills
    verify_chunks: int = 1  # chunks re-evaluated after each restore; 0: all
    commit_timeout_s: float = COMMIT_TIMEOUT_S
    # llama.cpp's CPU rounding by default: figures comparable with llama-perplexity's. It reads
    # each weight's type and blocks from the store, so it needs native storage.
    numerics: Numerics = Numerics.GGML
    # which libggml's products (sweep/libggml.py): auto, mainline, ik, off or a path
    ggml: str = "auto"
    storage: Storage = Storage.NATIVE
    plot: bool = False  # write OUT/sweep.png when matplotlib is installed (the CLI does)
    keep_scratch: bool = False  # keep OUT/scratch (and OUT/originals) at the end
    ppl_percent: bool = False  # ppl_results.csv as the Suite's percent deltas (+1.23%)


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
    protocol: dict[str, Any] = field(default_factory=dict)  # numerics, ctx, chunks, text, base
    disk_high_water: int = 0  # bytes of OUT/scratch + OUT/originals at their largest


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

    def source_problems(self, targets: set[int], example: str) -> list[str]:
        """One line per target type no source can make (checked before the first round)."""
        ...

    def baseline(self) -> dict[str, Any]:
        """The baseline record (``ppl``, ``digests``...); its base file is in the output dir."""
        ...

    def swap(self, names: tuple[str, ...], target: int, what: str) -> Swapped:
        """Swap ``names`` to ``target``; RoundRefused (with ``changed`` when something was
        committed) unless the commits changed exactly ``names``."""
        ...

    def restore(self, names: tuple[str, ...], expect: frozenset[str], what: str) -> Swapped:
        """Swap ``names`` back to their originals; the commits must change exactly
        ``expect``; SweepError otherwise."""
        ...

    def release(self, names: tuple[str, ...], target: int) -> None:
        """Remove what the round of ``names`` at ``target`` wrote (scratch, saved originals)."""
        ...

    def measure(self, version: int, base: BaseLogProbs) -> dict[str, Any]:
        """The figures of weight ``version`` against the baseline."""
        ...

    def digests(self, version: int, n: int) -> list[str]:
        """The digests of the first ``n`` chunks' logits at weight ``version`` (0: all)."""
        ...


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
        self.high_water = 0
        out_dir.mkdir(parents=True, exist_ok=True)

    def _disk(self) -> int:
        """Bytes the sweep holds on disk now (its scratch files and saved originals)."""
        used = scratch_bytes(self.out_dir / SCRATCH) + scratch_bytes(self.out_dir / ORIGINALS)
        self.high_water = max(self.high_water, used)
        return used

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
            try:
                swapped = self.target.swap(names, r.target, f"swap of {r.key}")
            except RoundRefused as exc:
                if exc.changed is not None:  # committed, but not as asked: put them back
                    back = self.target.restore(names, exc.changed, f"restore of {r.unit}")
                    self._verify_restore(back.weight_version, digests, r.unit)
                raise
            self._disk()  # the round's files all exist now: the sweep's peak
            t1 = time.perf_counter()
            metrics = self.target.measure(swapped.weight_version, base)
            t2 = time.perf_counter()
            back = self.target.restore(names, frozenset(names), f"restore of {r.unit}")
            t3 = time.perf_counter()
            verified = self._verify_restore(back.weight_version, digests, r.unit)
            t4 = time.perf_counter()
        finally:
            if not self.options.keep_scratch:
                self.target.release(names, r.target)
        return {
            "key": r.key,
            "unit": r.unit,
            "group_index": r.group_index,
            "qtype": qtype_name(r.target),
            "tensors": list(names),
            "unchanged": [n for n in r.tensors if n not in names],
            "from_types": [qtype_name(originals[n].ggml_type) for n in names],
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

    def plan(self) -> tuple[list[Round], list[Skip]]:
        """The rounds and skips; SweepError listing every target type no source can make."""
        originals = self.target.originals
        types = {n: int(rec.ggml_type) for n, rec in originals.items()}
        rounds, skipped = plan_rounds(
            self.recipe, originals, computed=self.target.computed, types=types
        )
        if rounds:
            problems = self.target.source_problems(
                {int(r.target) for r in rounds}, rounds[0].tensors[0]
            )
            if problems:
                raise SweepError(
                    "no source for these target types (nothing was run):\n  "
                    + "\n  ".join(problems)
                )
        if self.options.numerics is Numerics.GGML:
            self._check_ggml_numerics(rounds)
        return rounds, skipped

    def _check_ggml_numerics(self, rounds: list[Round]) -> None:
        """SweepError naming every weight type, in the model or among the targets, that ggml
        numerics can neither multiply with the loaded libggml (ik_llama.cpp's multiplies its own
        types) nor emulate (ggml-cpu's ``vec_dot_type``)."""
        computed = self.target.computed
        in_model = {int(r.ggml_type) for n, r in self.target.originals.items()
                    if n in computed and len(r.ne) >= 2}  # fmt: skip
        library = ggml_library()
        multiplied = library.types if library is not None else frozenset()
        unknown = sorted(
            t
            for t in in_model | {int(r.target) for r in rounds}
            if GGMLType(t) not in VEC_DOT and t not in multiplied
        )
        if unknown:
            names = ", ".join(qtype_name(t) for t in unknown)
            raise SweepError(
                f"numerics 'ggml' (llama.cpp's CPU rounding, the default) knows no activation "
                f"rounding for {names} (ggml-cpu's vec_dot_type) and no libggml here multiplies "
                f"them ({ggml_describe()}; ik_llama.cpp's, the ggml extra, does: pip install "
                "'ggufswap[ggml]'): install it, or give --numerics exact (float products, no "
                "rounding noise)"
            )

    def run(self) -> SweepReport:
        rounds, skipped = self.plan()
        base_record = self.target.baseline()
        base = BaseLogProbs(self.out_dir / BASELINE_LOGITS)
        journal = Journal(self.out_dir / JOURNAL)
        report = SweepReport(
            out_dir=self.out_dir,
            ppl_base=float(base_record["ppl"]),
            rounds_planned=len(rounds),
            skipped=skipped,
            protocol=dict(base_record.get("protocol", {})),
        )
        layout = SuiteLayout.of(
            self.recipe, rounds, skipped, self.target.originals, base_record, self.options
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
            write_outputs(self.out_dir, layout, journal.records.values(), report.refused)
            log.info("sweep.round", round=r.key, kld=record["metrics"]["kld_mean"])
        report.journal = dict(journal.records)
        write_outputs(self.out_dir, layout, journal.records.values(), report.refused)
        report.disk_high_water = self.high_water
        if not self.options.keep_scratch:
            layout.remove_scratch(self.out_dir)
        if self.options.plot:
            report.plot = write_plot(
                journal.records.values(),
                self.out_dir / PLOT_PNG,
                title=f"ggufswap sweep, PPL_base {report.ppl_base:.4f}\n{_protocol_line(report)}",
            )
        write_report(report)
        return report


def _protocol_line(report: SweepReport) -> str:
    p = report.protocol
    return f"{p.get('numerics')} numerics, ctx {p.get('n_ctx')} x {chunks(p.get('n_chunk'))}"


def write_report(report: SweepReport) -> None:
    """``OUT/report.json``: what ran, how it was measured, what was left out and why."""
    summary = {
        "ppl_base": report.ppl_base,
        "protocol": report.protocol,
        "rounds_planned": report.rounds_planned,
        "recorded": len(report.journal),
        "resumed": report.resumed,
        "skipped": [asdict(s) for s in report.skipped],
        "refused": report.refused,
        "disk": {"high_water_bytes": report.disk_high_water},
    }
    write_text(report.out_dir / REPORT_JSON, json.dumps(summary, indent=1) + "\n")
