"""The sweep spread over the workers of a Ray cluster (``ggufswap sweep --ray ADDRESS``).

Ray (the optional extra ``ggufswap[ray]``) places the workers, restarts a dead one and retries
the round it held; the rest is the single-host sweep's own code:

- a **worker** (:class:`~.ray_worker.SweepWorker`, one Ray actor, by default one per node in a
  placement group, :mod:`.ray_placement`) opens the model from its node-local copy (the same
  path on every node) in an in-process runtime, computes the baseline there and runs rounds with
  :meth:`.sweep.Sweep.run_round` (swap, measure, restore, verify) in its own work directory;
- the **driver** (:func:`run_ray_sweep`) checks that every worker loaded the same tensor table
  and tokens and computed the same baseline (its record, every chunk's digest, the base file's
  sha256: the log-probabilities themselves never pass through the driver, which copies one
  worker's base file into ``--out`` piece by piece), hands the recipe's rounds out one at a time
  to whichever worker is free, and is the only writer of ``--out``: the journal, the CSVs and
  ``report.json``, in the recipe's round order (a round that finishes early waits in memory for
  the ones before it), so the files are those of a single-host sweep of the same recipe, model,
  text and options.

A worker that dies (killed, its node lost) or holds a round longer than ``round_timeout_s`` (the
driver then kills it) is restarted by Ray (actor ``max_restarts``), and Ray runs the round it
held again on the replacement (``max_task_retries``: ``max_round_failures - 1``); a round is
recorded once, when a worker returns it verified. A round whose every attempt took its worker
down is reported as refused; a worker out of restarts is gone and its round goes to another. A
restore that does not reproduce the baseline on any worker stops the sweep, as on one host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from ggufswap.logs import get_logger
from ggufswap.shards import TensorRecord
from ggufswap.sweep.errors import SweepError
from ggufswap.sweep.evaluate import BASELINE_JSON, BASELINE_LOGITS
from ggufswap.sweep.ray_fleet import Fleet, Worker
from ggufswap.sweep.ray_placement import in_group, place_workers
from ggufswap.sweep.ray_worker import SweepWorker, WorkerInfo, baseline_mismatch, file_sha256
from ggufswap.sweep.recipe import Recipe, Round
from ggufswap.sweep.results import JOURNAL, Journal, write_text
from ggufswap.sweep.suite import SuiteLayout, write_outputs
from ggufswap.sweep.sweep import SweepOptions, SweepReport, write_report

__all__ = ["RayOptions", "RaySweepReport", "SweepWorker", "WorkerInfo", "run_ray_sweep"]

log = get_logger(__name__)

WORKERS_DIR: Final = "ray-workers"
RAY_JSON: Final = "ray.json"  # the workers, their restarts and the rounds retried
POLL_S: Final = 0.5


@dataclass(frozen=True, kw_only=True)
class RayOptions:
    """Where and how the workers run. ``address``: a Ray cluster (``ray://host:10001``,
    ``host:6379``), ``"auto"`` for the cluster ``ray start`` made on this machine or else a new
    local one, or None to use the Ray this process already initialized."""

    address: str | None = "auto"
    workers: int | None = None  # None: one per alive node that has the CPUs for one
    # torch threads per worker and the CPUs Ray reserves for it; None: every CPU of the worker's
    # affinity mask on its node, reserving one (Ray's OMP_NUM_THREADS for the actor is ignored)
    threads: int | None = None
    pin_cpus: bool = False  # pin worker i to the i-th CPU of its affinity mask (benchmarks)
    work_dir: Path | None = None  # on each node; None: OUT/ray-workers/<worker>
    placement_timeout_s: float = 60.0  # the workers' placement group, or the sweep ends
    call_timeout_s: float = 3600.0  # starting a worker (loading the model), the baseline
    round_timeout_s: float = 3600.0  # a round held longer: its worker is killed, Ray retries it
    max_restarts: int = 3  # Ray restarts of each worker (actor max_restarts)
    max_round_failures: int = 2  # attempts of a round that took its worker down: then refused


Dispatched = Callable[[WorkerInfo, Round], None]


@dataclass(kw_only=True)
class RaySweepReport(SweepReport):
    """A single-host sweep's report, and the workers that ran it (also in ``ray.json``)."""

    workers: list[WorkerInfo] = field(default_factory=list)
    retried: list[dict[str, Any]] = field(default_factory=list)  # rounds run more than once
    restarts: list[dict[str, Any]] = field(default_factory=list)  # workers Ray replaced
    dead: list[str] = field(default_factory=list)  # workers out of restarts


