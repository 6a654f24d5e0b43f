"""The runtime library's public face: submit plans, commit them between batches.

Threads: ``submit`` (any thread) validates synchronously and queues the plan; one stager thread
stages plans one at a time; the inference thread calls :meth:`HotSwapRuntime.at_batch_boundary`
between batches, which commits every staged plan in order. The stager stages the next plan only
after the previous one is committed or rejected, so a staged plan never copies a buffer that an
earlier commit is about to replace.

Usage::

    runtime = HotSwapRuntime.open(model_path, pools=..., allowed_roots=[...])
    model = Transformer(config, runtime.store)
    while serving:
        runtime.at_batch_boundary()   # commits staged plans; cheap when there are none
        logits = model(batch)

Size: ~650 lines in one class, because its three threads (submit, the stager, the inference
loop) share one queue, one deque of staged plans and the locks that order them, and each step of
a plan's life reads that shared state (the stager's crash handling rejects the plan it held; the
checks of mapped weights at the batch boundary run under the commit lock). What does not touch
it lives apart: opening a model (``opening.py``), placement (``placement.py``), validation
(``validate.py``), staging (``staging.py``), the commit itself (``commit.py``), what became of
the plans (``history.py``), the group's agreement (``coordinated.py``) and the integrity of
mapped weights (``integrity.py``).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from ggufswap.config import DEFAULT_DECODED_CACHE, MapShards, Storage
from ggufswap.ipc import (
    Event,
    Plan,
    PlanAcceptedEvent,
    PlanCommittedEvent,
    PlanRejectedEvent,
    PlanStagedEvent,
    Reason,
    TensorsLostEvent,
)
from ggufswap.ipc.supervisor import Supervised
from ggufswap.logs import get_logger
from ggufswap.runtime.commit import commit
from ggufswap.runtime.coordinated import Coordinator, Decision, GroupOptions
from ggufswap.runtime.errors import PlanRejected, RuntimeLibraryError, StagingFailed, WeightsLost
from ggufswap.runtime.history import PlanHistory
from ggufswap.runtime.integrity import check_mapped
from ggufswap.runtime.kernels import kernels
from ggufswap.runtime.opening import load_model
from ggufswap.runtime.placement import Placement
from ggufswap.runtime.plans import Follower, PlanState, PlanTicket, another_plan
from ggufswap.runtime.pools import Buffer, Pool
from ggufswap.runtime.staging import StagedPlan, Stager
from ggufswap.runtime.store import Slot, TensorStore
from ggufswap.runtime.validate import validate_plan
from ggufswap.shards import HeaderCache, ShardSet

log = get_logger(__name__)

# How long a commit holds its plan.committed event back for the stager to finish delivering the
# plan's plan.staged (listeners run there; a slow one delays the commit's event, not the commit).
_PUBLISH_WAIT_S = 5.0

CommitCallback = Callable[[int, tuple[str, ...]], None]
EventCallback = Callable[[Event], None]

_STOP: Final = object()
# Plans that never ran because the runtime stopped: stale, so the agent plans them again.
_SHUTTING_DOWN: Final = Reason("*", "runtime shutting down", stale=True)


class HotSwapRuntime:
    """Applies reload plans to a :class:`TensorStore` atomically, between batches."""

    def __init__(
        self,
        store: TensorStore,
        *,
        model_name: str,
        allowed_roots: Sequence[str],
        stable_pointers: bool | None = None,
        coordinator: Coordinator | None = None,
    ) -> None:
        self.store = store
        # Set when the runtime is one rank of a group: plans commit on every rank or on none.
        self._coordinator = coordinator
        # Plans the group rejected before this rank staged them: plan id -> (ticket, reasons).
        self._doomed: dict[str, tuple[PlanTicket, tuple[Reason, ...]]] = {}
        self.model_name = model_name
        self.allowed_roots = [os.path.realpath(r) for r in allowed_roots]
        self._stable = stable_pointers
        self._stager = Stager(store, stable_pointers=self._stable_pointers_for)
        self._queue: queue.Queue[object] = queue.Queue()
        self._staged: collections.deque[tuple[PlanTicket, StagedPlan]] = collections.deque()
        self._commit_lock = threading.Lock()
        # One submit at a time, so a plan id is applied once (re-entrant: listeners may submit).
        self._submit_lock = threading.RLock()
        self._cond = threading.Condition()
        self._closed = False  # set under _cond by close(); the stager then stages nothing more
        # Buffers replaced by commits, already released from their pools' accounting: the stager
        # thread drops these last references, so freeing 64 MiB is not part of the commit stall.
        self._retired: list[Buffer] = []
        self._in_flight = 0  # queued or staged, not yet final
        self._history = PlanHistory()
        self._on_commit: list[CommitCallback] = []
        self._on_event: list[EventCallback] = []
        self.last_stall_s: float | None = None
        self.bytes_reloaded = 0
        self._staging: PlanTicket | None = None  # the ticket the stager works on
        self._reported_at_boundary = 0  # store.maps.reported as the last batch began
        self._stopped = threading.Event()  # set by close(): ends a restart's backoff
        self._thread = Supervised(
            "ggufswap-stager",
            self._stage_loop,
            stop=self._stopped,
            on_crash=self._stager_crashed,
            context={"model": model_name},
        ).start()

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        model: str | os.PathLike[str],
        *,
        pools: list[Pool] | None = None,
        fallback_pool: str | None = None,
        storage: Storage = Storage.DEQUANTIZED,
        compute_dtype: torch.dtype = torch.float32,
        strict: bool = False,
        decoded_cache: int = DEFAULT_DECODED_CACHE,
        map_shards: MapShards = MapShards.OFF,
        placement: Placement | None = None,
        allowed_roots: Sequence[str] | None = None,
        stable_pointers: bool | None = None,
        model_name: str | None = None,
        progress: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
        group: torch.distributed.ProcessGroup | GroupOptions | bool | None = None,
        headers: HeaderCache | None = None,
    ) -> HotSwapRuntime:
        """Load the shard set containing ``model`` onto ``pools`` and start the stager.

        The model's options are :func:`~ggufswap.runtime.opening.load_model`'s (``storage=AUTO``
        is resolved there). ``allowed_roots``: the directories plans may name (default: the
        model's own). ``on_progress(done, total)``: the bytes of the load read so far (a server's
        ``/health``). ``headers``: headers already parsed (load_model's).
        ``group``: a ``torch.distributed`` process group (``True``: the default group), or a
        :class:`~ggufswap.runtime.coordinated.GroupOptions` naming one and its deadlines, makes
        this runtime one rank of a coordinated commit (:mod:`ggufswap.runtime.coordinated`).
        """
        shards, store, name = load_model(
            model,
            pools=pools,
            fallback_pool=fallback_pool,
            storage=storage,
            compute_dtype=compute_dtype,
            strict=strict,
            decoded_cache=decoded_cache,
            map_shards=map_shards,
            placement=placement,
            model_name=model_name,
            progress=progress,
            on_progress=on_progress,
            headers=headers,
        )
        roots = (
            list(allowed_roots)
            if allowed_roots is not None
            else [os.path.dirname(shards.first.path)]
        )
        coordinator = None
        if group is not None and group is not False:
            coordinator = Coordinator.of(group)
        runtime = cls(
            store,
            model_name=name,
            allowed_roots=roots,
            stable_pointers=stable_pointers,
            coordinator=coordinator,
        )
        runtime.shards = shards
        return runtime

    shards: ShardSet | None = None

    def _stable_pointers_for(self, pool: Pool) -> bool:
        if self._stable is not None:
            return self._stable
        return pool.device.type == "cuda"

    # -- callbacks -------------------------------------------------------------------------

    def on_commit(self, callback: CommitCallback) -> None:
        """Call ``callback(weight_version, changed)`` in the inference thread after a commit.

        A callback that raises does not undo the commit: every callback still runs, and the first
        exception is raised from :meth:`at_batch_boundary` once the plans are marked committed.
        """
        self._on_commit.append(callback)

    def on_event(self, callback: EventCallback) -> None:
        """Call ``callback(event)`` for plan and tensor events, each a record of
        :mod:`ggufswap.ipc.events` with its ``topic`` (in the thread that caused it)."""
        self._on_event.append(callback)

    def _emit(self, event: Event) -> None:
        for callback in self._on_event:
            try:
                callback(event)
            except Exception:  # a listener must not break the runtime
                log.exception("event.listener_failed", topic=event.topic.value)

    # -- plans -----------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self.store.weight_version

    def submit(self, plan: Plan, *, follow: Follower | None = None) -> PlanTicket:
        """Validate ``plan`` and queue it for staging; a refused plan is returned REJECTED.

        Re-submitting a plan id that is already known returns the existing ticket: a plan is
        applied at most once. ``follow`` follows the ticket (:meth:`PlanTicket.follow`) from
        the state validation leaves it in (RECEIVED, or REJECTED) before the stager can move
        it, or from the current state of a known ticket. Refused on a rank of a coordinated
        group other than its leader (plans enter there and the leader hands them on).
        """
        if self._coordinator is not None and not self._coordinator.leader:
            raise RuntimeLibraryError(
                f"submit() on rank {self._coordinator.rank} of a coordinated group: plans enter "
                "at rank 0 only (it hands each plan to every rank); submit it there"
            )
        with self._submit_lock:
            return self._submit(plan, follow)

    def _submit(self, plan: Plan, follow: Follower | None, *, mirror: bool = False) -> PlanTicket:
        # ``mirror``: a plan the group's leader handed to this rank; only a plan still in flight
        # here is the same one (the leader took it anew: so does this rank).
        known = self._history.get(plan.plan_id)
        if known is not None and mirror and known.state.final:
            known = None
        if known is not None and known.state is not PlanState.REJECTED:
            if not mirror and not known.plan.same_as(plan):  # a mirror: as the leader decides
                return self._another_under(known, plan, follow)
            if follow is not None:
                known.follow(follow)
            return known
        ticket = PlanTicket(plan)
        self._history.remember(ticket)
        if self._closed:
            self._finish_rejected(ticket, [Reason("*", "the runtime is closed", stale=True)])
            if follow is not None:
                ticket.follow(follow)
            return ticket
        try:
            reasons = validate_plan(plan, self.store, allowed_roots=self.allowed_roots)
        except Exception as exc:  # a bug in validation must not leave a ticket that never ends
            log.exception("plan.validation_failed", plan_id=plan.plan_id)
            reasons = [Reason("*", f"validation failed: {exc!r}")]
        if plan.model and plan.model != self.model_name:
            reasons.append(
                Reason(
                    "*",
                    f"plan is for model {plan.model!r}, this runtime serves {self.model_name!r}",
                )
            )
        if reasons:
            self._finish_rejected(ticket, reasons)
        if self._coordinator is not None and (mirror or not reasons):
            # The leader hands on what it accepted; another rank votes on all it was handed.
            self._coordinator.track(ticket, broadcast=not mirror)
        if follow is not None:
            ticket.follow(follow)
        if reasons:
            return ticket
        self._emit(PlanAcceptedEvent(plan_id=plan.plan_id, tensors=len(plan.jobs)))
        with self._cond:
            self._in_flight += 1
        self._queue.put(ticket)
        return ticket

    def _another_under(self, known: PlanTicket, plan: Plan, follow: Follower | None) -> PlanTicket:
        """``plan`` under the id of another plan the runtime has (``known``): refused on its own
        ticket, counted (``id_reused`` in the status's plans) but neither kept nor announced (the
        id stays ``known``'s: a ``plan.rejected`` event would tell its client otherwise)."""
        state = known.state.value.lower()
        ticket = PlanTicket(plan)
        ticket.reject(list(another_plan(plan.plan_id, state).reasons))
        self._history.reused(ticket, state)
        if follow is not None:
            ticket.follow(follow)
        return ticket

    def apply(self, plan: Plan, *, timeout: float = 60.0) -> PlanTicket:
        """Submit, wait until staged and commit now (for callers without a serving loop)."""
        if self._coordinator is not None:
            raise RuntimeLibraryError(
                "apply() is not for a rank of a coordinated group: submit() on the leader and "
                "call at_batch_boundary() at the same steps on every rank"
            )
        ticket = self.submit(plan)
        deadline = time.monotonic() + timeout
        while not ticket.state.final and time.monotonic() < deadline:
            self.wait_staged(timeout=max(0.0, deadline - time.monotonic()))
            self.at_batch_boundary()
        if not ticket.state.final:
            raise TimeoutError(f"plan {plan.plan_id} not applied within {timeout}s")
        if ticket.state is PlanState.REJECTED:
            raise PlanRejected(plan.plan_id, list(ticket.reasons), stale=ticket.stale)
        return ticket

    @property
    def plans_in_flight(self) -> int:
        """Plans accepted and not yet committed or rejected (queued, staging or staged): a
        server that starts no new request while there are any bounds a commit by its longest
        request in flight, and the stager does not compete with new work for the CPU."""
        with self._cond:
            return self._in_flight

    def wait_staged(self, timeout: float) -> bool:
        """Block until a plan is staged or none is in flight; True if something is staged."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._staged) or self._in_flight == 0, timeout)
            return bool(self._staged)

    def _settled(self, n: int) -> None:
        with self._cond:
            self._in_flight -= n
            self._cond.notify_all()

    def ticket(self, plan_id: str) -> PlanTicket | None:
        return self._history.get(plan_id)

    def _finish_rejected(self, ticket: PlanTicket, reasons: list[Reason]) -> None:
        ticket.reject(reasons)
        self._history.rejected(ticket)
        self._emit(
            PlanRejectedEvent(plan_id=ticket.plan_id, stale=ticket.stale, reasons=ticket.reasons)
        )

    # -- staging (background thread) -------------------------------------------------------

    def _stage_loop(self) -> None:
        """The stager thread's body (supervised: restarted with backoff when it raises)."""
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            assert isinstance(item, PlanTicket), "only tickets are queued"
            self._staging = item
            self._stage_one(item)
            self._staging = None

    def _stager_crashed(self, exc: BaseException) -> None:
        """The stager raised outside staging (a bug): its plan is rejected, never left
        undecided, so its client re-plans."""
        ticket, self._staging = self._staging, None
        if ticket is None or ticket.state.final:
            return
        with self._cond:
            entry = next((e for e in self._staged if e[0] is ticket), None)
            if entry is not None:
                self._staged.remove(entry)
        if entry is not None:
            entry[1].discard()
        if ticket.state is not PlanState.COMMITTED:
            self._finish_rejected(ticket, [Reason("*", f"stager crashed: {exc!r}", stale=True)])
            self._settled(1)

    def _stage_one(self, ticket: PlanTicket) -> None:
        if self._closed:  # taken off the queue just before close() drained it
            self._finish_rejected(ticket, [_SHUTTING_DOWN])
            self._settled(1)
            return
        with self._cond:
            doom = self._doomed.pop(ticket.plan_id, None)
        if doom is not None and doom[0] is ticket:  # the group rejected it already
            self._finish_rejected(ticket, list(doom[1]))
            self._settled(1)
            return
        ticket.move(PlanState.STAGING)
        started = time.monotonic()
        try:
            staged = self._stager.stage(ticket.plan)
        except StagingFailed as exc:  # a stale job, or a tensor that cannot be placed
            self._finish_rejected(ticket, [exc.reason])
            self._settled(1)
            return
        except Exception as exc:  # a bug or a device error: the model stays as it was
            log.exception("plan.staging_failed", plan_id=ticket.plan_id)
            self._finish_rejected(ticket, [Reason("*", f"staging failed: {exc!r}")])
            self._settled(1)
            return
        ticket.stage_s = time.monotonic() - started
        ticket.bytes_read = staged.bytes_read
        ticket.move(PlanState.STAGED)
        with self._cond:
            closing = self._closed
            doom = self._doomed.pop(ticket.plan_id, None)
            doomed = doom is not None and doom[0] is ticket  # rejected by the group meanwhile
            if not closing and not doomed:
                self._staged.append((ticket, staged))
                self._cond.notify_all()
        if closing or doomed:  # it will never be committed
            staged.discard()
            self._finish_rejected(ticket, list(doom[1]) if doom and doomed else [_SHUTTING_DOWN])
            self._settled(1)
            return
        # Published once the plan can be committed (a listener may commit it at once); the
        # inference thread holds its plan.committed back until this has been delivered.
        self._emit(PlanStagedEvent(plan_id=ticket.plan_id, stage_ms=round(ticket.stage_s * 1e3, 3)))
        ticket.staged_published.set()
        # One plan in flight: the next is staged against the buffers this one leaves behind.
        ticket.wait()
        self._drop_retired()

    # -- commit (inference thread) ---------------------------------------------------------

    def at_batch_boundary(self) -> int:
        """Commit every staged plan; return the weight version the next batch runs on.

        Call it from the inference loop between two batches. With nothing staged and nothing
        mapped it costs two attribute checks. A rank of a coordinated group makes one
        collective here at every call and commits only what every rank has staged, so every
        rank calls it at the same steps. A commit callback that raises does not undo the
        commit: its error is raised once the plans are recorded as committed.

        Raises :class:`WeightsLost` while served tensors are out of service (their mapped
        bytes changed outside any commit, ``runtime/integrity.py``): the next batch must not
        run; call again (a commit of the agent's plan restores them).
        """
        agreed = self._agree() if self._coordinator is not None else None
        version = self._commit_all(agreed) if self._staged else self.store.weight_version
        if self.store.maps.open_files or self.store.lost:
            self._refuse_lost()
        return version

    def batch_intact(self) -> bool:
        """After a batch: whether nothing it read may have changed since ``at_batch_boundary``
        (no mapped file shrank, faulted, or was reported, and the lease watcher's pass is
        recent: a process stopped mid-batch may have had its lease broken). A loop drops a
        batch for which this is False (its output may mix bytes), as it would a refused one."""
        maps = self.store.maps
        if not maps.open_files:
            return True
        return maps.reported == self._reported_at_boundary and not (maps.suspect() or maps.stale())

    def _refuse_lost(self) -> None:
        with self._commit_lock:
            before = set(self.store.lost)
            # Counted before the check: a report the watcher makes while it runs is not in
            # what it took out of service, so batch_intact must see it as new (batch dropped).
            reported = self.store.maps.reported
            lost = dict(check_mapped(self.store))
            self._reported_at_boundary = reported
        if set(lost) - before:
            reasons = tuple(Reason(name, why) for name, why in sorted(lost.items()))
            self._emit(TensorsLostEvent(reasons=reasons))
        if lost:
            raise WeightsLost(lost)

    def _commit_all(self, agreed: set[str] | None) -> int:
        """Commit the staged plans (all, or those ``agreed``) and record them as committed;
        the weight version after them. A commit callback's error is raised after that."""
        committed, errors, stall, version = self._commit_staged(agreed)
        if not committed:
            return version
        for ticket in committed:
            ticket.stall_s = stall
            self.bytes_reloaded += ticket.bytes_read
            ticket.move(PlanState.COMMITTED)
            self._history.committed(ticket, weight_version=version, stall_s=stall)
            self._after_staged_published(ticket)
            self._emit(
                PlanCommittedEvent(
                    plan_id=ticket.plan_id,
                    weight_version=version,
                    stall_ms=round(stall * 1e3, 3),
                    changed=ticket.changed,
                )
            )
        self._settled(len(committed))
        if errors:
            log.error("commit.callback_failed", weight_version=version, errors=len(errors))
            raise errors[0]
        return version

    def _commit_staged(
        self, agreed: set[str] | None
    ) -> tuple[list[PlanTicket], list[Exception], float, int]:
        """Under the commit lock: commit the staged plans (those ``agreed``, for a rank of a
        group) in order, run the commit callbacks and release the replaced buffers; the plans,
        the callbacks' errors, the stall and the weight version they made."""
        with self._commit_lock:
            started = time.perf_counter()
            committed: list[PlanTicket] = []
            retired: list[Buffer] = []
            while self._staged and (agreed is None or self._staged[0][0].plan_id in agreed):
                committed.append(self._commit_one(*self._staged.popleft(), retired))
            version = self.store.weight_version
            if not committed:
                return committed, [], 0.0, version
            # A failing callback must not leave the commit's bookkeeping undone (the stager
            # would wait forever on a ticket never marked committed): the caller raises the
            # first error once the plans are recorded as committed.
            errors: list[Exception] = []
            changed = tuple(n for t in committed for n in t.changed)
            for callback in self._on_commit:
                try:
                    callback(version, changed)
                except Exception as exc:  # noqa: BLE001 (re-raised by the caller)
                    errors.append(exc)
            stall = time.perf_counter() - started
            for buffer in retired:  # old buffers go only after the commit: accounting now...
                buffer.release()
            with self._cond:  # ...memory later: the stager thread drops the last references
                self._retired.extend(retired)
            self.last_stall_s = stall
        return committed, errors, stall, version

    def _agree(self) -> set[str]:
        """One step of the group's agreement: take the leader's new plans, reject what any rank
        failed, and return the ids of the staged plans every rank may commit now."""
        assert self._coordinator is not None, "only a rank of a group agrees"
        with self._cond:
            staged_ids = [t.plan_id for t, _ in self._staged]
        incoming, verdicts = self._coordinator.step(staged_ids)
        for plan in incoming:
            with self._submit_lock:
                self._submit(plan, None, mirror=True)
        agreed: set[str] = set()
        for plan_id, (ticket, verdict) in self._coordinator.settle(verdicts).items():
            if verdict.decision is Decision.COMMIT:
                agreed.add(plan_id)
            elif not ticket.state.final:
                self._reject_for_group(ticket, verdict.reasons)
        return agreed

    def _reject_for_group(self, ticket: PlanTicket, reasons: tuple[Reason, ...]) -> None:
        """Reject a plan another rank failed: now if staged, else when the stager reaches it."""
        with self._commit_lock, self._cond:
            entry = next((e for e in self._staged if e[0] is ticket), None)
            if entry is not None:
                self._staged.remove(entry)
            else:
                self._doomed[ticket.plan_id] = (ticket, reasons)
        if entry is not None:
            entry[1].discard()
            self._finish_rejected(ticket, list(reasons))
            self._settled(1)

    def _after_staged_published(self, ticket: PlanTicket) -> None:
        """Wait (briefly) until the stager has delivered the plan's ``plan.staged``, so that
        listeners see staged before committed. A listener that commits from inside its own
        ``plan.staged`` callback (the stager thread) does not wait for itself."""
        if threading.current_thread() is self._thread.thread:
            return
        if not ticket.staged_published.wait(_PUBLISH_WAIT_S):
            log.warning("plan.staged_event_late", plan_id=ticket.plan_id)

    def _commit_one(
        self, ticket: PlanTicket, staged: StagedPlan, retired: list[Buffer]
    ) -> PlanTicket:
        """Apply one staged plan (the staged values stay referenced only by the stager)."""
        applied = commit(self.store, staged)
        retired.extend(applied.retired)
        ticket.changed = applied.changed
        ticket.weight_version = applied.weight_version
        for event in applied.events:
            self._emit(event)
        return ticket

    def _drop_retired(self) -> None:
        """Free the memory of buffers that commits replaced (stager thread, off the loop)."""
        with self._cond:
            retired, self._retired = self._retired, []
        del retired

    # -- reporting -------------------------------------------------------------------------

    def slots(self) -> dict[str, Slot]:
        return dict(self.store.slots)

    def status(self) -> dict[str, Any]:
        return (
            {
                "model": self.model_name,
                "weight_version": self.store.weight_version,
                "storage": self.store.storage.value,
                "kernels": kernels(),
                "decoded_cache": self.store.decoded.snapshot(),
                "mapped_shards": self.store.maps.snapshot(),
                **self._history.status(),  # plans, recent_plans
                "pending": self._queue.qsize() + len(self._staged),
                "tensor_states": self.store.state_counts(),
                "weights_lost": {
                    "count": len(self.store.lost),
                    "tensors": dict(sorted(self.store.lost.items())[:20]),
                },
                "pools": self.store.pools.snapshot(),
                "last_stall_ms": None
                if self.last_stall_s is None
                else round(self.last_stall_s * 1e3, 3),
                "bytes_reloaded": self.bytes_reloaded,
            }
            | ({"group": self._coordinator.status()} if self._coordinator is not None else {})
        )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the stager; queued and staged plans are rejected (nothing half-applied)."""
        if self._coordinator is not None:
            self._coordinator.close()
        with self._commit_lock, self._cond:
            self._closed = True
            staged_plans = list(self._staged)
            self._staged.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, PlanTicket):
                self._finish_rejected(item, [_SHUTTING_DOWN])
                self._settled(1)
        self._queue.put(_STOP)
        self._stopped.set()
        for ticket, staged in staged_plans:
            staged.discard()
            self._finish_rejected(ticket, [_SHUTTING_DOWN])
            self._settled(1)
        self._thread.join(timeout)
        self._drop_retired()
        self.store.maps.close()

    def __enter__(self) -> HotSwapRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
