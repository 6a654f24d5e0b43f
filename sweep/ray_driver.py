"""The sweep spread over the workers of a Ray cluster (``ggufswap sweep --ray ADDRESS``).

Ray (the optional extra ``ggufswap[ray]``) schedules the workers, moves the baseline to them and
tells the driver when one dies; the rest is the single-host sweep's own code:

- a **worker** (:class:`SweepWorker`, one Ray actor, by default one per node) opens the model from
  its node-local copy (the same path on every node) in an in-process runtime and runs rounds with
  :meth:`.sweep.Sweep.run_round` (swap, measure, restore, verify), in its own work directory
  (its scratch files);
- the **driver** (:func:`run_ray_sweep`) checks that every worker loaded the same tensor table and
  tokens, takes the baseline from ``--out`` (when its identity matches) or has one worker compute
  it, ships its log-probabilities to every worker through Ray's object store, and has each worker
  prove with the digests of its first chunks that its model computes the baseline's logits bit
  for bit. It then hands the recipe's rounds out one at a time to whichever worker is free and
  is the only writer of ``--out``: the journal, the CSVs and ``report.json``, in the recipe's
  round order (a round that finishes early waits in memory for the ones before it), so the files
  are those of a single-host sweep of the same recipe, model and text.

A worker that dies (killed, its node lost) or holds a round longer than ``round_timeout_s``
(it is then killed) loses nothing: its round goes back to the front of the queue and runs on
another worker; a round is recorded once, when a worker returns it verified. A round that took
down ``max_round_failures`` workers is reported as refused. A restore that does not reproduce
the baseline on any worker stops the sweep, as on one host.

Size: one module (about 590 lines) on purpose: it is the only one that imports ray
(``tests/layout_rules.py``), so the actor and the driver that schedules it stay together.
``run_ray_sweep`` is the driver's one sequence (start, plan, baseline, dispatch, record) and
reads top to bottom.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from ggufswap.logs import get_logger
from ggufswap.shards import TensorRecord
from ggufswap.sweep.basefile import BaseLogProbs
from ggufswap.sweep.errors import RoundRefused, SweepError
from ggufswap.sweep.evaluate import BASELINE_JSON, BASELINE_LOGITS
from ggufswap.sweep.recipe import Recipe, Round, plan_rounds
from ggufswap.sweep.results import JOURNAL, Journal, write_text
from ggufswap.sweep.suite import SuiteLayout, write_outputs
from ggufswap.sweep.sweep import Sweep, SweepOptions, SweepReport, write_report

log = get_logger(__name__)

CURRENT_ROUND: Final = "current_round"  # in a worker's work dir: the key of the round it holds
WORKERS_DIR: Final = "ray-workers"
RAY_JSON: Final = "ray.json"  # the workers and the rounds retried after a worker died
POLL_S: Final = 0.5


@dataclass(frozen=True, kw_only=True)
class RayOptions:
    """Where and how the workers run. ``address``: a Ray cluster (``ray://host:10001``,
    ``host:6379``), ``"auto"`` for the cluster ``ray start`` made on this machine or else a new
    local one, or None to use the Ray this process already initialized."""

    address: str | None = "auto"
    workers: int | None = None  # None: one per alive node
    # torch threads per worker and the CPUs Ray reserves for it; None: every CPU of the worker's
    # affinity mask on its node, reserving one (Ray's OMP_NUM_THREADS for the actor is ignored)
    threads: int | None = None
    pin_cpus: bool = False  # pin worker i to the i-th CPU of its affinity mask (benchmarks)
    work_dir: Path | None = None  # on each node; None: OUT/ray-workers/<worker>
    call_timeout_s: float = 3600.0  # starting a worker (loading the model), the baseline
    round_timeout_s: float = 3600.0  # a round held longer: its worker is killed, the round retried
    max_round_failures: int = 2  # workers a round may take down before it is refused


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A started worker, as its ``describe`` call reported it."""

    name: str
    node_id: str
    host: str
    pid: int
    work_dir: str


Dispatched = Callable[[WorkerInfo, Round], None]


@dataclass(kw_only=True)
class RaySweepReport(SweepReport):
    """A single-host sweep's report, and the workers that ran it (also in ``ray.json``)."""

    workers: list[WorkerInfo] = field(default_factory=list)
    retried: list[dict[str, Any]] = field(default_factory=list)  # rounds a dead worker held