def _connect(address: str | None) -> bool:
    """Initialize Ray; True when this call started it (and so must shut it down)."""
    if ray.is_initialized():
        return False
    if address is None:
        raise SweepError("no Ray address given and Ray is not initialized in this process")
    # "auto": the cluster `ray start` made on this machine, else a new local one (ray.init()'s
    # own resolution without an address; RAY_ADDRESS overrides it as Ray documents).
    ray.init(
        address=None if address == "auto" else address,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    return True


def _get(ref: Any, timeout_s: float, what: str) -> Any:
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise SweepError(f"{what}: no answer within {timeout_s:.0f} s") from None


def _cause(exc: BaseException) -> str:
    """The worker's own exception in a Ray error (the whole Ray error when it has none)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return str(exc)


def _call(ref: Any, timeout_s: float, what: str) -> Any:
    """``ray.get``; SweepError with the worker's own message when the call raised or its
    worker died (after the retries Ray makes)."""
    try:
        return _get(ref, timeout_s, what)
    except RayError as exc:
        raise SweepError(f"{what}: {_cause(exc)}") from None


def _start_workers(
    group: PlacementGroup,
    count: int,
    *,
    out_dir: Path,
    ray_options: RayOptions,
    worker_class: type[SweepWorker],
    **worker_args: Any,
) -> tuple[list[Worker], dict[str, Any]]:
    """``count`` workers, one in each bundle of ``group``, started and checked: the same tensor
    table and tokens on every one (SweepError naming the first that differs); and what the
    first one loaded (its ``describe``)."""
    actor_class: Any = ray.remote(worker_class)
    base_dir = ray_options.work_dir or out_dir / WORKERS_DIR
    handles = [
        actor_class.options(
            num_cpus=ray_options.threads or 1,
            scheduling_strategy=in_group(group, i),
            max_restarts=ray_options.max_restarts,
            max_task_retries=max(ray_options.max_round_failures - 1, 0),
            max_concurrency=1,
        ).remote(
            name=f"w{i}",
            work_dir=str(base_dir / f"w{i}"),
            threads=ray_options.threads,
            cpu=i if ray_options.pin_cpus else None,
            **worker_args,
        )
        for i in range(count)
    ]
    refs = [h.describe.remote() for h in handles]
    answers = [
        _call(ref, ray_options.call_timeout_s, f"sweep worker w{i} did not start")
        for i, ref in enumerate(refs)
    ]
    for i, d in enumerate(answers):
        if d["error"] is not None:
            raise SweepError(f"sweep worker w{i} did not start on {d['info'].host}: {d['error']}")
        if d["identity"] != answers[0]["identity"]:
            raise SweepError(
                f"worker w{i} on {d['info'].host} loaded {worker_args['model_path']} as "
                f"{d['identity']}, worker w0 on {answers[0]['info'].host} as "
                f"{answers[0]['identity']}: every node needs the same model copy and text"
            )
    workers = [Worker(actor=h, info=d["info"]) for h, d in zip(handles, answers, strict=True)]
    return workers, answers[0]


def _stored_baseline(out_dir: Path) -> dict[str, Any] | None:
    """The baseline ``out_dir`` holds (as a worker reports one), or None."""
    path, logits = out_dir / BASELINE_JSON, out_dir / BASELINE_LOGITS
    if not (path.exists() and logits.exists()):
        return None
    record = json.loads(path.read_text())
    return {"record": record, "sha256": file_sha256(logits), "bytes": logits.stat().st_size}


def _copy_baseline(w: Worker, expect: dict[str, Any], out_dir: Path, timeout_s: float) -> None:
    """``w``'s base file into ``out_dir``, one piece at a time (the driver never holds it)."""
    tmp = out_dir / f".{BASELINE_LOGITS}.ray.tmp"
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        while f.tell() < expect["bytes"]:
            piece = _call(w.actor.read_baseline.remote(f.tell()), timeout_s, "copying the baseline")
            if not piece:
                break
            f.write(piece)
            digest.update(piece)
            del piece
        f.flush()
        os.fsync(f.fileno())
    if digest.hexdigest() != expect["sha256"]:
        tmp.unlink()
        raise SweepError(f"worker {w.info.name}'s {BASELINE_LOGITS} changed while it was copied")
    tmp.replace(out_dir / BASELINE_LOGITS)
    write_text(out_dir / BASELINE_JSON, json.dumps(expect["record"], indent=1) + "\n")


def _baseline(workers: list[Worker], out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Every worker's baseline, computed on its node and compared; ``--out``'s when it is the
    same, else the first worker's, copied there. A worker that differs stops the sweep."""
    refs = [(w, w.actor.baseline.remote()) for w in workers]
    answers = [(w, _call(ref, timeout_s, f"worker {w.info.name}'s baseline")) for w, ref in refs]
    first, expect = answers[0]
    for w, got in answers[1:]:
        why = baseline_mismatch(got, expect)
        if why is not None:
            raise SweepError(
                f"worker {w.info.name} on {w.info.host}: {why} (worker {first.info.name} on "
                f"{first.info.host} computed the other); its model copy, torch build or thread "
                "count computes other logits"
            )
    stored = _stored_baseline(out_dir)
    if stored is not None:
        why = baseline_mismatch(expect, stored)
        if why is None:
            return stored
        if (out_dir / JOURNAL).exists():
            raise SweepError(
                f"{out_dir} holds the sweep of another model, text, context, numerics or "
                f"baseline model ({out_dir / BASELINE_JSON}: {why}); use a new --out"
            )
    _copy_baseline(first, expect, out_dir, timeout_s)
    return expect


@dataclass
class _Dispatch:
    """The rounds to run, what came back and in what order it is recorded."""

    todo: list[Round]
    queue: list[Round] = field(default_factory=list)
    done: dict[str, tuple[str, Any]] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)  # rounds whose worker died for good
    flushed: int = 0

    def __post_init__(self) -> None:
        self.queue = list(self.todo)


def _dispatch(
    fleet: Fleet,
    state: _Dispatch,
    *,
    expect: Any,
    ray_options: RayOptions,
    on_dispatch: Dispatched | None,
) -> Iterator[tuple[Round, str, Any]]:
    """Run ``state.todo`` over the fleet; yield ``(round, outcome, payload)`` in todo order.
    Ray restarts a dead worker and retries its round; this loop only hands rounds out, kills a
    worker that holds one too long and sets a round aside when its worker is gone."""
    idle = list(fleet.workers)
    inflight: dict[Any, tuple[Worker, Round, float]] = {}
    attempts = max(ray_options.max_round_failures, 1)
    while state.flushed < len(state.todo):
        while idle and state.queue:
            w, r = idle.pop(0), state.queue.pop(0)
            inflight[w.actor.run_round.remote(r, expect)] = (w, r, time.monotonic())
            log.info("sweep.ray.dispatch", worker=w.info.name, round=r.key)
            if on_dispatch is not None:
                on_dispatch(w.info, r)
        if not inflight:
            left = len(state.todo) - state.flushed
            raise SweepError(
                f"every worker died; {left} rounds not run (the journal holds every round "
                "recorded so far: run the same command again to resume)"
            )
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=POLL_S)
        now = time.monotonic()
        for ref, (w, r, started) in list(inflight.items()):
            if ref not in ready and now - started > ray_options.round_timeout_s:
                ray.kill(w.actor, no_restart=False)  # Ray restarts it and retries the round
                inflight[ref] = (w, r, now)
                fleet.tell("sweep.ray.round_timeout", worker=w.info.name, round=r.key, what=(
                    f"worker {w.info.name} held {r.key} over {ray_options.round_timeout_s:g} s: "
                    "killed, Ray restarts it and retries the round"
                ))  # fmt: skip
        for ref in ready:
            w, r, _ = inflight.pop(ref)
            try:
                outcome, payload, about = ray.get(ref)
            except RayActorError:
                if fleet.still_alive(w):  # every attempt Ray made took the worker down
                    why = f"{r.key}: its worker died in each of {attempts} attempts"
                    state.done[r.key] = ("refused", why)
                    idle.append(w)
                elif state.lost.setdefault(r.key, 0) + 1 >= attempts:
                    state.done[r.key] = ("refused", f"{r.key}: took down {attempts} workers")
                else:
                    state.lost[r.key] += 1
                    state.queue.insert(0, r)  # its worker is gone: another one runs it
                continue
            except RayError as exc:  # a bug, not a verdict on the round: stop
                raise SweepError(f"worker {w.info.name} failed on {r.key}: {_cause(exc)}") from None
            fleet.saw(w, about, r)
            if outcome == "failed":
                raise SweepError(str(payload))
            state.done[r.key] = (outcome, payload)
            idle.append(w)
        while state.flushed < len(state.todo) and state.todo[state.flushed].key in state.done:
            r = state.todo[state.flushed]
            state.flushed += 1
            yield (r, *state.done.pop(r.key))


