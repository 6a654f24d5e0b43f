"""Errors raised by the wire contract: codec, sockets, servers and clients.

Every message names the field, the endpoint or the peer involved and says what was expected
against what was found, so that the log line alone is enough to act on.
"""

from __future__ import annotations


class IpcError(Exception):
    """Base class of every error the ``ggufswap.ipc`` package raises."""

    #: The ``id`` of the offending message when it could be read (for ``error.in_reply_to``).
    msg_id: str | None = None


class MalformedMessage(IpcError, ValueError):
    """A frame is not a valid protocol message (bad msgpack, wrong shape, bad field)."""


class UnsupportedVersion(IpcError):
    """A message declares a schema version ``v`` this side does not speak."""

    def __init__(self, found: object, supported: tuple[int, ...]):
        self.found = found
        self.supported = supported
        super().__init__(
            f"field 'v': unsupported protocol version {found!r}; this side speaks "
            f"{', '.join(str(v) for v in supported)}"
        )


class MessageTooLarge(IpcError):
    """A frame exceeds the configured size cap."""

    def __init__(self, size: int, limit: int):
        self.size = size
        self.limit = limit
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte message size cap")


class UnknownMessageType(IpcError):
    """A well-formed message whose ``type`` this peer does not serve."""

    def __init__(self, found: object, *, served: tuple[str, ...] = ()):
        self.found = found
        hint = f"; this peer serves {', '.join(served)}" if served else ""
        super().__init__(f"field 'type': unknown message type {found!r}{hint}")


class PeerTimeout(IpcError, TimeoutError):
    """No reply from a peer within the allowed time and retries."""


class PeerRefused(IpcError, PermissionError):
    """This process may not connect to a peer's socket (permission denied on its file)."""


class InsecureEndpoint(IpcError):
    """An endpoint would be reachable without protection (tcp without CURVE, open ipc dir)."""


class EndpointInUse(IpcError):
    """An ``ipc://`` socket file is held by a live process."""


class NotifySocketError(IpcError, ValueError):
    """``NOTIFY_SOCKET`` does not name a socket the sd_notify client can send to."""


class InjectedFault(IpcError, RuntimeError):
    """Raised by a failpoint (``GGUFSWAP_FAILPOINTS``, ``ipc/supervisor.py``): a test breaking a
    supervised thread on purpose."""
