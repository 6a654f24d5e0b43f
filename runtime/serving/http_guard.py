"""Connection-level limits the HTTP server keeps before a request reaches the application.

uvicorn's protocol (httptools) with three additions, against slow and greedy clients:

- **whole-request deadlines**: the request line and headers must arrive within
  ``header_timeout_s`` of the connection opening (or of the first byte of a later request on a
  kept-alive connection), and the whole body within ``body_timeout_s`` of the headers, however
  the bytes trickle; past either the client gets ``408`` and the connection is closed (a
  per-``recv`` idle timeout would let one byte every few seconds hold a connection for ever);
- **a connection limit**: past ``max_connections`` open connections a new one is answered
  ``503 too_many_connections`` at once and closed;
- **a per-client limit**: past ``max_per_client`` open connections from one address, a new one
  from it is answered ``503 too_many_connections_from_client`` and closed, so one client cannot
  take every slot.

A new connection that sends no byte within ``header_timeout_s`` is closed without an answer, as
is a kept-alive one idle for ``idle_timeout_s`` (uvicorn's keep-alive timeout). Every refusal is
counted in :class:`ConnectionLimits` (the runtime's ``status``, under ``http.connections``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from dataclasses import dataclass
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ggufswap.logs import get_logger

log = get_logger(__name__)

REASONS: Final = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}
# After a refusal the connection is half-closed and what the client still sends is read and
# dropped for this long, so that its request does not meet a closed socket (the kernel would
# reset the connection, and the client could lose the answer before reading it).
LINGER_S: Final = 2.0


@dataclass(frozen=True, kw_only=True)
class Limits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_per_client: int


class ConnectionLimits:
    """Open connections per client address, and what the limits refused (thread-safe reads)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open: collections.Counter[str] = collections.Counter()
        self.total_open = 0
        self.refused: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def admit(self, client: str) -> str | None:
        """Count a new connection from ``client``; the refusal code if it is over a limit."""
        with self._lock:
            if self.total_open >= self.limits.max_connections:
                code = "too_many_connections"
            elif self.open[client] >= self.limits.max_per_client:
                code = "too_many_connections_from_client"
            else:
                self.open[client] += 1
                self.total_open += 1
                return None
            self.refused[code] += 1
            return code

    def release(self, client: str) -> None:
        with self._lock:
            self.open[client] -= 1
            self.total_open -= 1
            if self.open[client] <= 0:
                del self.open[client]

    def timed_out(self, phase: str) -> None:
        with self._lock:
            self.refused[f"{phase}_timeout"] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "open": self.total_open,
                "clients": len(self.open),
                "refused": dict(self.refused),
            }


def error_response(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-shaped error body that closes the connection."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class with ``limits`` applied to every connection."""

    class Guarded(_GuardedProtocol):
        connection_limits = limits

    return Guarded


class _GuardedProtocol(HttpToolsProtocol):
    connection_limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._client_key: str | None = None
        self._in_request = False  # a request's first byte has arrived, its response not ended
        self._refused = False  # answered by the guard: what arrives now is dropped

    # -- connections -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client[0] if self.client else "?"
        limits = self.connection_limits.limits
        code = self.connection_limits.admit(client)
        if code is not None:
            limit = limits.max_connections
            who = "connections are open"
            if code == "too_many_connections_from_client":
                limit, who = limits.max_per_client, f"connections from {client} are open"
            self._refuse(503, f"{limit} {who}; retry later", code)
            return
        self._client_key = client
        self._arm(limits.header_timeout_s, "header")

    def send_400_response(self, msg: str) -> None:
        """A request the parser refuses (a ``Content-Length: ²``): an OpenAI-shaped 400."""
        self._refuse(400, f"{msg} (malformed request line or header)", "invalid_request")

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def eof_received(self) -> None:
        if self._refused:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._client_key is not None:
            self.connection_limits.release(self._client_key)
            self._client_key = None
        super().connection_lost(exc)

    # -- the request's phases ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_request = True
        if self._deadline is None:  # a later request on a kept-alive connection
            self._arm(self.connection_limits.limits.header_timeout_s, "header")

    def on_headers_complete(self) -> None:
        self._disarm()
        self._arm(self.connection_limits.limits.body_timeout_s, "body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._disarm()
        self._in_request = False
        super().on_response_complete()

    # -- deadlines ---------------------------------------------------------------------------

    def _arm(self, seconds: float, phase: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if not self._in_request:  # not a byte of a request: an idle connection, closed quietly
            self.transport.close()
            return
        self.connection_limits.timed_out(phase)
        log.info("http.request_deadline", client=self._client_key, phase=phase, seconds=seconds)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and phase == "body":
            cycle.disconnected = True  # the application's receive() ends; its reply is dropped
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        what = "request line and headers" if phase == "header" else "request body"
        self._refuse(408, f"the {what} did not arrive within {seconds:g} s", "timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` and close, lingering (reading and dropping) for :data:`LINGER_S`."""
        self._refused = True
        self._disarm()
        self.transport.write(error_response(status, message, code))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._deadline = self.loop.call_later(LINGER_S, self.transport.close)