def _no_progress(rounds: Iterator[Round], total: int) -> Iterator[Round]:
    return rounds


def _record(
    report: RaySweepReport,
    results: Iterator[tuple[Round, str, Any]],
    *,
    journal: Journal,
    layout: SuiteLayout,
    total: int,
    progress: Callable[[Iterator[Round], int], Iterator[Round]],
) -> None:
    """Record the rounds as they come back, in order, as the single-host sweep does."""
    outcomes: dict[str, tuple[str, Any]] = {}

    def in_order() -> Iterator[Round]:
        for r, outcome, payload in results:
            outcomes[r.key] = (outcome, payload)
            yield r

    for r in progress(in_order(), total):
        outcome, payload = outcomes.pop(r.key)
        if outcome != "recorded":
            report.refused.append({"key": r.key, "tensors": list(r.tensors), "why": payload})
            log.warning("sweep.round_refused", round=r.key, why=payload)
            continue
        journal.append(payload)
        report.recorded.append(payload)
        write_outputs(report.out_dir, layout, journal.records.values(), report.refused)
        log.info("sweep.round", round=r.key, kld=payload["metrics"]["kld_mean"])


def _finish(report: RaySweepReport, fleet: Fleet, journal: Journal, layout: SuiteLayout) -> None:
    """The last outputs: the CSVs, ``report.json`` and ``ray.json`` (workers, restarts...)."""
    report.journal = dict(journal.records)
    write_outputs(report.out_dir, layout, journal.records.values(), report.refused)
    write_report(report)
    report.workers = [w.info for w in fleet.workers]
    report.retried, report.restarts, report.dead = fleet.retried, fleet.restarts, fleet.dead
    summary = {"workers": [asdict(w) for w in report.workers], "retried": report.retried,
               "restarts": report.restarts, "dead": report.dead}  # fmt: skip
    write_text(report.out_dir / RAY_JSON, json.dumps(summary, indent=1) + "\n")


