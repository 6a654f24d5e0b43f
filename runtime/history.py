"""What became of the runtime's plans: the last ``HISTORY`` tickets by id, the count of each
outcome, and the one canonical ``plan`` log line of each plan.

A re-sent plan id is answered from its ticket here (:meth:`HotSwapRuntime.submit`), so the
history bounds how long a runtime recognises a plan it already applied; ``status`` shows the
counts and the last ten plans.
"""

from __future__ import annotations

import collections
from typing import Any, Final

from ggufswap.logs import get_logger
from ggufswap.runtime.plans import PlanTicket

log = get_logger(__name__)

HISTORY: Final = 64  # tickets kept by id


class PlanHistory:
    """The last ``HISTORY`` tickets by plan id, and the outcomes of every plan. Not locked: the
    runtime calls it under its submit lock or from the thread that finishes a plan."""

    def __init__(self) -> None:
        self._tickets: collections.OrderedDict[str, PlanTicket] = collections.OrderedDict()
        self.outcomes = collections.Counter[str]()

    def get(self, plan_id: str) -> PlanTicket | None:
        return self._tickets.get(plan_id)

    def remember(self, ticket: PlanTicket) -> None:
        """Keep ``ticket`` by its plan id (the newest), forgetting the oldest past ``HISTORY``."""
        self._tickets[ticket.plan_id] = ticket
        self._tickets.move_to_end(ticket.plan_id)
        while len(self._tickets) > HISTORY:
            self._tickets.popitem(last=False)

    def rejected(self, ticket: PlanTicket) -> None:
        """Count and log a plan rejected (stale or not) with its reasons."""
        outcome = "stale" if ticket.stale else "rejected"
        self.outcomes[outcome] += 1
        log.warning(
            "plan",
            outcome=outcome,
            plan_id=ticket.plan_id,
            stale=ticket.stale,
            reasons=[str(r) for r in ticket.reasons],
            tensors=len(ticket.plan.jobs),
        )

    def reused(self, ticket: PlanTicket, known: str) -> None:
        """Count and log a plan refused because its id names another plan (in state ``known``):
        the plan the id names is not touched, and ``ticket`` is not kept."""
        self.outcomes["id_reused"] += 1
        log.warning(
            "plan",
            outcome="id_reused",
            plan_id=ticket.plan_id,
            known=known,
            tensors=len(ticket.plan.jobs),
        )

    def committed(self, ticket: PlanTicket, *, weight_version: int, stall_s: float) -> None:
        """Count and log a plan committed at ``weight_version``, with its stage and stall."""
        self.outcomes["committed"] += 1
        log.info(
            "plan",
            outcome="committed",
            plan_id=ticket.plan_id,
            tensors=len(ticket.plan.jobs),
            changed=len(ticket.changed),
            bytes=ticket.bytes_read,
            weight_version=weight_version,
            stage_ms=round((ticket.stage_s or 0) * 1e3, 3),
            stall_ms=round(stall_s * 1e3, 3),
        )

    def status(self) -> dict[str, Any]:
        """The counts by outcome, and a summary of each of the last ten plans."""
        recent = list(self._tickets.values())[-10:]
        return {"plans": dict(self.outcomes), "recent_plans": [t.summary() for t in recent]}
