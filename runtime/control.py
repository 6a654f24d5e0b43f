"""The runtime's control server: the ZeroMQ face of :class:`HotSwapRuntime`.

A thin layer: ``plan`` messages go to :meth:`HotSwapRuntime.submit`; the runtime's plan events
become the replies ``staged``, ``committed`` and ``rejected`` sent to every peer that sent the
plan, and are published on the PUB socket. ``state`` reports the loaded table, ``status`` the
runtime's health. The wire format is in docs/protocol.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from ggufswap.config import Config
from ggufswap.ipc import (
    CurveKeys,
    Fields,
    MessageType,
    Process,
    Publisher,
    RequestServer,
    RuntimeState,
    SlotState,
    TensorEntry,
    Topic,
    make_reply,
    plan_from_wire,
    state_to_wire,
)
from ggufswap.ipc.errors import UnknownMessageType
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.plans import PlanState, PlanTicket

log = structlog.get_logger(__name__)

_PUBLISHED = {t.value: t for t in Topic}


class ControlServer:
    """Serves ``plan``, ``state`` and ``status`` for one runtime; publishes its events."""

    def __init__(
        self,
        runtime: HotSwapRuntime,
        *,
        control_endpoint: str,
        status_endpoint: str | None = None,
        events_endpoint: str | None = None,
        curve: CurveKeys | None = None,
        allow_insecure_tcp: bool = False,
        extra_status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.runtime = runtime
        self._extra_status = extra_status
        self._waiting: dict[str, list[tuple[bytes, str]]] = {}  # plan_id -> (peer, request id)
        self._lock = threading.Lock()
        self.control = RequestServer(
            control_endpoint,
            self._handle,
            name="runtime",
            curve=curve,
            allow_insecure_tcp=allow_insecure_tcp,
        )
        self.status_server = (
            RequestServer(
                status_endpoint,
                self._handle_status,
                name="runtime-status",
                curve=curve,
                allow_insecure_tcp=allow_insecure_tcp,
            )
            if status_endpoint and status_endpoint != control_endpoint
            else None
        )
        self.publisher = (
            Publisher(events_endpoint, curve=curve, allow_insecure_tcp=allow_insecure_tcp)
            if events_endpoint
            else None
        )
        runtime.on_event(self._on_event)

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
            curve=CurveKeys.of(config.security.curve),
            allow_insecure_tcp=config.security.allow_insecure_tcp,
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

    # -- requests --------------------------------------------------------------------------

    def _handle(self, peer: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        kind = MessageType(msg[Fields.TYPE])
        if kind is MessageType.PLAN:
            return self._plan(peer, msg)
        if kind is MessageType.STATE:
            return make_reply(msg, MessageType.STATE_REPLY, **state_to_wire(self.state()))
        if kind is MessageType.STATUS:
            return self._status_reply(msg)
        raise UnknownMessageType(f"the runtime does not serve {kind.value!r} requests")

    def _handle_status(self, peer: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        if MessageType(msg[Fields.TYPE]) is MessageType.STATUS:
            return self._status_reply(msg)
        raise UnknownMessageType("this endpoint serves only status; send plans to the control one")

    def _status_reply(self, msg: dict[str, Any]) -> dict[str, Any]:
        return make_reply(
            msg, MessageType.STATUS_REPLY, process=Process.RUNTIME.value, status=self.status()
        )

    def _plan(self, peer: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        plan = plan_from_wire(msg)
        known = self.runtime.ticket(plan.plan_id)
        if known is not None and known.state.final and known.state is not PlanState.REJECTED:
            return self._final_reply(known, msg[Fields.ID])  # already applied: say so again
        with self._lock:
            self._waiting.setdefault(plan.plan_id, []).append((peer, msg[Fields.ID]))
        ticket = self.runtime.submit(plan)
        if ticket.state is PlanState.REJECTED:
            return None  # the plan.rejected event has answered every waiting peer
        return make_reply(msg, MessageType.ACCEPTED, plan_id=plan.plan_id)

    def _final_reply(self, ticket: PlanTicket, request_id: str) -> dict[str, Any]:
        request = {Fields.ID: request_id}
        if ticket.state is PlanState.COMMITTED:
            return make_reply(
                request,
                MessageType.COMMITTED,
                plan_id=ticket.plan_id,
                weight_version=ticket.weight_version or 0,
                stall_ms=round((ticket.stall_s or 0.0) * 1e3, 3),
            )
        return make_reply(
            request,
            MessageType.REJECTED,
            plan_id=ticket.plan_id,
            stale=ticket.stale,
            reasons=[{Fields.TENSOR: r.tensor, Fields.REASON: r.reason} for r in ticket.reasons],
        )

    # -- events ----------------------------------------------------------------------------

    def _on_event(self, topic: str, payload: dict[str, Any]) -> None:
        plan_id = payload.get("plan_id")
        if isinstance(plan_id, str) and topic in ("plan.staged", "plan.committed", "plan.rejected"):
            self._answer_waiting(topic, plan_id)
        published = _PUBLISHED.get(topic)
        if published is not None and self.publisher is not None:
            self.publisher.publish(published, **payload)

    def _answer_waiting(self, topic: str, plan_id: str) -> None:
        final = topic != "plan.staged"
        with self._lock:
            peers = (
                self._waiting.pop(plan_id, []) if final else list(self._waiting.get(plan_id, []))
            )
        ticket = self.runtime.ticket(plan_id)
        if ticket is None:
            return
        for peer, request_id in peers:
            if final:
                reply = self._final_reply(ticket, request_id)
            else:
                reply = make_reply({Fields.ID: request_id}, MessageType.STAGED, plan_id=plan_id)
            self.control.send_to(peer, reply)

    # -- reports ---------------------------------------------------------------------------

    def state(self) -> RuntimeState:
        entries = tuple(
            TensorEntry(
                record=slot.record, fingerprint=slot.fingerprint, slot=SlotState(slot.state.value)
            )
            for slot in self.runtime.slots().values()
        )
        return RuntimeState(
            model=self.runtime.model_name,
            weight_version=self.runtime.weight_version,
            tensors=entries,
        )

    def status(self) -> dict[str, Any]:
        status = self.runtime.status()
        if self._extra_status is not None:
            status.update(self._extra_status())
        return status
