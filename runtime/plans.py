"""Plan lifecycle: ``RECEIVED → STAGING → STAGED → COMMITTED | REJECTED``, with guarded moves.

A ticket is the one record of a plan in the runtime: whoever waits for a plan's outcome waits
on its ticket (:meth:`PlanTicket.wait`), or follows its moves (:meth:`PlanTicket.follow`, how
the control server answers the peers that sent the plan).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ggufswap.ipc import Plan, Reason
from ggufswap.ipc.bodies import Rejected, reasons_to_wire
from ggufswap.logs import get_logger
from ggufswap.runtime.errors import PlanStateError

log = get_logger(__name__)


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


Follower = Callable[["PlanTicket"], None]


@dataclass(eq=False)
class PlanTicket:
    """The runtime's record of one plan; ``wait()`` blocks until it is committed or rejected.

    ``stale`` is True when every reason of a rejection is stale (a source file changed under
    the plan: re-planning fixes it).
    """

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
    # Set once the plan.staged event has been delivered: its plan.committed waits for it.
    staged_published: threading.Event = field(default_factory=threading.Event, repr=False)
    # Moves and follows are serialized, so a follower sees each state once, in order.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _followers: list[Follower] = field(default_factory=list, repr=False)

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id

    def move(self, to: PlanState) -> None:
        with self._lock:
            if to not in _ALLOWED[self.state]:
                raise PlanStateError(
                    f"plan {self.plan_id}: cannot go from {self.state.name} to {to.name}"
                )
            self.state = to
            for follower in self._followers:
                try:
                    follower(self)
                except Exception:  # a follower must not break the runtime
                    log.exception("plan.follower_failed", plan_id=self.plan_id, state=to.name)
            if to.final:
                self._followers.clear()
                self._done.set()

    def follow(self, follower: Follower) -> None:
        """Call ``follower(ticket)`` now, then after each move until a final state, in the
        thread that moves the ticket (its fields already set). Calls are serialized with the
        moves: no state is missed or seen twice, and each call sees ``ticket.state`` as the
        state it is called for."""
        with self._lock:
            if not self.state.final:
                self._followers.append(follower)
            follower(self)

    def reject(self, reasons: list[Reason]) -> None:
        self.reasons = tuple(reasons)
        self.stale = bool(reasons) and all(r.stale for r in reasons)
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
            "reasons": reasons_to_wire(self.reasons),
            "stage_ms": None if self.stage_s is None else round(self.stage_s * 1e3, 3),
            "stall_ms": None if self.stall_s is None else round(self.stall_s * 1e3, 3),
        }


def another_plan(plan_id: str, state: str) -> Rejected:
    """Why a plan sent under the id of another plan the runtime has (in ``state``) is refused:
    a plan id names one plan's content (re-sending that plan is what an id is for)."""
    why = f"plan id {plan_id!r} names another plan (its state: {state}); send this one under "
    return Rejected(plan_id=plan_id, stale=False, reasons=(Reason("*", why + "its own id"),))
