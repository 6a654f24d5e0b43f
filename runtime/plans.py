"""Plan lifecycle: ``RECEIVED → STAGING → STAGED → COMMITTED | REJECTED``, with guarded moves."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

from ggufswap.ipc.plan import Plan
from ggufswap.runtime.errors import Reason


class PlanState(enum.Enum):
    RECEIVED = "RECEIVED"
    STAGING = "STAGING"
    STAGED = "STAGED"
    COMMITTED = "COMMITTED"
    REJECTED = "REJECTED"

    @property
    def final(self) -> bool:
        return self in (PlanState.COMMITTED, PlanState.REJECTED)


_ALLOWED: dict[PlanState, frozenset[PlanState]] = {
    PlanState.RECEIVED: frozenset({PlanState.STAGING, PlanState.REJECTED}),
    PlanState.STAGING: frozenset({PlanState.STAGED, PlanState.REJECTED}),
    PlanState.STAGED: frozenset({PlanState.COMMITTED, PlanState.REJECTED}),
    PlanState.COMMITTED: frozenset(),
    PlanState.REJECTED: frozenset(),
}


class PlanStateError(RuntimeError):
    """An illegal lifecycle transition: a bug in the runtime, never an input problem."""


@dataclass(eq=False)
class PlanTicket:
    """The runtime's record of one plan; ``wait()`` blocks until it is committed or rejected."""

    plan: Plan
    state: PlanState = PlanState.RECEIVED
    reasons: tuple[Reason, ...] = ()
    stale: bool = False
    weight_version: int | None = None
    changed: tuple[str, ...] = ()
    bytes_read: int = 0
    received_at: float = field(default_factory=time.monotonic)
    stage_s: float | None = None
    stall_s: float | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id

    def move(self, to: PlanState) -> None:
        if to not in _ALLOWED[self.state]:
            raise PlanStateError(
                f"plan {self.plan_id}: cannot go from {self.state.name} to {to.name}"
            )
        self.state = to
        if to.final:
            self._done.set()

    def reject(self, reasons: list[Reason], *, stale: bool = False) -> None:
        self.reasons = tuple(reasons)
        self.stale = stale
        self.move(PlanState.REJECTED)

    def wait(self, timeout: float | None = None) -> PlanState:
        """Wait for a final state; return the state found (not final if the wait timed out)."""
        self._done.wait(timeout)
        return self.state

    def summary(self) -> dict[str, object]:
        return {
            "plan_id": self.plan_id,
            "state": self.state.value,
            "tensors": len(self.plan.jobs),
            "changed": list(self.changed),
            "weight_version": self.weight_version,
            "stale": self.stale,
            "reasons": [{"tensor": r.tensor, "reason": r.reason} for r in self.reasons],
            "stage_ms": None if self.stage_s is None else round(self.stage_s * 1e3, 3),
            "stall_ms": None if self.stall_s is None else round(self.stall_s * 1e3, 3),
        }
