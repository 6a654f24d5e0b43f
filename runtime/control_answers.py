"""The replies to a ``plan`` request that follow its ticket (the control server's,
:mod:`ggufswap.runtime.control`): :class:`Answer` for one request, :class:`Fanout` for every
request that asked for a plan while it waited in the server's fair queue."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ggufswap.ipc import (
    Committed,
    Fields,
    IpcError,
    MessageType,
    Reason,
    Rejected,
    RequestServer,
    committed_to_wire,
    make_reply,
    rejected_to_wire,
)
from ggufswap.logs import get_logger
from ggufswap.runtime.plans import PlanState, PlanTicket

__all__ = ["Answer", "Fanout"]

log = get_logger(__name__)

Reply = Mapping[str, Any]


class Answer:
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
        said_accepted: bool = False,
    ) -> None:
        self._server = server
        self._peer = peer
        self._request_id = request_id
        self._on_final = on_final
        # Answered ``accepted`` already (the plan waited here): the first call sends an outcome.
        self._said_accepted = said_accepted
        self.first: Reply | None = None

    def __call__(self, ticket: PlanTicket) -> None:
        if ticket.state.final and self._on_final is not None:
            self._on_final()
        if self.first is None:
            self.first = self._reply(ticket, MessageType.ACCEPTED)
            if self._said_accepted and ticket.state.final:
                self._send(self.first, ticket.plan_id)
            return
        if ticket.state is PlanState.STAGING:
            return  # ``accepted`` said so already
        self._send(self._reply(ticket, MessageType.STAGED), ticket.plan_id)

    def _send(self, reply: Reply, plan_id: str) -> None:
        try:
            self._server.send_to(self._peer, reply)
        except IpcError as exc:  # the server stopped: the peer re-plans from ``state``
            log.info("control.reply_dropped", plan_id=plan_id, error=str(exc))

    def refuse(self, plan_id: str, reason: Reason) -> None:
        """Answer the request with ``rejected`` for ``reason`` (a plan never handed over)."""
        outcome = Rejected(plan_id=plan_id, stale=reason.stale, reasons=(reason,))
        request = {Fields.ID: self._request_id}
        self._send(make_reply(request, MessageType.REJECTED, **rejected_to_wire(outcome)), plan_id)

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


class Fanout:
    """Follows one ticket for every request that asked for its plan while it waited."""

    def __init__(self, answers: list[Answer], *, on_final: Callable[[], None]) -> None:
        self._answers = answers
        self._on_final = on_final

    def __call__(self, ticket: PlanTicket) -> None:
        if ticket.state.final:
            self._on_final()
        for answer in self._answers:
            answer(ticket)
