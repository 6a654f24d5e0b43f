"""The life of a runtime link: its states, the transitions it may make, and its timers.

Explicit states with guarded transitions (a move the table does not allow is a bug, raised
with both states)::

    SYNCING ──state_reply──► IDLE ──plan──► PLAN_SENT ──accepted──► ACCEPTED ──staged──► STAGED
       ▲  │                   ▲                 │                       │                  │
       │  └─no reply after────┼─────────────────┘ (Lazy Pirate retries) │                  │
       │    1+retries: UNREACHABLE (retry later)                         │                  │
       └──────────── committed / rejected / peer lost / reconnect ◄──────┴──────────────────┘

Any state goes UNREACHABLE when the endpoint is refused at a (re)connect (its socket directory
writable by others), and a link thread restarted after a crash starts again at SYNCING.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ggufswap.agent.errors import LinkStateError


class LinkState(str, enum.Enum):
    """Where a link is in its life (the diagram above)."""

    SYNCING = "syncing"  # a `state` request is outstanding
    IDLE = "idle"  # actual state known, nothing in flight
    PLAN_SENT = "plan_sent"  # waiting for accepted (or an early outcome)
    ACCEPTED = "accepted"  # waiting for staged / committed / rejected
    STAGED = "staged"
    UNREACHABLE = "unreachable"  # no reply after every retry; trying again later
    STOPPED = "stopped"


# Every state may go UNREACHABLE: the endpoint may be refused at any reconnect (an insecure
# socket directory, ``RuntimeLink._endpoint_refused``), not only when a request runs out of
# retries.
ALLOWED: dict[LinkState, frozenset[LinkState]] = {
    LinkState.SYNCING: frozenset({LinkState.IDLE, LinkState.SYNCING, LinkState.UNREACHABLE}),
    LinkState.IDLE: frozenset({LinkState.PLAN_SENT, LinkState.SYNCING, LinkState.UNREACHABLE}),
    LinkState.PLAN_SENT: frozenset(
        {LinkState.ACCEPTED, LinkState.STAGED, LinkState.SYNCING, LinkState.UNREACHABLE}
    ),
    LinkState.ACCEPTED: frozenset({LinkState.STAGED, LinkState.SYNCING, LinkState.UNREACHABLE}),
    LinkState.STAGED: frozenset({LinkState.SYNCING, LinkState.UNREACHABLE}),
    LinkState.UNREACHABLE: frozenset({LinkState.SYNCING, LinkState.UNREACHABLE}),
    LinkState.STOPPED: frozenset(),
}


@dataclass
class Timers:
    """When the link acts next: its request's deadline and attempt, its retry, its next plan."""

    deadline: float = 0.0  # of the outstanding request
    attempt: int = 0
    retry_at: float = 0.0  # when UNREACHABLE
    not_before: float = 0.0  # no plan before this (after a stale rejection)
    stale_streak: int = 0
    state_at: float = 0.0  # when the actual state was last fetched


def check_move(model: str, found: LinkState, to: LinkState) -> None:
    """Raise ``LinkStateError`` unless the table allows ``found`` -> ``to`` (STOPPED always)."""
    if to not in ALLOWED[found] and to is not LinkState.STOPPED:
        raise LinkStateError(f"link {model}: {found.value} -> {to.value} is not allowed")
