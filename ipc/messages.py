"""Message vocabulary of the protocol: types, codes, field names, envelopes and typed bodies.

Every message is a msgpack map with the envelope ``v`` (schema version), ``type`` and ``id``
plus typed fields (see ``docs/protocol.md``). This module knows nothing about sockets; it names
the types, codes and fields, and builds and checks envelopes. The typed bodies live beside it:
plans and tensor records in :mod:`ggufswap.ipc.plan`, every other body in
:mod:`ggufswap.ipc.bodies`; :mod:`ggufswap.ipc.schema` reads a message into its body. A body
that does not match the schema is a ``MalformedMessage`` that names the offending field.
Unknown fields are ignored (forward compatibility); unknown types raise ``UnknownMessageType``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from enum import Enum, IntEnum
from typing import Any

from ggufswap.ipc import _check as c
from ggufswap.ipc.errors import MalformedMessage, UnknownMessageType, UnsupportedVersion

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS: tuple[int, ...] = (PROTOCOL_VERSION,)
MAX_ID_LENGTH = 128


class MessageType(str, Enum):
    """Value of the ``type`` envelope field."""

    PING = "ping"
    PONG = "pong"
    STATUS = "status"
    STATUS_REPLY = "status_reply"
    STATE = "state"
    STATE_REPLY = "state_reply"
    PLAN = "plan"
    ACCEPTED = "accepted"
    STAGED = "staged"
    COMMITTED = "committed"
    REJECTED = "rejected"
    ERROR = "error"
    EVENT = "event"


class ErrorCode(IntEnum):
    """``code`` of an ``error`` reply."""

    MALFORMED = 1
    UNKNOWN_TYPE = 2
    UNSUPPORTED_VERSION = 3
    TOO_LARGE = 4
    INTERNAL = 5


class Topic(str, Enum):
    """First frame of an event published on the PUB socket (subscribers filter on its prefix)."""

    PLAN_ACCEPTED = "plan.accepted"
    PLAN_STAGED = "plan.staged"
    PLAN_COMMITTED = "plan.committed"
    PLAN_REJECTED = "plan.rejected"
    TENSOR_FALLBACK = "tensor.fallback"
    TENSOR_REATTACHED = "tensor.reattached"
    SHARD_INVALID = "shard.invalid"
    TENSORS_LOST = "tensors.lost"


class Process(str, Enum):
    """Which ggufswap process answers a ``status``."""

    AGENT = "agent"
    RUNTIME = "runtime"


class SlotState(str, Enum):
    """Where a loaded tensor lives, as reported in ``state_reply``."""

    ON_ORIGINAL = "ON_ORIGINAL"
    DETACHED = "DETACHED"
    FALLBACK_CPU = "FALLBACK_CPU"


class Fields:
    """Every key used on the wire; no bare string literals in logic."""

    # envelope
    V = "v"
    TYPE = "type"
    ID = "id"
    IN_REPLY_TO = "in_reply_to"
    # bodies
    PROCESS = "process"
    UPTIME_S = "uptime_s"
    STATUS = "status"
    MODEL = "model"
    WEIGHT_VERSION = "weight_version"
    TENSORS = "tensors"
    SINCE = "since"  # state, state_reply: the weight version a delta starts from
    INSTANCE = "instance"  # state, state_reply: the runtime's weight history (versions' scope)
    EVENTS = "events"  # state_reply: the runtime's event (PUB) endpoint, for clients to follow
    PLAN_ID = "plan_id"
    JOBS = "jobs"
    STALL_MS = "stall_ms"
    STAGE_MS = "stage_ms"
    CHANGED = "changed"
    STALE = "stale"
    REASONS = "reasons"
    CODE = "code"
    MESSAGE = "message"
    TOPIC = "topic"
    # reasons and events
    TENSOR = "tensor"
    REASON = "reason"
    POOL = "pool"
    PATH = "path"

    class Tensor:
        """Keys of a tensor entry (``state_reply.tensors[name]``) and of a plan job."""

        NAME = "name"
        PATH = "path"
        OFFSET = "offset"
        NBYTES = "nbytes"
        TYPE = "type"  # int ggml type code
        NE = "ne"
        IDENTITY = "identity"  # [dev, ino, size, mtime_ns, ctime_ns]
        FINGERPRINT = "fingerprint"
        SLOT = "slot"


ENVELOPE_KEYS = frozenset({Fields.V, Fields.TYPE, Fields.ID})


# --------------------------------------------------------------------------- envelopes


def new_id() -> str:
    """A fresh message id: a uuid4 in hex."""
    return uuid.uuid4().hex


def make_message(
    msg_type: MessageType, *, msg_id: str | None = None, **fields: Any
) -> dict[str, Any]:
    """A message map: envelope plus ``fields`` (which must not repeat envelope keys)."""
    return message_from(msg_type, fields, msg_id=msg_id)


def message_from(
    msg_type: MessageType, fields: Mapping[str, Any], *, msg_id: str | None = None
) -> dict[str, Any]:
    """Like ``make_message`` with the fields as a map (for keys that are not identifiers)."""
    clash = ENVELOPE_KEYS.intersection(fields)
    if clash:
        raise ValueError(f"fields {sorted(clash)} are envelope keys; pass msg_id= for the id")
    return {
        Fields.V: PROTOCOL_VERSION,
        Fields.TYPE: msg_type.value,
        Fields.ID: msg_id if msg_id is not None else new_id(),
        **fields,
    }


def make_reply(request: Mapping[str, Any], msg_type: MessageType, **fields: Any) -> dict[str, Any]:
    """A reply to ``request``: ``in_reply_to`` carries the request's ``id``."""
    return message_from(msg_type, {Fields.IN_REPLY_TO: request.get(Fields.ID), **fields})