class SweepWorker:
    """One Ray actor: an in-process runtime over the node-local model, running rounds."""

    def __init__(self, *, name: str, work_dir: str, **kwargs: Any) -> None:
        # Never raises: an actor whose __init__ raised only says so in its next call's error,
        # whose exception may not even unpickle in the driver; describe() reports it instead.
        self.name = name
        self.work_dir = Path(work_dir)
        self.error: str | None = None
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
    ) -> None:
        # torch is imported by the worker only (the driver holds no model)
        from ggufswap.runtime import HotSwapRuntime
        from ggufswap.runtime.models import HParams
        from ggufswap.runtime.serving.perplexity import text_chunks, text_tokens
        from ggufswap.runtime.serving.tokenizer import GgufTokenizer
        from ggufswap.runtime.threads import apply_thread_policy, resolve_threads
        from ggufswap.shards import open_shard_set
        from ggufswap.sweep.evaluate import ChunkEvaluator
        from ggufswap.sweep.inprocess import InProcessTarget, decoder_of, open_sources
        from ggufswap.sweep.suite_dir import open_source

        if cpu is not None:
            mask = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {mask[cpu % len(mask)]})
        apply_thread_policy(resolve_threads(flag=threads, environ={}))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / CURRENT_ROUND).unlink(missing_ok=True)
        shards = open_shard_set(model_path)
        models = {int(t): open_source(p, t) for t, p in sources.items()}
        self.sources = open_sources(
            model_path, out_dir=self.work_dir, originals=shards.tensors, models=models
        )
        roots = sorted({os.path.dirname(p) for p in shards.paths} | set(self.sources.roots))
        self.runtime = HotSwapRuntime.open(model_path, storage=options.storage, allowed_roots=roots)
        assert self.runtime.shards is not None, "open() keeps the shard set"
        hparams = HParams.from_metadata(
            self.runtime.shards.metadata, source=self.runtime.shards.first.path
        )
        model = decoder_of(self.runtime, options.numerics.value)
        tokens, bos = text_tokens(GgufTokenizer.from_file(self.runtime.shards.first.path), text)
        n_ctx = min(options.n_ctx, hparams.context_length)
        chunks = text_chunks(tokens, n_ctx=n_ctx, max_chunks=options.max_chunks)
        self.evaluator = ChunkEvaluator(
            model, chunks, bos, numerics=options.numerics, storage=options.storage,
            source=model_path, text=text,
        )  # fmt: skip
        self.target = InProcessTarget(
            runtime=self.runtime,
            evaluator=self.evaluator,
            sources=self.sources,
            out_dir=self.work_dir,
            commit_timeout_s=options.commit_timeout_s,
        )
        self.sweep = Sweep(
            target=self.target, recipe=recipe, out_dir=self.work_dir, options=options
        )
        self.verify_chunks = options.verify_chunks
        self.base: BaseLogProbs | None = None
        self.record: dict[str, Any] = {}

    def describe(self) -> dict[str, Any]:
        """Who and where this worker is, and what it loaded (the driver compares them), or
        ``error``: why it could not load it."""
        info = WorkerInfo(
            name=self.name,
            node_id=ray.get_runtime_context().get_node_id(),
            host=socket.gethostname(),
            pid=os.getpid(),
            work_dir=str(self.work_dir),
        )
        if self.error is not None:
            return {"info": info, "error": self.error}
        return {
            "info": info,
            "error": None,
            "identity": self.evaluator.identity(self.target.originals),
            "originals": dict(self.target.originals),
            "computed": self.target.computed,
            "model_name": self.runtime.model_name,
        }

    def source_problems(self, targets: set[int], example: str) -> list[str]:
        """The target types this worker's sources cannot make (before the first round)."""
        return self.target.source_problems(targets, example)

    def compute_baseline(self) -> tuple[dict[str, Any], bytes]:
        """The baseline, evaluated here: ``(baseline.json's record, baseline.logits' bytes)``."""
        record = self.target.baseline()
        return record, (self.work_dir / BASELINE_LOGITS).read_bytes()

    def load_baseline(self, record: dict[str, Any], data: bytes) -> list[str]:
        """Take the driver's baseline; the digests of this worker's first chunks (0: all) at the
        loaded weights, which must be the baseline's."""
        if record["identity"] != self.evaluator.identity(self.target.originals):
            raise SweepError(f"worker {self.name}: the baseline is of another model or text")
        if not (self.work_dir / BASELINE_LOGITS).exists() or (
            (self.work_dir / BASELINE_LOGITS).read_bytes() != data
        ):
            write_bytes(self.work_dir / BASELINE_LOGITS, data)
        self.base = BaseLogProbs(self.work_dir / BASELINE_LOGITS)
        self.record = record
        return self.target.digests(self.runtime.weight_version, self.verify_chunks)

    def run_round(self, r: Round) -> tuple[str, Any]:
        """``("recorded", record)``, ``("refused", why)`` or ``("failed", why)`` (the model is
        not back to its baseline: the sweep must stop)."""
        assert self.base is not None, "load_baseline comes first"
        marker = self.work_dir / CURRENT_ROUND
        write_text(marker, r.key)
        try:
            record = self.sweep.run_round(
                r, self.base, self.record["digests"], float(self.record["ppl"])
            )
        except RoundRefused as exc:
            return "refused", str(exc)
        except SweepError as exc:
            return "failed", f"worker {self.name}: {exc}"
        except Exception as exc:  # noqa: BLE001 (the model may be left swapped: stop)
            return "failed", f"worker {self.name}: {r.key}: {type(exc).__name__}: {exc}"
        finally:
            marker.unlink(missing_ok=True)
        return "recorded", record

    def close(self) -> None:
        self.runtime.close()


