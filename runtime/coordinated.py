"""Coordinated commit across ``torch.distributed`` ranks: a plan commits at the same step on
every rank of a group, or on none.

Each rank runs its own :class:`~ggufswap.runtime.HotSwapRuntime` over the same weights (the
replicated case) with one :class:`Coordinator` for the group. Plans enter at the leader (group
rank 0, the only rank with a control socket); at each ``at_batch_boundary()`` every rank makes
one ``all_gather_object`` of its :class:`RankView`: the leader's plans received since the last
step (the other ranks submit them, so every rank sees the same plans in the same order) and each
rank's vote on every plan not yet decided (staged, failed with reasons, or not yet). The
decision is a pure function of the gathered views (:func:`decide`), so every rank reaches the
same one at the same step: a plan every rank has staged commits everywhere; a plan any rank
failed (stale file, pool full, refused by validation) is rejected everywhere.

While no plan is undecided anywhere (the group is *idle*), a step gathers nothing: every
``probe_every`` steps (8) each rank posts the leader's one-integer broadcast "I have a plan to hand
on" without waiting, and reads it ``probe_every`` steps later, when it has long arrived; every
rank reads the same answer at the same step and gathers then. So an idle step costs a counter
check (and every 8th the post of that broadcast), a rank may run up to 8 steps ahead of another
before waiting for it, and a plan reaches the others at most 16 steps after the leader took it.
A step that waited for the others (the old all-gather at every step) made every rank run at the
slowest one's pace.

Two deadlines keep a rank from holding the others: a plan that some rank has not staged
``vote_timeout_s`` after the leader started staging it is rejected on every rank, naming the
ranks it waits for (the leader fails its ballot; the leader's clock alone decides); a collective
that fails (a rank died: its connection closed) raises :class:`~ggufswap.runtime.errors.RankLost`
on every rank that sees it, naming the ranks that no longer answer (``rank_loss.py``). A rank
that hangs without dying blocks the others until the process group's own timeout
(``init_process_group(timeout=...)``): set it to a few minutes, not torch's 30.

The contract: every rank of the group calls ``at_batch_boundary()`` at the same steps (the
gather is a collective; a rank that skips one blocks the others until the group's timeout).
Plans enter at the leader only: ``submit()`` on another rank is refused, as ``apply()`` is.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import torch
import torch.distributed as dist

from ggufswap.ipc import Plan, Reason
from ggufswap.runtime import rank_loss
from ggufswap.runtime.errors import RankLost
from ggufswap.runtime.plans import PlanState, PlanTicket

LEADER: Final = 0  # the group rank whose control socket receives plans
VOTE_TIMEOUT_S: Final = 60.0  # a plan not staged on every rank this long after the leader began
PROBE_EVERY: Final = 8  # steps between two idle probes
_instances = itertools.count()  # coordinators made by this process (the same order on each rank)
T = TypeVar("T")


class Vote(enum.IntEnum):
    """One rank's view of one plan at a step."""

    PENDING = 0  # not received yet, queued or staging
    STAGED = 1
    FAILED = 2


class Decision(enum.Enum):
    COMMIT = "commit"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class Ballot:
    plan_id: str
    vote: Vote
    reasons: tuple[Reason, ...] = ()


@dataclass(frozen=True, slots=True)
class RankView:
    """What one rank contributes to a step's all-gather."""

    rank: int
    ballots: tuple[Ballot, ...]
    plans: tuple[Plan, ...] = ()  # the leader's plans received since the last step, in order


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    reasons: tuple[Reason, ...] = ()


def decide(views: Sequence[RankView]) -> dict[str, Verdict]:
    """The group's verdict on each plan some rank voted on: rejected when any rank failed it
    (with every failing rank's reasons, each prefixed by its rank), committed when every rank
    has it staged, otherwise not decided yet (absent from the result)."""
    world = len(views)
    staged: dict[str, int] = {}
    failed: dict[str, list[Reason]] = {}
    order: list[str] = []
    for view in sorted(views, key=lambda v: v.rank):
        for ballot in view.ballots:
            if ballot.plan_id not in staged:
                staged[ballot.plan_id] = 0
                order.append(ballot.plan_id)
            if ballot.vote is Vote.STAGED:
                staged[ballot.plan_id] += 1
            elif ballot.vote is Vote.FAILED:
                reasons = ballot.reasons or (Reason("*", "failed"),)
                failed.setdefault(ballot.plan_id, []).extend(
                    Reason(r.tensor, f"rank {view.rank}: {r.reason}", r.stale) for r in reasons
                )
    verdicts: dict[str, Verdict] = {}
    for plan_id in order:
        if plan_id in failed:
            verdicts[plan_id] = Verdict(Decision.REJECT, tuple(failed[plan_id]))
        elif staged[plan_id] == world:
            verdicts[plan_id] = Verdict(Decision.COMMIT)
    return verdicts


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """A coordinated group and its deadlines (``HotSwapRuntime.open(group=...)``)."""

    group: dist.ProcessGroup | None = None  # None: the default group
    vote_timeout_s: float = VOTE_TIMEOUT_S
    # Idle: the leader's probe is posted every this many steps and read as many steps later (a
    # plan waits up to twice this before the first gather; a rank may run this far ahead).
    probe_every: int = PROBE_EVERY


