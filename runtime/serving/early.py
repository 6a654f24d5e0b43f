"""The HTTP port, open and answering before the server's libraries are imported.

``ggufswap runtime`` in http mode binds its port right after reading its configuration and,
until the HTTP server (uvicorn, Starlette: about a second of imports on a small host, then torch
and the model load) takes the listening socket over, answers every request here: ``/health``
with 503 and the start's snapshot (:class:`~ggufswap.runtime.serving.startup.Startup`, the body
the server gives while loading), anything else with 503 ``loading`` in the API's error shape.
One request per connection; the connection is closed after the answer. Imports only the
standard library and the serving errors.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from http import HTTPStatus
from typing import Final

from ggufswap.logs import get_logger
from ggufswap.runtime.serving.errors import ListenError, unavailable
from ggufswap.runtime.serving.startup import Startup

log = get_logger(__name__)

POLL_S: Final = 0.05  # how soon the responder sees a handover
READ_TIMEOUT_S: Final = 1.0  # a client that sends no request line in this time is closed
MAX_HEAD: Final = 16 * 1024  # the request's head read at most (its body is not read)


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket, bound now so that the port is known (and open) before the load."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(False)
    return sock


class EarlyHealth:
    """Answers 503 ``loading`` on ``sock`` from a thread of its own until :meth:`handover`."""

    def __init__(self, sock: socket.socket, startup: Startup) -> None:
        self.sock = sock
        self.startup = startup
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ggufswap-http-early", daemon=True)

    def start(self) -> EarlyHealth:
        self._thread.start()
        return self

    def handover(self) -> socket.socket:
        """Stop answering (a request being answered is finished) and give the socket back."""
        self._stop.set()
        self._thread.join()
        return self.sock

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], POLL_S)
            if not ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:  # the client went away between select and accept
                continue
            with conn:
                try:
                    self._answer(conn)
                except OSError as exc:  # the client's problem, never the start's
                    log.debug("http.early_answer_failed", error=str(exc))

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT_S)
        head = b""
        while b"\r\n" not in head and len(head) < MAX_HEAD:
            chunk = conn.recv(4096)
            if not chunk:
                return
            head += chunk
        parts = head.split(b"\r\n", 1)[0].split()
        path = parts[1].decode("latin-1") if len(parts) >= 2 else ""
        snapshot = self.startup.snapshot()
        if path.split("?", 1)[0] == "/health":
            body = snapshot
        else:
            message = f"the model is {snapshot['status']} (phase {snapshot['phase']}); retry later"
            body = unavailable(message, "loading").body()
        payload = json.dumps(body).encode()
        status = HTTPStatus.SERVICE_UNAVAILABLE
        response = (
            f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
        )
        conn.sendall(response.encode() + payload)
        self.answered += 1
