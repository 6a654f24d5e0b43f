"""Per-type schemas, and the one parse of each incoming message, on either side of a socket.

A message is read once, through its type's row of ``SCHEMA``: the top-level fields its reader
does not read itself (a plan reply's ``in_reply_to``), then the body, read into the type's
frozen record by its ``*_from_wire`` reader (a ``plan`` becomes a
:class:`~ggufswap.ipc.plan.Plan`, a ``state_reply`` a :class:`~ggufswap.ipc.bodies.RuntimeState`,
an ``accepted`` an :class:`~ggufswap.ipc.bodies.Accepted`). A server checks each request with
:func:`parse_message` and hands its handler the record; a client reads each reply with
:func:`parse_reply` and dispatches by matching on the record's type. Either way a body that
does not match the schema is a ``MalformedMessage`` naming the field, and nothing is parsed
twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ggufswap.ipc import _check as c
from ggufswap.ipc.bodies import (
    Accepted,
    Committed,
    ErrorReply,
    Ping,
    Pong,
    Rejected,
    RuntimeState,
    Staged,
    StateRequest,
    StatusReply,
    StatusRequest,
    accepted_from_wire,
    committed_from_wire,
    error_from_wire,
    pong_from_wire,
    rejected_from_wire,
    staged_from_wire,
    state_from_wire,
    state_request_from_wire,
    status_reply_from_wire,
)
from ggufswap.ipc.errors import UnknownMessageType
from ggufswap.ipc.events import Event, event_from_wire
from ggufswap.ipc.messages import Fields, MessageType, message_type
from ggufswap.ipc.plan import Plan, plan_from_wire

# What a client reads back from a request (``error`` included); the agent's link matches on it.
ReplyBody = (
    Pong | StatusReply | RuntimeState | Accepted | Staged | Committed | Rejected | ErrorReply
)
# The record of any message's body.
Body = Ping | StatusRequest | StateRequest | Plan | Event | ReplyBody

_REPLY_RECORDS: Final = (
    Pong,
    StatusReply,
    RuntimeState,
    Accepted,
    Staged,
    Committed,
    Rejected,
    ErrorReply,
)

_Check = Callable[[object, str], object]


@dataclass(frozen=True, slots=True)
class _Schema:
    """One type's row: top-level fields its reader does not read, and the reader."""

    fields: tuple[tuple[str, _Check], ...]
    read: Callable[[Mapping[str, Any]], Body]


_PLAN_REPLY: Final = ((Fields.IN_REPLY_TO, c.as_opt_str),)

SCHEMA: Final[dict[MessageType, _Schema]] = {
    MessageType.PING: _Schema((), lambda _m: Ping()),
    MessageType.PONG: _Schema((), pong_from_wire),
    MessageType.STATUS: _Schema((), lambda _m: StatusRequest()),
    MessageType.STATUS_REPLY: _Schema((), status_reply_from_wire),
    MessageType.STATE: _Schema((), state_request_from_wire),
    MessageType.STATE_REPLY: _Schema((), state_from_wire),
    MessageType.PLAN: _Schema((), plan_from_wire),
    MessageType.ACCEPTED: _Schema(_PLAN_REPLY, accepted_from_wire),
    MessageType.STAGED: _Schema(_PLAN_REPLY, staged_from_wire),
    MessageType.COMMITTED: _Schema(_PLAN_REPLY, committed_from_wire),
    MessageType.REJECTED: _Schema(_PLAN_REPLY, rejected_from_wire),
    MessageType.ERROR: _Schema((), error_from_wire),
    MessageType.EVENT: _Schema((), event_from_wire),
}

REPLY_TYPES: Final = frozenset(
    {
        MessageType.PONG,
        MessageType.STATUS_REPLY,
        MessageType.STATE_REPLY,
        MessageType.ACCEPTED,
        MessageType.STAGED,
        MessageType.COMMITTED,
        MessageType.REJECTED,
        MessageType.ERROR,
    }
)


def parse_message(msg: Mapping[str, Any]) -> tuple[MessageType, Body]:
    """Check an envelope-checked message against its type's schema, once; return the type and
    the record its body reads as."""
    msg_type = message_type(msg)
    schema = SCHEMA[msg_type]
    for key, check in schema.fields:
        check(c.get(msg, key, ""), key)
    return msg_type, schema.read(msg)


def validate_message(msg: Mapping[str, Any]) -> MessageType:
    """Like :func:`parse_message`, for callers that need only the type."""
    return parse_message(msg)[0]


@dataclass(frozen=True, slots=True)
class Incoming:
    """A reply as a client reads it: the id of the request it answers (None when the peer could
    not read that id, or sent none) and its body's record."""

    in_reply_to: str | None
    body: ReplyBody


def parse_reply(msg: Mapping[str, Any]) -> Incoming:
    """Read an envelope-checked message a client received into an :class:`Incoming`; a request
    type (a peer that sends ``plan`` to a client) is ``UnknownMessageType``, a body that does not
    match its schema ``MalformedMessage`` naming the field."""
    msg_type = message_type(msg)
    if msg_type not in REPLY_TYPES:
        served = tuple(sorted(t.value for t in REPLY_TYPES))
        raise UnknownMessageType(msg_type.value, served=served)
    _, body = parse_message(msg)
    assert isinstance(body, _REPLY_RECORDS), f"{msg_type.value} reads as a reply record"
    in_reply_to = c.as_opt_str(msg.get(Fields.IN_REPLY_TO), Fields.IN_REPLY_TO)
    return Incoming(in_reply_to=in_reply_to, body=body)
