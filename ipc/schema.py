"""Per-type schemas, and the one parse of each incoming message.

A server checks each message once with :func:`parse_message`: the top-level fields its type
must carry (``SCHEMA``), then the deep structure, read into the type's record by its
``*_from_wire`` reader (a ``plan`` becomes a :class:`~ggufswap.ipc.plan.Plan`, a ``state`` a
:class:`~ggufswap.ipc.messages.StateRequest`). The handler gets that record, so nothing is
parsed twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ggufswap.ipc import _check as c
from ggufswap.ipc.messages import (
    Fields,
    MessageType,
    Process,
    committed_from_wire,
    error_from_wire,
    message_type,
    plan_from_wire,
    rejected_from_wire,
    state_from_wire,
    state_request_from_wire,
)


def _nonneg_number(value: object, where: str) -> object:
    return c.as_number(value, where, minimum=0.0)


def _nonneg_int(value: object, where: str) -> object:
    return c.as_int(value, where, minimum=0)


def _nonempty_str(value: object, where: str) -> object:
    return c.as_str(value, where, nonempty=True)


def _process(value: object, where: str) -> object:
    return c.as_choice(value, where, tuple(p.value for p in Process))


_Check = Callable[[object, str], object]
_PLAN_REPLY: tuple[tuple[str, _Check], ...] = (
    (Fields.PLAN_ID, _nonempty_str),
    (Fields.IN_REPLY_TO, c.as_opt_str),
)

# Top-level fields each type must carry; deep structure is checked by the *_from_wire readers.
SCHEMA: dict[MessageType, tuple[tuple[str, _Check], ...]] = {
    MessageType.PING: (),
    MessageType.PONG: ((Fields.PROCESS, c.as_str), (Fields.UPTIME_S, _nonneg_number)),
    MessageType.STATUS: (),
    MessageType.STATUS_REPLY: ((Fields.PROCESS, _process), (Fields.STATUS, c.require_map)),
    MessageType.STATE: (),
    MessageType.STATE_REPLY: (),
    MessageType.PLAN: (),
    MessageType.ACCEPTED: _PLAN_REPLY,
    MessageType.STAGED: _PLAN_REPLY,
    MessageType.COMMITTED: _PLAN_REPLY,
    MessageType.REJECTED: _PLAN_REPLY,
    MessageType.ERROR: ((Fields.CODE, c.as_int), (Fields.MESSAGE, c.as_str)),
    MessageType.EVENT: ((Fields.TOPIC, _nonempty_str),),
}

_DEEP: dict[MessageType, Callable[[object], object]] = {
    MessageType.STATE: state_request_from_wire,
    MessageType.STATE_REPLY: state_from_wire,
    MessageType.PLAN: plan_from_wire,
    MessageType.COMMITTED: committed_from_wire,
    MessageType.REJECTED: rejected_from_wire,
    MessageType.ERROR: error_from_wire,
}


def parse_message(msg: Mapping[str, Any]) -> tuple[MessageType, object]:
    """Check an envelope-checked message's fields against its type's schema, once; return the
    type and the record its body reads as (a ``Plan`` for ``plan``), or None for types whose
    fields are all top-level."""
    msg_type = message_type(msg)
    for key, check in SCHEMA[msg_type]:
        check(c.get(msg, key, ""), key)
    deep = _DEEP.get(msg_type)
    return msg_type, None if deep is None else deep(msg)


def validate_message(msg: Mapping[str, Any]) -> MessageType:
    """Like :func:`parse_message`, for callers that need only the type."""
    return parse_message(msg)[0]