def run_ray_sweep(
    model_path: str | os.PathLike[str],
    *,
    text: str,
    recipe: Recipe,
    out_dir: Path,
    options: SweepOptions,
    ray_options: RayOptions,
    sources: Mapping[int, str] | None = None,
    baseline_model: str | None = None,
    imatrix: str | None = None,
    progress: Callable[[Iterator[Round], int], Iterator[Round]] = _no_progress,
    announce: Callable[[str], None] | None = None,
    on_dispatch: Dispatched | None = None,
    worker_class: type[SweepWorker] = SweepWorker,
) -> RaySweepReport:
    """The whole sweep over Ray workers; its files in ``out_dir`` are a single-host sweep's.

    ``model_path`` (and each of ``sources``, a path per type, ``baseline_model`` and
    ``imatrix``) must exist on every worker's node. ``on_dispatch`` is called in the driver each
    time a round is handed to a worker; ``worker_class`` (a :class:`SweepWorker` subclass,
    importable or pickled by value on the workers) instruments the workers.

    Size: the driver's one sequence (place, start, plan, baseline, dispatch, record), read top
    to bottom; its steps are the functions above.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tell = announce or (lambda line: None)
    started_ray = _connect(ray_options.address)
    group: PlacementGroup | None = None
    workers: list[Worker] = []
    try:
        group, count = place_workers(
            ray_options.workers, ray_options.threads or 1, ray_options.placement_timeout_s
        )
        workers, first = _start_workers(
            group, count, out_dir=out_dir, ray_options=ray_options, worker_class=worker_class,
            model_path=str(model_path), text=text, options=options, recipe=recipe,
            sources={int(t): p for t, p in (sources or {}).items()},
            baseline_model=baseline_model, imatrix=imatrix,
        )  # fmt: skip
        hosts, nodes = sorted({w.info.host for w in workers}), {w.info.node_id for w in workers}
        tell(
            f"{first['model_name']}: {len(workers)} Ray workers on {len(nodes)} node(s) "
            f"({', '.join(hosts)}), results in {out_dir}"
        )
        rounds, skipped = _call(workers[0].actor.plan.remote(), ray_options.call_timeout_s, "plan")
        expect = _baseline(workers, out_dir, ray_options.call_timeout_s)
        base_record = expect["record"]
        journal = Journal(out_dir / JOURNAL)
        report = RaySweepReport(
            out_dir=out_dir,
            ppl_base=float(base_record["ppl"]),
            rounds_planned=len(rounds),
            skipped=skipped,
            protocol=dict(base_record.get("protocol", {})),
        )
        originals: Mapping[str, TensorRecord] = first["originals"]
        layout = SuiteLayout.of(recipe, rounds, skipped, originals, base_record, options)
        todo = [r for r in rounds if r.key not in journal]
        report.resumed = len(rounds) - len(todo)
        fleet = Fleet(workers, tell, ray_options.call_timeout_s)
        results = _dispatch(
            fleet, _Dispatch(todo=todo), expect=ray.put(expect), ray_options=ray_options,
            on_dispatch=on_dispatch,
        )  # fmt: skip
        _record(report, results, journal=journal, layout=layout, total=len(todo), progress=progress)
        _finish(report, fleet, journal, layout)
        return report
    finally:
        for w in workers:
            ray.kill(w.actor, no_restart=True)
        if group is not None:
            remove_placement_group(group)
        if started_ray:
            ray.shutdown()
