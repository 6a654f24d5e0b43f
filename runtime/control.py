"""The runtime's control server: the ZeroMQ face of :class:`HotSwapRuntime`.

A thin layer. The request server validates each message once and hands the handler what that
read (a ``plan`` arrives as a :class:`~ggufswap.ipc.Plan`). A plan goes to
:meth:`HotSwapRuntime.submit`, which has the plan's ticket followed by an :class:`_Answer` for
the peer that sent it: the answer's first reply (``accepted``, or the outcome of a plan already
decided) is the handler's return, and each later move of the ticket (``staged``, then
``committed`` or ``rejected``) is queued with ``send_to``. Either way every frame leaves from
the request server's thread, the only one that touches its socket. The runtime's events are
published on the PUB socket. ``state`` reports the loaded table (whole, or only the slots a
commit stamped after the version the client holds: :meth:`ControlServer.state`), ``status`` the
runtime's health. The wire format is in docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog

from ggufswap.config import Config
from ggufswap.ipc import (
    Committed,
    Event,
    Fields,
    IpcError,
    MessageType,
    Plan,
    Process,
    Publisher,
    Reason,
    Rejected,
    Request,
    RequestServer,
    RuntimeState,
    SocketOptions,
    TensorEntry,
    committed_to_wire,
    make_reply,
    new_id,
    rejected_to_wire,
    state_to_wire,
)
from ggufswap.ipc.errors import UnknownMessageType
from ggufswap.ipc.messages import StateRequest
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.plans import PlanState, PlanTicket
from ggufswap.runtime.store import Slot

log = structlog.get_logger(__name__)

Reply = Mapping[str, Any]

# Plans one client (one ZeroMQ peer) may have queued or staging at once. The agent has one plan
# in flight at a time; a client that floods plans gets ``rejected`` (stale: retry later) past
# this, so its plans never queue ahead of more than this many of anyone else's.
MAX_PLANS_IN_FLIGHT_PER_PEER = 4


class ControlServer:
    """Serves ``plan``, ``state`` and ``status`` for one runtime; publishes its events."""

    def __init__(
        self,
        runtime: HotSwapRuntime,
        *,
        control_endpoint: str,
        status_endpoint: str | None = None,
        events_endpoint: str | None = None,
        options: SocketOptions | None = None,
        extra_status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        options = options if options is not None else SocketOptions()
        self.runtime = runtime
        # Names this server's weight history on the wire: a client's ``since`` from another
        # instance (a restarted runtime counts its versions from 0 again) gets the full state.
        self.instance = new_id()
        self._extra_status = extra_status
        self.control = RequestServer(
            control_endpoint, self._handle, name="runtime", options=options
        )
        self.status_server = (
            RequestServer(
                status_endpoint,
                self._handle_status,
                name="runtime-status",
                # `ggufswap status` by members of the socket directory's group (docs/operations.md)
                options=dataclasses.replace(options, group_access=True),
            )
            if status_endpoint and status_endpoint != control_endpoint
            else None
        )
        self.publisher = Publisher(events_endpoint, options) if events_endpoint else None
        self._peer_lock = threading.Lock()
        self._peer_plans: dict[bytes, set[str]] = {}  # plans in flight, per client
        runtime.on_event(self._publish)

    @classmethod
    def from_config(
        cls,
        runtime: HotSwapRuntime,
        config: Config,
        *,
        extra_status: Callable[[], dict[str, Any]] | None = None,
    ) -> ControlServer:
        """The control server of a config's ``runtime`` section, with its security settings."""
        rc = config.require_runtime()
        return cls(
            runtime,
            control_endpoint=rc.control_endpoint,
            status_endpoint=rc.status_endpoint,
            events_endpoint=rc.events_endpoint,
            options=SocketOptions.of(config.security),
            extra_status=extra_status,
        )

    def start(self) -> ControlServer:
        self.control.start()
        if self.status_server is not None:
            self.status_server.start()
        return self

    def close(self) -> None:
        self.control.stop()
        if self.status_server is not None:
            self.status_server.stop()
        if self.publisher is not None:
            self.publisher.close()

    # -- requests (the request server's thread) --------------------------------------------

    def _handle(self, request: Request) -> Reply | None:
        if request.type is MessageType.PLAN:
            return self._plan(request)
        if request.type is MessageType.STATE:
            asked = request.body
            assert isinstance(asked, StateRequest), "the request server parses a state message"
            state = self.state(since=asked.since, instance=asked.instance)
            return make_reply(request.msg, MessageType.STATE_REPLY, **state_to_wire(state))
        if request.type is MessageType.STATUS:
            return self._status_reply(request.msg)
        raise UnknownMessageType(f"the runtime does not serve {request.type.value!r} requests")

    def _handle_status(self, request: Request) -> Reply | None:
        if request.type is MessageType.STATUS:
            return self._status_reply(request.msg)
        raise UnknownMessageType("this endpoint serves only status; send plans to the control one")

    def _status_reply(self, msg: Mapping[str, Any]) -> Reply:
        return make_reply(
            msg, MessageType.STATUS_REPLY, process=Process.RUNTIME.value, status=self.status()
        )

    def _plan(self, request: Request) -> Reply:
        plan = request.body
        assert isinstance(plan, Plan), "the request server parses a plan message into a Plan"
        if not self._admit(request.peer, plan.plan_id):
            busy = Rejected(
                plan_id=plan.plan_id,
                stale=True,
                reasons=(
                    Reason(
                        "*",
                        f"this client already has {MAX_PLANS_IN_FLIGHT_PER_PEER} plans in "
                        "flight; resend after one of them is committed or rejected",
                        stale=True,
                    ),
                ),
            )
            log.warning("control.peer_busy", plan_id=plan.plan_id, peer=request.peer.hex())
            return make_reply(request.msg, MessageType.REJECTED, **rejected_to_wire(busy))
        answer = _Answer(
            self.control,
            request.peer,
            str(request.msg[Fields.ID]),
            on_final=lambda: self._release(request.peer, plan.plan_id),
        )
        self.runtime.submit(plan, follow=answer)
        assert answer.first is not None, "submit follows the ticket, which answers at once"
        return answer.first

    def _admit(self, peer: bytes, plan_id: str) -> bool:
        """Count ``plan_id`` against ``peer``'s plans in flight; False when it has too many (a
        plan the runtime already knows and has not rejected is a re-send: always admitted)."""
        known = self.runtime.ticket(plan_id)
        if known is not None and known.state is not PlanState.REJECTED:
            return True
        with self._peer_lock:
            plans = self._peer_plans.setdefault(peer, set())
            if len(plans) >= MAX_PLANS_IN_FLIGHT_PER_PEER:
                return False
            plans.add(plan_id)
            return True

    def _release(self, peer: bytes, plan_id: str) -> None:
        with self._peer_lock:
            plans = self._peer_plans.get(peer)
            if plans is not None:
                plans.discard(plan_id)
                if not plans:
                    del self._peer_plans[peer]

    # -- events ----------------------------------------------------------------------------

    def _publish(self, event: Event) -> None:
        if self.publisher is not None:
            self.publisher.publish(event)

    # -- reports ---------------------------------------------------------------------------

    def state(self, *, since: int | None = None, instance: str | None = None) -> RuntimeState:
        """The loaded table; with ``since`` (a weight version of this ``instance``, not past
        the current one) a delta: only the slots stamped after it (``Slot.changed_at``).

        The version is read before the slots: a commit that runs meanwhile stamps what it
        changes with a later version, so the next delta from this reply's version has it.
        """
        version = self.runtime.weight_version
        slots: Iterable[Slot] = self.runtime.slots().values()
        if since is not None and instance == self.instance and since <= version:
            slots = [slot for slot in slots if slot.changed_at > since]
        else:
            since = None  # not a version of this instance's history: the full state
        entries = tuple(
            TensorEntry(record=slot.record, fingerprint=slot.fingerprint, slot=slot.state)
            for slot in slots
        )
        return RuntimeState(
            model=self.runtime.model_name,
            weight_version=version,
            tensors=entries,
            instance=self.instance,
            since=since,
            events=self.publisher.endpoint if self.publisher is not None else None,
        )

    def status(self) -> dict[str, Any]:
        status = self.runtime.status()
        if self._extra_status is not None:
            status.update(self._extra_status())
        return status