def write_bytes(path: Path, data: bytes) -> None:
    from ggufswap.shards import atomic_write

    def write(f: BinaryIO) -> None:
        f.write(data)

    atomic_write(path, write)


@dataclass
class _Worker:
    actor: Any  # the actor handle
    info: WorkerInfo
    described: dict[str, Any]  # what its describe() returned


@dataclass
class _Dispatch:
    """The rounds in flight, the queue, what came back and in what order it is recorded."""

    todo: list[Round]
    queue: deque[Round] = field(default_factory=deque)
    done: dict[str, tuple[str, Any]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    retried: list[dict[str, Any]] = field(default_factory=list)
    flushed: int = 0

    def __post_init__(self) -> None:
        self.queue.extend(self.todo)


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


def _alive_nodes() -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def _start_workers(
    model_path: str,
    *,
    text: str,
    recipe: Recipe,
    out_dir: Path,
    options: SweepOptions,
    ray_options: RayOptions,
    sources: Mapping[int, str],
    worker_class: type[SweepWorker],
) -> list[_Worker]:
    count = ray_options.workers or _alive_nodes()
    actor_class: Any = ray.remote(worker_class)
    base_dir = ray_options.work_dir or out_dir / WORKERS_DIR
    handles = []
    for i in range(count):
        name = f"w{i}"
        handles.append(
            actor_class.options(
                num_cpus=ray_options.threads or 1,
                scheduling_strategy="SPREAD",  # one per node while there are nodes
                max_restarts=0,
                max_concurrency=1,
            ).remote(
                name=name,
                model_path=str(model_path),
                text=text,
                options=options,
                recipe=recipe,
                work_dir=str(base_dir / name),
                threads=ray_options.threads,
                cpu=i if ray_options.pin_cpus else None,
                sources={int(t): p for t, p in sources.items()},
            )
        )
    workers: list[_Worker] = []
    described = [h.describe.remote() for h in handles]
    for i, (handle, ref) in enumerate(zip(handles, described, strict=True)):
        try:
            d = _get(ref, ray_options.call_timeout_s, f"starting sweep worker w{i}")
        except RayError as exc:  # it died
            raise SweepError(f"sweep worker w{i} did not start: {_cause(exc)}") from None
        if d["error"] is not None:
            raise SweepError(f"sweep worker w{i} did not start on {d['info'].host}: {d['error']}")
        workers.append(_Worker(actor=handle, info=d["info"], described=d))
    first = workers[0].described
    for w in workers[1:]:
        d = w.described
        if d["identity"] != first["identity"]:
            raise SweepError(
                f"worker {w.info.name} on {w.info.host} loaded {model_path} as "
                f"{d['identity']}, worker {workers[0].info.name} on {workers[0].info.host} as "
                f"{first['identity']}: every node needs the same model copy and text"
            )
    return workers


def _stored_baseline(out_dir: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """The baseline ``out_dir`` holds for ``identity`` (as the single-host sweep reuses it)."""
    path = out_dir / BASELINE_JSON
    if not (path.exists() and (out_dir / BASELINE_LOGITS).exists()):
        return None
    stored = json.loads(path.read_text())
    if stored.get("identity") == identity:
        return dict(stored)
    if (out_dir / JOURNAL).exists():
        raise SweepError(
            f"{out_dir} holds the sweep of another model, text or context "
            f"({path}: {stored.get('identity')} != {identity}); use a new --out"
        )
    return None


def _baseline(
    workers: list[_Worker], out_dir: Path, identity: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """Load or compute the baseline, ship it to every worker and check their digests."""
    record = _stored_baseline(out_dir, identity)
    if record is None:
        computed = None
        for w in list(workers):  # the first worker that survives computing it
            try:
                computed = _get(w.actor.compute_baseline.remote(), timeout_s, "the baseline")
                break
            except RayActorError:
                log.warning("sweep.ray.worker_died", worker=w.info.name, during="baseline")
                workers.remove(w)
        if computed is None:
            raise SweepError("every worker died computing the baseline")
        record, data = computed
        write_bytes(out_dir / BASELINE_LOGITS, data)
        write_text(out_dir / BASELINE_JSON, json.dumps(record, indent=1) + "\n")
    data_ref = ray.put((out_dir / BASELINE_LOGITS).read_bytes())
    refs = [(w, w.actor.load_baseline.remote(record, data_ref)) for w in workers]
    for w, ref in refs:
        try:
            got = _get(ref, timeout_s, f"worker {w.info.name} loading the baseline")
        except RayActorError:
            log.warning("sweep.ray.worker_died", worker=w.info.name, during="baseline")
            workers.remove(w)
            continue
        for c, digest in enumerate(got):
            if digest != record["digests"][c]:
                raise SweepError(
                    f"worker {w.info.name} on {w.info.host}: chunk {c}'s logits differ from the "
                    f"baseline's (digest {digest} != {record['digests'][c]}); its model copy, "
                    "torch build or thread count computes other logits"
                )
    if not workers:
        raise SweepError("every worker died loading the baseline")
    return record


def _dispatch(
    workers: list[_Worker],
    state: _Dispatch,
    *,
    timeout_s: float,
    max_failures: int,
    on_dispatch: Dispatched | None,
) -> Iterator[tuple[Round, str, Any]]:
    """Run ``state.todo`` over ``workers``; yield ``(round, outcome, payload)`` in todo order."""
    idle = list(workers)
    inflight: dict[Any, tuple[_Worker, Round, float]] = {}
    while state.flushed < len(state.todo):
        while idle and state.queue:
            w, r = idle.pop(0), state.queue.popleft()
            inflight[w.actor.run_round.remote(r)] = (w, r, time.monotonic())
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
            if ref not in ready and now - started > timeout_s:  # hung: take the worker down
                log.warning("sweep.ray.round_timeout", worker=w.info.name, round=r.key)
                ray.kill(w.actor, no_restart=True)
                inflight[ref] = (w, r, float("inf"))  # killed once; its death comes next
        for ref in ready:
            w, r, _ = inflight.pop(ref)
            try:
                outcome, payload = ray.get(ref, timeout=timeout_s)
            except RayActorError as exc:
                n = state.failures[r.key] = state.failures.get(r.key, 0) + 1
                state.retried.append({"key": r.key, "worker": w.info.name, "host": w.info.host})
                log.warning("sweep.ray.worker_died", worker=w.info.name, round=r.key, why=str(exc))
                if n >= max_failures:
                    state.done[r.key] = ("refused", f"{r.key}: {n} workers died running it")
                else:
                    state.queue.appendleft(r)  # next free worker runs it again
                continue
            except RayError as exc:  # a bug, not a verdict on the round: stop
                raise SweepError(f"worker {w.info.name} failed on {r.key}: {_cause(exc)}") from None
            if outcome == "failed":
                raise SweepError(str(payload))
            if outcome == "recorded":
                payload["worker"] = asdict(w.info)
            state.done[r.key] = (outcome, payload)
            idle.append(w)
        while state.flushed < len(state.todo) and state.todo[state.flushed].key in state.done:
            r = state.todo[state.flushed]
            state.flushed += 1
            yield (r, *state.done.pop(r.key))


def _no_progress(rounds: Iterator[Round], total: int) -> Iterator[Round]:
    return rounds


def run_ray_sweep(
    model_path: str | os.PathLike[str],
    *,
    text: str,
    recipe: Recipe,
    out_dir: Path,
    options: SweepOptions,
    ray_options: RayOptions,
    sources: Mapping[int, str] | None = None,
    progress: Callable[[Iterator[Round], int], Iterator[Round]] = _no_progress,
    announce: Callable[[str], None] | None = None,
    on_dispatch: Dispatched | None = None,
    worker_class: type[SweepWorker] = SweepWorker,
) -> RaySweepReport:
    """The whole sweep over Ray workers; its files in ``out_dir`` are a single-host sweep's.

    ``model_path`` (and each of ``sources``, a path per type) must exist on every worker's
    node. ``on_dispatch`` is called in the driver each time a round is handed to a worker;
    ``worker_class`` (a :class:`SweepWorker` subclass, importable or pickled by value on the
    workers) instruments the workers.

    Size: being reworked by issue 24; split there.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    started_ray = _connect(ray_options.address)
    workers: list[_Worker] = []
    try:
        workers = _start_workers(
            str(model_path),
            text=text,
            recipe=recipe,
            out_dir=out_dir,
            options=options,
            ray_options=ray_options,
            sources=sources or {},
            worker_class=worker_class,
        )
        first = workers[0].described
        if announce is not None:
            hosts = sorted({w.info.host for w in workers})
            announce(
                f"{first['model_name']}: {len(workers)} Ray workers on {len(hosts)} "
                f"node(s) ({', '.join(hosts)}), results in {out_dir}"
            )
        originals: Mapping[str, TensorRecord] = first["originals"]
        types = {n: rec.ggml_type for n, rec in originals.items()}
        rounds, skipped = plan_rounds(recipe, originals, computed=first["computed"], types=types)
        if rounds:
            problems = _get(
                workers[0].actor.source_problems.remote(
                    {int(r.target) for r in rounds}, rounds[0].tensors[0]
                ),
                ray_options.call_timeout_s,
                "checking the sources",
            )
            if problems:
                raise SweepError(
                    "no source for these target types (nothing was run):\n  "
                    + "\n  ".join(problems)
                )
        base_record = _baseline(workers, out_dir, first["identity"], ray_options.call_timeout_s)
        journal = Journal(out_dir / JOURNAL)
        report = RaySweepReport(
            out_dir=out_dir,
            ppl_base=float(base_record["ppl"]),
            rounds_planned=len(rounds),
            skipped=skipped,
            protocol=dict(base_record.get("protocol", {})),
        )
        layout = SuiteLayout.of(recipe, rounds, skipped, originals, base_record, options)
        todo = [r for r in rounds if r.key not in journal]
        report.resumed = len(rounds) - len(todo)
        state = _Dispatch(todo=todo)
        results = _dispatch(
            workers,
            state,
            timeout_s=ray_options.round_timeout_s,
            max_failures=ray_options.max_round_failures,
            on_dispatch=on_dispatch,
        )
        outcomes: dict[str, tuple[str, Any]] = {}

        def in_order() -> Iterator[Round]:
            for r, outcome, payload in results:
                outcomes[r.key] = (outcome, payload)
                yield r

        for r in progress(in_order(), len(todo)):
            outcome, payload = outcomes.pop(r.key)
            if outcome != "recorded":
                report.refused.append({"key": r.key, "tensors": list(r.tensors), "why": payload})
                log.warning("sweep.round_refused", round=r.key, why=payload)
                continue
            journal.append(payload)
            report.recorded.append(payload)
            write_outputs(out_dir, layout, journal.records.values(), report.refused)
            log.info("sweep.round", round=r.key, kld=payload["metrics"]["kld_mean"])
        report.journal = dict(journal.records)
        write_outputs(out_dir, layout, journal.records.values(), report.refused)
        write_report(report)
        report.workers = [w.info for w in workers]
        report.retried = state.retried
        ray_summary = {"workers": [asdict(w) for w in report.workers], "retried": report.retried}
        write_text(out_dir / RAY_JSON, json.dumps(ray_summary, indent=1) + "\n")
        return report
    finally:
        for w in workers:
            ray.kill(w.actor, no_restart=True)
        if started_ray:
            ray.shutdown()
