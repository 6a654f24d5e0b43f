"""Clients: a one-shot Lazy Pirate ``request``, the agent's long-lived ``DealerClient`` and a
``Subscriber`` for events.

Lazy Pirate (ZeroMQ guide, chapter 4): a request is sent on a fresh DEALER socket and a reply is
awaited for ``timeout_s``. On timeout the socket is closed with LINGER 0 (dropping the queued
request, and any late reply with it) and a new socket sends the same request again, up to
``retries`` more times; then ``PeerTimeout`` names the endpoint. Re-sending is safe because every
request of this protocol is idempotent: ``ping``/``status``/``state`` only read, and a ``plan``
is identified by its content-derived ``plan_id``, which the runtime applies at most once.

Replies are matched on ``in_reply_to == id``; an ``error`` whose ``in_reply_to`` is nil (the
server could not read the id) is also returned, since nothing else can have caused it on a fresh
socket.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from collections.abc import Iterable, Mapping
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ggufswap.ipc.codec import decode, encode
from ggufswap.ipc.errors import IpcError, PeerRefused, PeerTimeout
from ggufswap.ipc.messages import Fields, MessageType, Topic, make_message
from ggufswap.ipc.sockets import (
    DEFAULT_OPTIONS,
    IPC_SCHEME,
    SocketOptions,
    connect_endpoint,
    make_socket,
)
from ggufswap.logs import get_logger

log = get_logger(__name__)


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


def _is_reply_to(reply: Mapping[str, Any], msg_id: str) -> bool:
    in_reply_to = reply.get(Fields.IN_REPLY_TO)
    if in_reply_to == msg_id:
        return True
    return reply.get(Fields.TYPE) == MessageType.ERROR.value and in_reply_to is None


def _await_reply(
    sock: zmq.Socket[bytes], msg_id: str, *, timeout_s: float, max_msg_size: int, endpoint: str
) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not sock.poll(_ms(remaining), zmq.POLLIN):
            return None
        frame = sock.recv()
        try:
            reply = decode(frame, max_size=max_msg_size)
        except IpcError as exc:
            log.warning("ipc.bad_reply", endpoint=endpoint, error=str(exc))
            continue
        if _is_reply_to(reply, msg_id):
            return reply
        log.debug("ipc.unrelated_reply", endpoint=endpoint, in_reply_to=reply.get("in_reply_to"))


def request(
    endpoint: str,
    msg: Mapping[str, Any],
    *,
    timeout_s: float,
    retries: int = 2,
    options: SocketOptions = DEFAULT_OPTIONS,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> dict[str, Any]:
    """Send ``msg`` and return its reply (an ``error`` reply is returned, not raised).

    Tries ``1 + retries`` times, each on a fresh socket waiting ``timeout_s``; raises
    ``PeerTimeout`` when no attempt got a reply, and ``PeerRefused`` at once for an ``ipc://``
    socket this process may not connect to (libzmq would retry that connect silently, and the
    request would time out as if no one were there). Sockets close with LINGER 0 whatever
    ``options`` says: a request that timed out is dropped with its socket.
    """
    check_ipc_access(endpoint)
    data = encode(msg)
    msg_id = str(msg[Fields.ID])
    ctx = context if context is not None else zmq.Context.instance()
    attempts = 1 + max(0, retries)
    options = dataclasses.replace(options, linger_ms=0)
    for attempt in range(1, attempts + 1):
        sock = make_socket(ctx, zmq.DEALER, options)
        try:
            connect_endpoint(sock, endpoint, options)
            sock.send(data, zmq.NOBLOCK)
            reply = _await_reply(
                sock,
                msg_id,
                timeout_s=timeout_s,
                max_msg_size=options.max_msg_size,
                endpoint=endpoint,
            )
        except zmq.Again:
            reply = None
        finally:
            sock.close(linger=0)
        if reply is not None:
            return reply
        log.warning(
            "ipc.request_timeout",
            endpoint=endpoint,
            attempt=attempt,
            attempts=attempts,
            type=msg.get(Fields.TYPE),
        )
    raise PeerTimeout(
        f"{endpoint}: no reply to {msg.get(Fields.TYPE)!r} (id {msg_id}) after {attempts} "
        f"attempt(s) of {timeout_s}s each; is the process running and the endpoint right?"
    )


def check_ipc_access(endpoint: str) -> None:
    """Raise ``PeerRefused`` when ``endpoint`` is an ``ipc://`` socket file that exists and
    this process may not connect to (connecting needs write permission on it, and search
    permission on its directories). A missing file is not refused: it may appear."""
    if not endpoint.startswith(IPC_SCHEME):
        return
    path = endpoint[len(IPC_SCHEME) :]
    if path.startswith("@"):
        return  # an abstract socket has no file and no permissions
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except PermissionError:
        raise PeerRefused(
            f"{endpoint}: permission denied: a directory above {path} may not be searched by "
            f"this user (uid {os.geteuid()}); run as the socket's owner, a member of its "
            "directory's group, or root"
        ) from None
    if not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        raise PeerRefused(
            f"{endpoint}: permission denied: connecting needs write permission on the socket "
            f"(mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, group gid "
            f"{st.st_gid}); this user is uid {os.geteuid()}: run as its owner, a member of "
            "its group, or root"
        )


def _close_monitored(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


class DealerClient:
    """A long-lived DEALER connection to a runtime with heartbeats.

    Not thread-safe: one thread calls ``send`` and ``poll``. Heartbeats run inside ``poll``:
    a ``ping`` goes out every ``heartbeat_interval_s``; any message received counts as a sign
    of life (``pong`` is consumed here, never returned). After ``heartbeat_liveness`` intervals
    without one, ``connected`` turns False and the socket is re-created (queued messages are
    dropped; ``reconnects`` counts this so the caller can re-sync, e.g. ask ``state`` again).
    ``connected`` is False until the first message arrives. Losing a peer that was up is logged
    once (``ipc.peer_lost``, a warning), its return once (``ipc.peer_up``); the reconnects in
    between, while it stays away, are debug lines.

    A dropped connection (the peer process died or restarted) is treated the same way as soon
    as ZeroMQ reports it on the socket's monitor, once the peer had answered on that socket: a
    peer restarted between two heartbeats answers the next ping, so heartbeats alone would
    never tell the caller that the requests it had in flight were lost with the old process.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        options: SocketOptions = DEFAULT_OPTIONS,
        heartbeat_interval_s: float = 1.0,
        heartbeat_liveness: int = 3,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ):
        if heartbeat_interval_s <= 0 or heartbeat_liveness < 1:
            raise ValueError("heartbeat_interval_s must be > 0 and heartbeat_liveness >= 1")
        self.endpoint = endpoint
        self._options = options
        self._interval_s = heartbeat_interval_s
        self._liveness = heartbeat_liveness
        self._max_msg_size = options.max_msg_size
        self._context = context if context is not None else zmq.Context.instance()
        self._connected = False
        self._missed = 0
        self._awaiting_pong = False
        self._next_ping = time.monotonic()
        self.reconnects = 0
        self._socket: zmq.Socket[bytes] | None = self._open()

    def _open(self) -> zmq.Socket[bytes]:
        sock = make_socket(self._context, zmq.DEALER, self._options)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            connect_endpoint(sock, self.endpoint, self._options)
        except BaseException:
            _close_monitored(sock, monitor)
            raise
        self._monitor = monitor
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        return sock

    def _sock(self) -> zmq.Socket[bytes]:
        if self._socket is None:
            raise IpcError(f"client for {self.endpoint}: used after close()")
        return self._socket

    @property
    def connected(self) -> bool:
        """True while the peer answered within the last ``heartbeat_liveness`` intervals."""
        return self._connected

    def send(self, msg: Mapping[str, Any]) -> None:
        """Queue ``msg`` for the peer; raises ``IpcError`` when the send queue is full."""
        try:
            self._sock().send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise IpcError(
                f"{self.endpoint}: send queue full ({self._options.hwm} messages); peer not reading"
            ) from None

    def poll(self, timeout_s: float) -> dict[str, Any] | None:
        """The next message from the peer within ``timeout_s`` (heartbeats handled meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if now >= self._next_ping:
                self._heartbeat(now)
            wait_s = min(deadline, self._next_ping) - now
            sock = self._sock()
            ready = dict(self._poller.poll(_ms(max(0.0, wait_s))))
            # Only a connection that carried a message counts: a failing handshake (wrong CURVE
            # key) drops every attempt, and the heartbeats already pace that case.
            if self._monitor in ready and self._dropped() and self._connected:
                self._reconnect("connection dropped")
                continue
            if sock in ready:
                msg = self._receive(sock)
                if msg is not None:
                    return msg
            elif time.monotonic() >= deadline:
                return None

    def _dropped(self) -> bool:
        """Whether the monitor reported a dropped connection (drains its events)."""
        dropped = False
        while self._monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self._monitor)
            dropped = dropped or event["event"] == zmq.EVENT_DISCONNECTED
        return dropped

    def _receive(self, sock: zmq.Socket[bytes]) -> dict[str, Any] | None:
        frame = sock.recv()
        self._missed = 0
        self._awaiting_pong = False
        if not self._connected:
            log.info("ipc.peer_up", endpoint=self.endpoint)
        self._connected = True
        try:
            msg = decode(frame, max_size=self._max_msg_size)
        except IpcError as exc:
            log.warning("ipc.bad_reply", endpoint=self.endpoint, error=str(exc))
            return None
        if msg.get(Fields.TYPE) == MessageType.PONG.value:
            return None
        return msg

    def _heartbeat(self, now: float) -> None:
        if self._awaiting_pong:
            self._missed += 1
            if self._missed >= self._liveness:
                self._reconnect("no heartbeat reply")
        self._sock().send(encode(make_message(MessageType.PING)), zmq.NOBLOCK)
        self._awaiting_pong = True
        self._next_ping = now + self._interval_s

    def _reconnect(self, why: str) -> None:
        # Once per outage: a peer that was up and is lost is a warning; the reconnects while it
        # stays away (a runtime loading its model answers nothing for minutes) are debug lines.
        (log.warning if self._connected else log.debug)(
            "ipc.peer_lost", endpoint=self.endpoint, why=why, missed=self._missed
        )
        self._connected = False
        self._missed = 0
        self._awaiting_pong = False
        _close_monitored(self._sock(), self._monitor)
        self._socket = self._open()
        self.reconnects += 1

    def close(self) -> None:
        if self._socket is not None:
            _close_monitored(self._socket, self._monitor)
            self._socket = None
        self._connected = False

    def __enter__(self) -> DealerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Subscriber:
    """A SUB socket for events; ``recv`` returns ``(topic, event)`` or None on timeout."""

    def __init__(
        self,
        endpoint: str,
        *,
        topics: Iterable[Topic | str] = ("",),
        options: SocketOptions = DEFAULT_OPTIONS,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ):
        ctx = context if context is not None else zmq.Context.instance()
        options = dataclasses.replace(options, linger_ms=0)
        self._max_msg_size = options.max_msg_size
        self._socket = make_socket(ctx, zmq.SUB, options)
        try:
            for topic in topics:
                value = topic.value if isinstance(topic, Topic) else topic
                self._socket.setsockopt(zmq.SUBSCRIBE, value.encode())
            connect_endpoint(self._socket, endpoint, options)
        except BaseException:
            self._socket.close(linger=0)
            raise
        self.endpoint = endpoint

    def recv(self, timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._socket.poll(_ms(remaining), zmq.POLLIN):
                return None
            frames = self._socket.recv_multipart()
            if len(frames) != 2:
                log.warning("ipc.bad_event", endpoint=self.endpoint, frames=len(frames))
                continue
            try:
                return frames[0].decode(), decode(frames[1], max_size=self._max_msg_size)
            except (UnicodeDecodeError, IpcError) as exc:
                log.warning("ipc.bad_event", endpoint=self.endpoint, error=str(exc))

    def drain(self, limit: int = 256) -> list[tuple[str, dict[str, Any]]]:
        """The events already received (at most ``limit``), without waiting."""
        got: list[tuple[str, dict[str, Any]]] = []
        while len(got) < limit and self._socket.poll(0, zmq.POLLIN):
            event = self.recv(0.001)
            if event is not None:
                got.append(event)
        return got

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