class Coordinator:
    """One rank's side of the agreement; the engine calls :meth:`track` for each plan it takes
    and :meth:`step` at each batch boundary (the inference thread).

    Size: the probe, the deadline and the loss of a rank are each a few lines of the one step.
    """

    def __init__(self, options: GroupOptions | None = None) -> None:
        options = options if options is not None else GroupOptions()
        group = options.group
        if not dist.is_initialized():
            raise RuntimeError(
                "coordinated commit needs torch.distributed initialised first "
                "(torch.distributed.init_process_group, e.g. under torchrun)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.vote_timeout_s = options.vote_timeout_s
        self.probe_every = max(1, options.probe_every)
        self._lock = threading.Lock()
        self._outbox: list[Plan] = []  # leader: plans to hand to the others at the next step
        self._window: OrderedDict[str, PlanTicket] = OrderedDict()  # plans not decided yet
        self._started: dict[str, float] = {}  # leader: when it began staging each plan
        self._waiting_on: dict[str, tuple[int, ...]] = {}  # ranks that had not staged a plan
        self.steps = 0
        self.gathers = 0
        self.gather_s = 0.0  # time spent in the step's gather, summed
        self._idle = True  # no plan undecided on any rank: no gather until the leader has one
        # The idle probe: one int from the leader, posted at a step and read at the next.
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self._probe_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self._probe: Any = None  # the posted broadcast's work, or None
        self._leader_global = dist.get_global_rank(group, LEADER) if group is not None else LEADER
        self._collectives = 0  # numbers a failed collective's roll call
        self._lost: RankLost | None = None
        group_name = group.group_name if group is not None else "world"
        self._prefix = f"{group_name}/{next(_instances)}"
        rank_loss.register(self._prefix, self.rank)

    @classmethod
    def of(cls, group: dist.ProcessGroup | GroupOptions | bool) -> Coordinator:
        """The coordinator of ``open(group=...)``: True (the default group), a group, options."""
        if isinstance(group, GroupOptions):
            return cls(group)
        return cls(GroupOptions(group=group if isinstance(group, dist.ProcessGroup) else None))

    @property
    def leader(self) -> bool:
        return self.rank == LEADER

    def track(self, ticket: PlanTicket, *, broadcast: bool) -> None:
        """Count ``ticket`` in the votes until the group decides it; ``broadcast``: the leader
        hands its plan to the other ranks at the next step."""
        with self._lock:
            self._window[ticket.plan_id] = ticket
            self._window.move_to_end(ticket.plan_id)
            if broadcast and self.leader:
                self._outbox.append(ticket.plan)

    def step(self, staged: Iterable[str]) -> tuple[tuple[Plan, ...], dict[str, Verdict]]:
        """The collective: gather every rank's view; return the leader's new plans (for the other
        ranks to submit, before :meth:`settle`: a plan the leader failed at once is decided in
        the step that hands it on) and the group's verdicts. Idle, and not woken by the leader's
        probe: no gather, nothing new. RankLost when a rank is gone."""
        if self._lost is not None:
            raise self._lost
        self.steps += 1
        if self._idle and not self._woken():
            return (), {}
        staged_ids = set(staged)
        with self._lock:
            plans = tuple(self._outbox)
            self._outbox.clear()
            ballots = tuple(self._ballot(t, staged_ids) for t in self._window.values())
        mine = RankView(rank=self.rank, ballots=ballots, plans=plans)
        views: list[Any] = [None] * self.world_size
        started = time.perf_counter()
        self._collective(lambda: dist.all_gather_object(views, mine, group=self.group))
        self.gather_s += time.perf_counter() - started
        self.gathers += 1
        self._idle = not any(v.ballots or v.plans for v in views)
        self._note_waiting(views)
        incoming = () if self.leader else next(v.plans for v in views if v.rank == LEADER)
        return incoming, decide(views)

    def _woken(self) -> bool:
        """Idle: at every ``probe_every``-th step, True when the probe posted that many steps
        ago says the leader has a plan (every rank reads the same answer at this step and
        gathers now), else post the next probe; False at the steps between (nothing to do)."""
        if self.steps % self.probe_every:
            return False
        probe, self._probe = self._probe, None
        if probe is not None:
            self._collective(probe.wait)  # posted probe_every steps ago: arrived long since
            if self._probe_buf.item():
                return True
        with self._lock:
            busy = self.leader and bool(self._outbox or self._window)
        self._probe_buf.fill_(int(busy))
        self._probe = self._collective(
            lambda: dist.broadcast(
                self._probe_buf, src=self._leader_global, group=self.group, async_op=True
            )
        )
        return False

    def _collective(self, call: Callable[[], T]) -> T:
        """Run one of the group's collectives; RankLost (kept: every later step raises it)
        naming the ranks that no longer answer, when it fails."""
        self._collectives += 1
        try:
            return call()
        except RuntimeError as exc:  # the transport's error (DistBackendError is one)
            lost = tuple(
                rank_loss.roll_call(
                    self._prefix,
                    rank=self.rank,
                    world_size=self.world_size,
                    collective=self._collectives,
                    grace_s=min(rank_loss.ROLL_CALL_S, self.vote_timeout_s),
                )
            )
            said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            named = "; ".join(lost) if lost else "no rank could be named (no store)"
            self._lost = RankLost(
                f"rank {self.rank} of a coordinated group of {self.world_size}: a collective "
                f"failed at step {self.steps}: {named}. The group cannot agree on a plan without "
                f"every rank: stop this rank and restart the group (the transport said: {said})",
                lost,
            )
            raise self._lost from exc

    def _ballot(self, ticket: PlanTicket, staged: set[str]) -> Ballot:
        """This rank's vote; the leader fails a plan whose vote outlived ``vote_timeout_s``."""
        ballot = _ballot(ticket, staged)
        if not self.leader or ballot.vote is Vote.FAILED:
            return ballot
        now = time.monotonic()
        if ticket.state is not PlanState.RECEIVED:  # the leader is staging it, or has
            began = self._started.setdefault(ticket.plan_id, now)
            if now - began > self.vote_timeout_s:
                waiting = self._waiting_on.get(ticket.plan_id, ())
                ranks = ", ".join(map(str, waiting)) or "?"
                why = (
                    f"not staged on every rank within {self.vote_timeout_s:g} s of rank "
                    f"{LEADER} starting it (waiting on rank {ranks})"
                )
                return Ballot(ticket.plan_id, Vote.FAILED, (Reason("*", why),))
        return ballot

    def _note_waiting(self, views: Sequence[RankView]) -> None:
        """Leader: the ranks that had not staged each plan at this step (named on a deadline)."""
        if not self.leader:
            return
        staged: dict[str, set[int]] = {}
        for view in views:
            for b in view.ballots:
                staged.setdefault(b.plan_id, set())
                if b.vote is Vote.STAGED:
                    staged[b.plan_id].add(view.rank)
        with self._lock:
            for plan_id in self._window:
                done = staged.get(plan_id, set())
                self._waiting_on[plan_id] = tuple(
                    r for r in range(self.world_size) if r not in done
                )

    def settle(self, verdicts: dict[str, Verdict]) -> dict[str, tuple[PlanTicket, Verdict]]:
        """This rank's tickets for ``verdicts``; they leave the window (decided)."""
        decided: dict[str, tuple[PlanTicket, Verdict]] = {}
        with self._lock:
            for plan_id, verdict in verdicts.items():
                ticket = self._window.pop(plan_id, None)
                self._started.pop(plan_id, None)
                self._waiting_on.pop(plan_id, None)
                if ticket is not None:
                    decided[plan_id] = (ticket, verdict)
        return decided

    def close(self) -> None:
        """Wait for the probe still in flight (every rank posted it at the same step)."""
        probe, self._probe = self._probe, None
        if probe is not None and self._lost is None:
            with contextlib.suppress(RuntimeError):  # a rank gone at the end: nothing to agree
                probe.wait()

    def status(self) -> dict[str, Any]:
        with self._lock:
            undecided = list(self._window)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "steps": self.steps,
            "gathers": self.gathers,
            "idle": self._idle,
            "undecided": undecided,
            "vote_timeout_s": self.vote_timeout_s,
            "gather_ms_mean": round(self.gather_s / self.gathers * 1e3, 4)
            if self.gathers
            else None,
            "lost": list(self._lost.lost) if self._lost is not None else None,
        }


def _ballot(ticket: PlanTicket, staged: set[str]) -> Ballot:
    if ticket.state is PlanState.REJECTED:
        return Ballot(ticket.plan_id, Vote.FAILED, ticket.reasons)
    if ticket.plan_id in staged:
        return Ballot(ticket.plan_id, Vote.STAGED)
    return Ballot(ticket.plan_id, Vote.PENDING)
