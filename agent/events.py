"""Following a runtime's events: commits the agent did not send are reconciled at once.

Another client (a sweep script, an operator's tool, a second agent) may commit a plan to the
runtime the agent keeps in sync. The agent's actual state is then wrong until it asks again,
which it otherwise does only every ``rescan_interval_s``. So each link subscribes to its
runtime's ``plan.committed`` events (the endpoint is the one the runtime advertises in its
``state_reply``, field ``events``); a commit of a plan the link did not send makes it fetch the
state (a delta) and reconcile, which restores the files' content in the next plan.

It follows ``tensors.lost`` events the same way: the runtime took tensors out of service (their
mapped bytes changed outside any commit) and serves no batch until a commit restores them, so
the link re-syncs at once and plans them (their fingerprint reads ``lost``).

PUB/SUB may drop events (a subscriber still connecting, over its high-water mark): the periodic
refresh stays as the safety net, and a plan of the link's own is recognised by its id.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from ggufswap.config.endpoints import Transport, transport_of
from ggufswap.ipc import IpcError, MalformedMessage, SocketOptions, Subscriber, Topic
from ggufswap.ipc.events import PlanCommittedEvent, TensorsLostEvent, event_from_wire
from ggufswap.logs import get_logger

log = get_logger(__name__)

# Bind addresses of every interface, which a client reaches at the host it dialed.
_WILDCARD_HOSTS: Final = frozenset({"*", "0.0.0.0", "[::]", "::", "[::0]"})  # noqa: S104 (read, not bound)
_MAX_PER_STEP: Final = 256  # events read per link step; the rest wait for the next


def connectable(advertised: str, control: str) -> str:
    """The advertised events endpoint as this client can reach it: a ``tcp://`` wildcard bind
    address takes the host of the control endpoint the client dialed."""
    if transport_of(advertised) is not Transport.TCP or transport_of(control) is not Transport.TCP:
        return advertised
    host, _, port = advertised.removeprefix("tcp://").rpartition(":")
    if host not in _WILDCARD_HOSTS:
        return advertised
    control_host = control.removeprefix("tcp://").rpartition(":")[0]
    return f"tcp://{control_host}:{port}"


class CommitFollower:
    """A SUB socket on one runtime's ``plan.committed`` and ``tensors.lost`` events. Owned by one
    thread (the link's)."""

    def __init__(self, *, control: str, options: SocketOptions) -> None:
        self._control = control
        self._options = options
        self._subscriber: Subscriber | None = None
        self.endpoint: str | None = None
        self.received = 0
        self.foreign_commits = 0
        self._foreign: PlanCommittedEvent | None = None  # the latest, not yet taken
        self.lost_events = 0
        self._lost = False  # a tensors.lost event not yet taken
        self.error: str | None = None

    def follow(self, advertised: str | None) -> None:
        """Subscribe to ``advertised`` (from a ``state_reply``); None or a new one closes the
        old subscription first."""
        endpoint = connectable(advertised, self._control) if advertised else None
        if endpoint == self.endpoint and (endpoint is None or self._subscriber is not None):
            return
        self.close()
        self.endpoint = endpoint
        if endpoint is None:
            return
        try:
            self._subscriber = Subscriber(
                endpoint, topics=(Topic.PLAN_COMMITTED, Topic.TENSORS_LOST), options=self._options
            )
            self.error = None
        except IpcError as exc:  # an endpoint this client may not use: the refresh remains
            self.error = f"cannot follow events at {endpoint}: {exc}"
            log.warning("link.events_refused", endpoint=endpoint, error=str(exc))

    def commits(self) -> list[PlanCommittedEvent | TensorsLostEvent]:
        """The ``plan.committed`` and ``tensors.lost`` events received since the last call."""
        if self._subscriber is None:
            return []
        found: list[PlanCommittedEvent | TensorsLostEvent] = []
        for _topic, payload in self._subscriber.drain(_MAX_PER_STEP):
            try:
                event = event_from_wire(payload)
            except MalformedMessage as exc:
                log.warning("link.bad_event", endpoint=self.endpoint, error=str(exc))
                continue
            if isinstance(event, PlanCommittedEvent | TensorsLostEvent):
                self.received += 1
                found.append(event)
        return found

    def note_commits(self, is_own: Callable[[str], bool]) -> None:
        """Read the events received since the last call; a commit of a plan ``is_own`` does not
        claim (another client's, or one the link abandoned) is counted, and the latest one is
        kept for :meth:`take_foreign`; a ``tensors.lost`` event is logged and kept for
        :meth:`take_lost`."""
        for event in self.commits():
            if isinstance(event, TensorsLostEvent):
                log.warning(
                    "link.tensors_lost",
                    endpoint=self._control,
                    count=len(event.reasons),
                    first=[f"{r.tensor}: {r.reason}" for r in event.reasons[:3]],
                )
                self.lost_events += 1
                self._lost = True
            elif not is_own(event.plan_id):
                self.foreign_commits += 1
                self._foreign = event

    def take_foreign(self) -> PlanCommittedEvent | None:
        """The latest foreign commit noted since the last call that returned one, or None."""
        foreign, self._foreign = self._foreign, None
        return foreign

    def take_lost(self) -> bool:
        """True once after ``tensors.lost`` events were noted: the link re-syncs and plans."""
        lost, self._lost = self._lost, False
        return lost

    def close(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
        self._subscriber = None
        self.endpoint = None

    def status(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "commits_seen": self.received,
            "foreign_commits": self.foreign_commits,
            "lost_events": self.lost_events,
            "error": self.error,
        }
