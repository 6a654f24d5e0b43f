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

The contract: every rank of the group calls ``at_batch_boundary()`` at the same steps (the
gather is a collective; a rank that skips one blocks the others until the group's timeout).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ggufswap.ipc import Plan, Reason
from ggufswap.runtime.plans import PlanState, PlanTicket

LEADER = 0  # the group rank whose control socket receives plans


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


class Coordinator:
    """One rank's side of the agreement; the engine calls :meth:`track` for each plan it takes
    and :meth:`step` at each batch boundary (the inference thread)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "coordinated commit needs torch.distributed initialised first "
                "(torch.distributed.init_process_group, e.g. under torchrun)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._lock = threading.Lock()
        self._outbox: list[Plan] = []  # leader: plans to hand to the others at the next step
        self._window: OrderedDict[str, PlanTicket] = OrderedDict()  # plans not decided yet
        self.steps = 0
        self.gather_s = 0.0  # time spent in the step's collective, summed

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
        the step that hands it on) and the group's verdicts."""
        staged_ids = set(staged)
        with self._lock:
            plans = tuple(self._outbox)
            self._outbox.clear()
            ballots = tuple(_ballot(t, staged_ids) for t in self._window.values())
        mine = RankView(rank=self.rank, ballots=ballots, plans=plans)
        views: list[Any] = [None] * self.world_size
        started = time.perf_counter()
        dist.all_gather_object(views, mine, group=self.group)
        self.gather_s += time.perf_counter() - started
        self.steps += 1
        incoming = () if self.leader else next(v.plans for v in views if v.rank == LEADER)
        return incoming, decide(views)

    def settle(self, verdicts: dict[str, Verdict]) -> dict[str, tuple[PlanTicket, Verdict]]:
        """This rank's tickets for ``verdicts``; they leave the window (decided)."""
        decided: dict[str, tuple[PlanTicket, Verdict]] = {}
        with self._lock:
            for plan_id, verdict in verdicts.items():
                ticket = self._window.pop(plan_id, None)
                if ticket is not None:
                    decided[plan_id] = (ticket, verdict)
        return decided

    def status(self) -> dict[str, Any]:
        with self._lock:
            undecided = list(self._window)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "steps": self.steps,
            "undecided": undecided,
            "gather_ms_mean": round(self.gather_s / self.steps * 1e3, 4) if self.steps else None,
        }


def _ballot(ticket: PlanTicket, staged: set[str]) -> Ballot:
    if ticket.state is PlanState.REJECTED:
        return Ballot(ticket.plan_id, Vote.FAILED, ticket.reasons)
    if ticket.plan_id in staged:
        return Ballot(ticket.plan_id, Vote.STAGED)
    return Ballot(ticket.plan_id, Vote.PENDING)