class _Answer:
    """Answers one ``plan`` request by following the plan's ticket.

    The first call (when ``submit`` starts following) builds the reply the handler returns:
    ``accepted`` while the plan is in flight (a re-sent plan that is already staged too), or
    the outcome of a plan already decided. Each later call is a move of the ticket: ``staged``,
    ``committed`` or ``rejected``, queued for the request server's thread with ``send_to``
    (which sends it after the handler's reply).
    """

    def __init__(
        self,
        server: RequestServer,
        peer: bytes,
        request_id: str,
        *,
        on_final: Callable[[], None] | None = None,
    ) -> None:
        self._server = server
        self._peer = peer
        self._request_id = request_id
        self._on_final = on_final
        self.first: Reply | None = None

    def __call__(self, ticket: PlanTicket) -> None:
        if ticket.state.final and self._on_final is not None:
            self._on_final()
        if self.first is None:
            self.first = self._reply(ticket, MessageType.ACCEPTED)
            return
        if ticket.state is PlanState.STAGING:
            return  # ``accepted`` said so already
        try:
            self._server.send_to(self._peer, self._reply(ticket, MessageType.STAGED))
        except IpcError as exc:  # the server stopped: the peer re-plans from ``state``
            log.info("control.reply_dropped", plan_id=ticket.plan_id, error=str(exc))

    def _reply(self, ticket: PlanTicket, in_flight: MessageType) -> Reply:
        """The reply for the ticket's state; ``in_flight`` for a plan not yet decided."""
        request = {Fields.ID: self._request_id}
        if ticket.state is PlanState.COMMITTED:
            body = Committed(
                plan_id=ticket.plan_id,
                weight_version=ticket.weight_version or 0,
                stall_ms=round((ticket.stall_s or 0.0) * 1e3, 3),
            )
            return make_reply(request, MessageType.COMMITTED, **committed_to_wire(body))
        if ticket.state is PlanState.REJECTED:
            outcome = Rejected(plan_id=ticket.plan_id, stale=ticket.stale, reasons=ticket.reasons)
            return make_reply(request, MessageType.REJECTED, **rejected_to_wire(outcome))
        return make_reply(request, in_flight, **{Fields.PLAN_ID: ticket.plan_id})