def make_error(in_reply_to: str | None, code: ErrorCode, message: str) -> dict[str, Any]:
    """An ``error`` reply; ``in_reply_to`` is None when the request's id could not be read."""
    body = {Fields.IN_REPLY_TO: in_reply_to, Fields.CODE: int(code), Fields.MESSAGE: message}
    return message_from(MessageType.ERROR, body)


def make_event(topic: Topic, **fields: Any) -> dict[str, Any]:
    """The payload of an event; the topic is repeated inside so a payload stands alone."""
    return message_from(MessageType.EVENT, {Fields.TOPIC: topic.value, **fields})


def check_envelope(obj: object) -> dict[str, Any]:
    """Return ``obj`` as a message map after checking ``v`` (first), ``type`` and ``id``.

    Errors carry the message's ``id`` in ``msg_id`` when it is readable, so that an error
    reply can still name the request it answers.
    """
    if not isinstance(obj, dict):
        raise MalformedMessage(
            f"top level: expected a map with 'v', 'type', 'id', found {type(obj).__name__}"
        )
    raw_id = obj.get(Fields.ID)
    try:
        return _check_envelope_fields(obj)
    except (MalformedMessage, UnsupportedVersion) as exc:
        if isinstance(raw_id, str) and 0 < len(raw_id) <= MAX_ID_LENGTH:
            exc.msg_id = raw_id
        raise


def _check_envelope_fields(obj: dict[Any, Any]) -> dict[str, Any]:
    for key in obj:
        if not isinstance(key, str):
            raise MalformedMessage(f"top level: keys must be strings, found {key!r}")
    version = c.get(obj, Fields.V, "")
    if isinstance(version, bool) or not isinstance(version, int):
        raise MalformedMessage(f"field 'v': expected an integer, found {version!r}")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(version, SUPPORTED_VERSIONS)
    c.as_str(c.get(obj, Fields.TYPE, ""), Fields.TYPE, nonempty=True)
    msg_id = c.as_str(c.get(obj, Fields.ID, ""), Fields.ID, nonempty=True)
    if len(msg_id) > MAX_ID_LENGTH:
        raise MalformedMessage(
            f"field 'id': at most {MAX_ID_LENGTH} characters, found {len(msg_id)}"
        )
    return obj


def message_type(msg: Mapping[str, Any]) -> MessageType:
    """The ``MessageType`` of an envelope-checked message, or ``UnknownMessageType``."""
    raw = msg.get(Fields.TYPE)
    try:
        return MessageType(raw)
    except ValueError:
        raise UnknownMessageType(raw, served=tuple(t.value for t in MessageType)) from None
