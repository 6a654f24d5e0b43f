"""A ROUTER request server on its own stoppable thread, and a thread-safe event publisher.

The server thread owns its ZeroMQ socket (sockets are not thread-safe). Other threads hand it
messages through ``send_to``: they are encoded in the caller's thread, queued, and the server
thread is woken through a pipe that its poller watches next to the socket. The loop polls with a
timeout, so ``stop()`` is honoured within ``poll_interval_s`` even if the wake-up were lost.

Every frame gets an answer or a logged reason why not: undecodable, oversized, wrongly versioned
or unknown messages and handler exceptions are answered with ``error`` and the loop goes on.
``ping`` is answered by the server itself with ``pong``.

With CURVE, a client refused during the handshake (no CURVE, a key not in the authorized
directory, or the wrong server key) never reaches the handler; a socket monitor turns each
refusal into an ``ipc.handshake_refused`` warning (rate-limited per reason, with a count).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ggufswap.ipc.codec import decode, encode
from ggufswap.ipc.errors import (
    IpcError,
    MalformedMessage,
    MessageTooLarge,
    UnknownMessageType,
    UnsupportedVersion,
)
from ggufswap.ipc.events import Event, event_message
from ggufswap.ipc.messages import ErrorCode, Fields, MessageType, make_error, make_reply
from ggufswap.ipc.schema import parse_message
from ggufswap.ipc.sockets import DEFAULT_OPTIONS, Binding, SocketOptions, bind_endpoint, make_socket
from ggufswap.ipc.supervisor import Supervised
from ggufswap.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Request:
    """A request that passed validation: who sent it, the message, its type and its body as
    the one parse read it (a ``Plan`` for ``plan``; None for types without a typed body)."""

    peer: bytes
    msg: Mapping[str, Any]
    type: MessageType
    body: object
    # The connection's "Peer-Address" as libzmq reports it: on ipc:// "localhost:UID:GID:PID"
    # (SO_PEERCRED of the connecting process), on tcp:// the peer's IP; None if unknown.
    peer_address: str | None = None


Handler = Callable[[Request], Mapping[str, Any] | None]

_MAX_BATCH = 256  # frames handled per wake-up before the outbox and stop flag are looked at
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL  # e.g. a client without CURVE, depending on timing
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_LOG_INTERVAL_S = 1.0
_HANDSHAKE_LOG_BURST = 20  # lines per reason per interval; further refusals are counted, not logged
_PROTOCOL_ERRORS = {
    int(getattr(zmq, name)): name.removeprefix("PROTOCOL_ERROR_")
    for name in dir(zmq)
    if name.startswith("PROTOCOL_ERROR_")
}


def _handshake_reason(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"client key not authorized (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        detail = f"errno {value}"
    else:
        detail = _PROTOCOL_ERRORS.get(value, hex(value))
    return f"handshake failed ({detail}): no CURVE, or the client expects another server key"


class _HandshakeLog:
    """Logs CURVE handshake refusals seen by a socket monitor: per reason, at most
    ``_HANDSHAKE_LOG_BURST`` lines per second; the rest are counted in the next line."""

    def __init__(self, monitor: zmq.Socket[bytes], log: Any) -> None:
        self.monitor = monitor
        self.log = log
        self.refused = 0
        self._windows: dict[str, list[float]] = {}  # reason -> [window start, lines, suppressed]

    def drain(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            self.refused += 1
            reason = _handshake_reason(int(event["event"]), int(event["value"]))
            now = time.monotonic()
            window = self._windows.setdefault(reason, [now, 0, 0])
            if now - window[0] >= _HANDSHAKE_LOG_INTERVAL_S:
                window[0], window[1] = now, 0
            if window[1] >= _HANDSHAKE_LOG_BURST:
                window[2] += 1
                continue
            self.log.warning(
                "ipc.handshake_refused",
                reason=reason,
                endpoint=event["endpoint"].decode(errors="replace"),
                suppressed_before=int(window[2]),
            )
            window[1] += 1
            window[2] = 0


class ServerState(Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


class RequestServer:
    """Serve requests on ``endpoint``: ``handler(request)`` returns the reply or None.

    Each message is validated once, and the handler receives what that read
    (:class:`Request`). A handler may also answer later (or several times) with
    ``send_to(peer_id, reply)`` from any thread: every frame still leaves from the server's
    thread. Handler exceptions are logged and answered with ``error``: ``MalformedMessage`` →
    MALFORMED, ``UnknownMessageType`` → UNKNOWN_TYPE, others → INTERNAL.
    """

    def __init__(
        self,
        endpoint: str,
        handler: Handler,
        *,
        name: str,
        options: SocketOptions = DEFAULT_OPTIONS,
        poll_interval_s: float = 0.1,
        types: Collection[MessageType] | None = None,
        max_request_size: int | None = None,
    ):
        """``types``: the request types the handler serves (``ping`` is always answered
        here); a request of another type is refused before its body is decoded.
        ``max_request_size``: the cap on requests (default ``options.max_msg_size``, which
        also caps replies): a status socket reads requests of a few dozen bytes."""
        self._requested_endpoint = endpoint
        self._handler = handler
        self.name = name
        self._options = options
        self._max_msg_size = options.max_msg_size
        self._max_request_size = (
            options.max_msg_size if max_request_size is None else max_request_size
        )
        self._types = None if types is None else frozenset({*types, MessageType.PING})
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._state = ServerState.CREATED
        self._stop = threading.Event()
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._binding: Binding | None = None
        self._handshakes: _HandshakeLog | None = None
        self._wake_r = -1
        self._wake_w = -1
        self._thread: Supervised | None = None
        self._started_at = time.monotonic()
        self.log = log.bind(server=name)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def endpoint(self) -> str:
        """The bound endpoint (a tcp wildcard port resolved); the requested one before start."""
        return self._binding.endpoint if self._binding is not None else self._requested_endpoint

    def start(self) -> RequestServer:
        """Bind in the caller's thread (so bind errors raise here), then serve on a thread."""
        if self._state is not ServerState.CREATED:
            raise IpcError(f"server {self.name}: start() in state {self._state.name}")
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # MAXMSGSIZE bounds what the socket reads: the request cap (replies are not bounded by it)
        reading = dataclasses.replace(self._options, max_msg_size=self._max_request_size)
        sock = make_socket(context, zmq.ROUTER, reading)
        try:
            self._binding = bind_endpoint(sock, self._requested_endpoint, self._options)
        except BaseException:
            sock.close(linger=0)
            context.term()
            raise
        self._context, self._socket = context, sock
        if self._options.curve is not None and self._binding.authenticator is not None:
            self._handshakes = _HandshakeLog(sock.get_monitor_socket(_HANDSHAKE_EVENTS), self.log)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._started_at = time.monotonic()
        self._state = ServerState.RUNNING
        self._thread = Supervised(
            f"ggufswap-ipc-{self.name}",
            self._run,
            stop=self._stop,
            on_exit=self._close_socket,
            context={"server": self.name},
        ).start()
        self.log.info("ipc.server_started", endpoint=self.endpoint)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (bounded by ``timeout_s``), close the socket and release the endpoint."""
        if self._state is not ServerState.RUNNING:
            self._state = ServerState.STOPPED
            return
        self._stop.set()
        self._wake()
        assert self._thread is not None, "a running server has a thread"
        if not self._thread.join(timeout_s):
            self.log.error("ipc.server_stop_timeout", timeout_s=timeout_s)
            raise IpcError(f"server {self.name}: thread did not stop within {timeout_s}s")
        if self._binding is not None:
            self._binding.close()
        if self._context is not None:
            self._context.term()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._state = ServerState.STOPPED
        self.log.info("ipc.server_stopped", endpoint=self.endpoint)

    def __enter__(self) -> RequestServer:
        if self._state is ServerState.CREATED:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started_at

    # -- cross-thread sends ------------------------------------------------------------------

    def send_to(self, peer_id: bytes, msg: Mapping[str, Any]) -> None:
        """Queue ``msg`` for ``peer_id`` from any thread; encoding errors raise here."""
        if self._state is not ServerState.RUNNING:
            raise IpcError(f"server {self.name}: send_to() in state {self._state.name}")
        self._outbox.put((peer_id, encode(msg)))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe: a wake-up is already pending
            os.write(self._wake_w, b"\0")

    # -- the server thread -------------------------------------------------------------------

    def _run(self) -> None:
        """The server thread's body (supervised: restarted with backoff if it raises; the
        socket stays bound across restarts and is closed once, by ``_close_socket``)."""
        sock = self._socket
        assert sock is not None, "start() creates the socket before the thread"
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        handshakes = self._handshakes
        if handshakes is not None:
            poller.register(handshakes.monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(self._poll_ms))
            if sock in ready:
                self._drain_socket(sock)
            if self._wake_r in ready:
                self._drain_wakeups()
            if handshakes is not None and handshakes.monitor in ready:
                handshakes.drain()
            self._drain_outbox(sock)

    def _close_socket(self) -> None:
        sock = self._socket
        assert sock is not None, "start() creates the socket before the thread"
        if self._handshakes is not None:
            sock.disable_monitor()
            self._handshakes.monitor.close(linger=0)
        sock.close(linger=self._options.linger_ms)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _drain_outbox(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                peer, data = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(sock, peer, [], data)

    def _drain_socket(self, sock: zmq.Socket[bytes]) -> None:
        for _ in range(_MAX_BATCH):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                found = parts[-1].get("Peer-Address")
            except zmq.ZMQError:  # no such property on this transport
                found = None
            address = found if isinstance(found, str) else None
            self._handle(sock, [part.bytes for part in parts], address)

    def _send(
        self, sock: zmq.Socket[bytes], peer: bytes, envelope: list[bytes], data: bytes
    ) -> None:
        if len(data) > self._max_msg_size:
            self.log.error("ipc.reply_too_large", size=len(data), limit=self._max_msg_size)
            data = encode(
                make_error(
                    None,
                    ErrorCode.TOO_LARGE,
                    f"{self.name}: reply of {len(data)} bytes exceeds the "
                    f"{self._max_msg_size}-byte cap",
                )
            )
        try:
            sock.send_multipart([peer, *envelope, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer is gone (ROUTER_MANDATORY); EAGAIN: its queue is full.
            self.log.warning("ipc.reply_dropped", peer=peer.hex(), error=str(exc))

    def _handle(
        self, sock: zmq.Socket[bytes], frames: list[bytes], address: str | None = None
    ) -> None:
        peer, body = frames[0], frames[1:]
        envelope: list[bytes] = []
        if len(body) == 2 and body[0] == b"":  # a REQ peer: keep its empty delimiter
            envelope, body = [b""], body[1:]
        if len(body) != 1:
            error = make_error(
                None, ErrorCode.MALFORMED, f"expected one payload frame, found {len(body)}"
            )
            self._send(sock, peer, envelope, encode(error))
            return
        reply = self._reply_to(peer, body[0], address)
        if reply is None:
            return
        try:
            data = encode(reply)
        except MalformedMessage as exc:
            self.log.exception("ipc.reply_unencodable", type=reply.get(Fields.TYPE))
            data = encode(make_error(reply.get(Fields.IN_REPLY_TO), ErrorCode.INTERNAL, str(exc)))
        self._send(sock, peer, envelope, data)

    def _reply_to(
        self, peer: bytes, payload: bytes, address: str | None = None
    ) -> Mapping[str, Any] | None:
        try:
            msg = decode(payload, max_size=self._max_request_size, types=self._types)
        except UnknownMessageType as exc:  # a type this socket does not serve: body unread
            self.log.warning("ipc.unknown_type", peer=peer.hex(), error=str(exc))
            return make_error(exc.msg_id, ErrorCode.UNKNOWN_TYPE, str(exc))
        except MessageTooLarge as exc:
            self.log.warning("ipc.message_too_large", peer=peer.hex(), size=exc.size)
            return make_error(exc.msg_id, ErrorCode.TOO_LARGE, str(exc))
        except UnsupportedVersion as exc:
            self.log.warning("ipc.unsupported_version", peer=peer.hex(), found=exc.found)
            return make_error(exc.msg_id, ErrorCode.UNSUPPORTED_VERSION, str(exc))
        except MalformedMessage as exc:
            self.log.warning("ipc.malformed", peer=peer.hex(), error=str(exc))
            return make_error(exc.msg_id, ErrorCode.MALFORMED, str(exc))
        msg_id = msg[Fields.ID]
        try:
            msg_type, body = parse_message(msg)
            if msg_type is MessageType.PING:
                return make_reply(msg, MessageType.PONG, process=self.name, uptime_s=self.uptime_s)
            return self._handler(Request(peer, msg, msg_type, body, address))
        except UnknownMessageType as exc:
            self.log.warning("ipc.unknown_type", peer=peer.hex(), type=msg.get(Fields.TYPE))
            return make_error(msg_id, ErrorCode.UNKNOWN_TYPE, str(exc))
        except MalformedMessage as exc:
            self.log.warning("ipc.malformed", peer=peer.hex(), id=msg_id, error=str(exc))
            return make_error(msg_id, ErrorCode.MALFORMED, str(exc))
        except Exception as exc:
            self.log.exception("ipc.handler_failed", type=msg.get(Fields.TYPE), id=msg_id)
            return make_error(msg_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class Publisher:
    """A PUB socket for events: frames ``[topic, msgpack map]``; ``publish`` is thread-safe."""

    def __init__(self, endpoint: str, options: SocketOptions = DEFAULT_OPTIONS):
        self._lock = threading.Lock()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket: zmq.Socket[bytes] | None = make_socket(self._context, zmq.PUB, options)
        try:
            self._binding = bind_endpoint(self._socket, endpoint, options)
        except BaseException:
            self._socket.close(linger=0)
            self._context.term()
            raise

    @property
    def endpoint(self) -> str:
        return self._binding.endpoint

    def publish(self, event: Event) -> dict[str, Any]:
        """Publish one event (dropped by libzmq for subscribers over their HWM); returns its
        payload."""
        payload = event_message(event)
        data = encode(payload)
        with self._lock:
            if self._socket is None:
                raise IpcError(f"publisher {self.endpoint}: publish() after close()")
            self._socket.send_multipart([event.topic.value.encode(), data])
        return payload

    def close(self) -> None:
        with self._lock:
            if self._socket is None:
                return
            self._socket.close()
            self._socket = None
        self._binding.close()
        self._context.term()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
