"""What became of a link's plans: the one in flight, the last ones finished, counts by outcome.

The link (``agent/link.py``) drives the protocol with its runtime; this ledger only records the
plans it sends and their outcomes, for the agent's ``status`` (``pending_plan``, ``last_plans``,
``plans_sent``, ``plans_by_outcome``), its metrics, the link's own check of whether a
``plan.committed`` event is one of its plans, and the canonical ``plan`` log line of each plan
(its outcome and timings), written to the link's logger.

The link thread writes it; ``status`` and ``history`` are read from any thread under its lock.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ggufswap.ipc import Plan
from ggufswap.logs import Logger

HISTORY = 20  # finished plans kept for status


class Outcome(str, enum.Enum):
    COMMITTED = "committed"
    REJECTED = "rejected"
    STALE = "stale"  # rejected because a source file changed: re-planned
    ABANDONED = "abandoned"  # the runtime went away before an outcome: re-planned from state


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """A plan the link sent, and what became of it."""

    plan_id: str
    jobs: tuple[str, ...]
    sent_at: float  # time.time()
    outcome: Outcome | None = None
    weight_version: int | None = None
    reasons: tuple[str, ...] = ()
    duration_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "jobs": len(self.jobs),
            "tensors": list(self.jobs[:20]),
            "sent_at": self.sent_at,
            "outcome": self.outcome.value if self.outcome else "pending",
            "weight_version": self.weight_version,
            "reasons": list(self.reasons[:20]),
            "duration_s": self.duration_s,
        }


@dataclass
class InFlight:
    """The one plan a link has sent and not yet seen an outcome of."""

    plan: Plan
    msg: dict[str, Any]  # the wire message, re-sent as it is
    record: PlanRecord
    started: float  # monotonic
    last_heard: float  # monotonic


class PlanLedger:
    """One link's plans: :meth:`sent` opens the plan in flight, :meth:`finish` records its
    outcome."""

    def __init__(self, *, log: Logger) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._in_flight: InFlight | None = None
        self._history: deque[PlanRecord] = deque(maxlen=HISTORY)
        self.plans_sent = 0
        self.outcomes: dict[str, int] = {}  # plans by outcome since start (for metrics)

    @property
    def in_flight(self) -> InFlight | None:
        return self._in_flight

    def sent(self, plan: Plan, msg: dict[str, Any], now: float) -> InFlight:
        """``plan`` (as the wire message ``msg``) was sent at monotonic time ``now``."""
        record = PlanRecord(plan.plan_id, plan.names(), sent_at=time.time())
        flight = InFlight(plan, msg, record, started=now, last_heard=now)
        with self._lock:
            self._in_flight = flight
            self.plans_sent += 1
        return flight

    def finish(
        self,
        outcome: Outcome,
        now: float,
        *,
        weight_version: int | None = None,
        reasons: tuple[str, ...] = (),
    ) -> None:
        """The plan in flight ended with ``outcome`` (nothing happens when none is)."""
        flight = self._in_flight
        if flight is None:
            return
        duration = now - flight.started
        record = PlanRecord(
            plan_id=flight.record.plan_id,
            jobs=flight.record.jobs,
            sent_at=flight.record.sent_at,
            outcome=outcome,
            weight_version=weight_version,
            reasons=reasons,
            duration_s=round(duration, 6),
        )
        with self._lock:
            self._in_flight = None
            self._history.append(record)
            self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1
        # The canonical line of a plan: its outcome and timings.
        self._log.info(
            "plan",
            plan_id=record.plan_id,
            outcome=outcome.value,
            jobs=len(record.jobs),
            weight_version=weight_version,
            duration_ms=round(duration * 1000, 3),
            reasons=list(reasons[:20]),
        )

    def is_own(self, plan_id: str) -> bool:
        """Whether ``plan_id`` is the plan in flight or one of the kept plans this link saw
        committed (the link thread's view; it alone writes the ledger)."""
        flight = self._in_flight
        if flight is not None and flight.plan.plan_id == plan_id:
            return True
        return any(r.plan_id == plan_id and r.outcome is Outcome.COMMITTED for r in self._history)

    def history(self) -> list[PlanRecord]:
        with self._lock:
            return list(self._history)

    def status(self) -> dict[str, Any]:
        """The ledger's part of the link's ``status``."""
        with self._lock:
            flight = self._in_flight
            return {
                "pending_plan": flight.record.as_dict() if flight else None,
                "last_plans": [r.as_dict() for r in self._history],
                "plans_sent": self.plans_sent,
                "plans_by_outcome": dict(self.outcomes),
            }
