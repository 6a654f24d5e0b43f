"""Message vocabulary of the protocol: types, codes, field names, envelopes and typed bodies.

Every message is a msgpack map with the envelope ``v`` (schema version), ``type`` and ``id``
plus typed fields (see ``docs/protocol.md``). This module knows nothing about sockets; it turns
records into plain maps and back, refusing anything that does not match the schema with a
``MalformedMessage`` that names the offending field. Unknown fields are ignored (forward
compatibility); unknown types raise ``UnknownMessageType``.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, Final

from ggufswap.ipc import _check as c
from ggufswap.ipc.errors import MalformedMessage, UnknownMessageType, UnsupportedVersion
from ggufswap.ipc.plan import Job, Plan
from ggufswap.shards.ggml_types import ggml_type as _ggml_type
from ggufswap.shards.records import FileIdentity, TensorRecord

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS: tuple[int, ...] = (PROTOCOL_VERSION,)
MAX_ID_LENGTH = 128
GGML_MAX_DIMS = 4
# Bounds on what a plan may carry, checked while it is read (before any file-system call): a
# plan id as long as a message id, tensor and model names far over GGML_MAX_NAME, and more jobs
# than any model has tensors. Paths are bounded by ``_check.MAX_PATH_BYTES`` and
# ``MAX_PATH_COMPONENTS``.
MAX_PLAN_ID_LENGTH = MAX_ID_LENGTH
MAX_NAME_LENGTH = 256
MAX_FINGERPRINT_LENGTH = 128
MAX_PLAN_JOBS = 65536
# The fingerprint a runtime reports for a tensor out of service (its bytes changed outside any
# commit: runtime/integrity.py): not a digest, so equal to no content; an agent plans it.
LOST_FINGERPRINT = "lost"


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


# --------------------------------------------------------------------------- records


def record_to_wire(record: TensorRecord) -> dict[str, Any]:
    """A ``TensorRecord`` as a plain map (``name`` included)."""
    return {Fields.Tensor.NAME: record.name, **_record_fields(record)}


def _record_fields(record: TensorRecord) -> dict[str, Any]:
    """The wire fields of a record but its name (a state entry is keyed by the name)."""
    t = Fields.Tensor
    return {
        t.PATH: record.path,
        t.OFFSET: record.offset,
        t.NBYTES: record.nbytes,
        t.TYPE: int(record.ggml_type),
        t.NE: list(record.ne),
        t.IDENTITY: list(record.identity.as_tuple()),
    }


def _identity_from_wire(value: object, where: str) -> FileIdentity:
    items = c.as_list(value, where)
    if len(items) != 5:
        raise MalformedMessage(
            f"field {where!r}: expected [dev, ino, size, mtime_ns, ctime_ns], "
            f"found {len(items)} items"
        )
    dev, ino, size = (
        c.as_int(v, c.field_path(where, i), minimum=0) for i, v in enumerate(items[:3])
    )
    mtime_ns, ctime_ns = (c.as_int(v, c.field_path(where, 3 + i)) for i, v in enumerate(items[3:]))
    return FileIdentity(dev, ino, size, mtime_ns, ctime_ns)


_SLOTS: Final = {slot.value: slot for slot in SlotState}


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _record_fast(m: Any, name: object) -> TensorRecord | None:
    """The record of a well-formed map, read without building any error text; else None.

    None sends the caller to the strict reader, which names what is wrong. This accepts only
    what the strict reader accepts (exactly ``int``, ``str`` and ``list``, as msgpack decodes
    them), at a few microseconds a record: a state of thousands of tensors reads in milliseconds.
    """
    if type(m) is not dict or type(name) is not str or not 0 < len(name) <= MAX_NAME_LENGTH:
        return None
    t = Fields.Tensor
    path: Any = m.get(t.PATH)
    offset: Any = m.get(t.OFFSET)
    nbytes: Any = m.get(t.NBYTES)
    code: Any = m.get(t.TYPE)
    ne: Any = m.get(t.NE)
    ident: Any = m.get(t.IDENTITY)
    path_ok = type(path) is str and bool(path) and "\x00" not in path and c.path_within_bounds(path)
    ne_ok = type(ne) is list and 0 < len(ne) <= GGML_MAX_DIMS and all(map(_is_count, ne))
    ident_ok = type(ident) is list and len(ident) == 5 and all(type(v) is int for v in ident)
    ggml_type = _ggml_type(code) if type(code) is int else None
    if not (path_ok and ne_ok and ident_ok and _is_count(offset) and _is_count(nbytes)):
        return None
    if ggml_type is None or min(ident[:3]) < 0:
        return None
    return TensorRecord(name, ggml_type, tuple(ne), offset, nbytes, path, FileIdentity(*ident))


def record_from_wire(d: object, *, where: str = "record", name: str | None = None) -> TensorRecord:
    """The inverse of ``record_to_wire``; ``name`` overrides a missing ``name`` key (state maps)."""
    key = d.get(Fields.Tensor.NAME) if name is None and isinstance(d, dict) else name
    fast = _record_fast(d, key)
    return fast if fast is not None else _record_strict(d, where=where, name=name)


def _record_strict(d: object, *, where: str, name: str | None) -> TensorRecord:
    t = Fields.Tensor
    m = c.require_map(d, where)
    if name is None:
        name = c.get(m, t.NAME, where)
    name = c.as_bounded_str(name, c.field_path(where, t.NAME), limit=MAX_NAME_LENGTH, nonempty=True)
    code = c.as_int(c.get(m, t.TYPE, where), c.field_path(where, t.TYPE), minimum=0)
    ggml_type = _ggml_type(code)
    if ggml_type is None:
        raise MalformedMessage(
            f"field {c.field_path(where, t.TYPE)!r}: unknown ggml type code {code} "
            f"(tensor {name!r})"
        )
    ne_where = c.field_path(where, t.NE)
    ne_items = c.as_list(c.get(m, t.NE, where), ne_where)
    if not 1 <= len(ne_items) <= GGML_MAX_DIMS:
        raise MalformedMessage(
            f"field {ne_where!r}: expected 1 to {GGML_MAX_DIMS} dimensions, found {len(ne_items)}"
        )
    ne = tuple(c.as_int(v, c.field_path(ne_where, i), minimum=0) for i, v in enumerate(ne_items))
    return TensorRecord(
        name=name,
        ggml_type=ggml_type,
        ne=ne,
        offset=c.as_int(c.get(m, t.OFFSET, where), c.field_path(where, t.OFFSET), minimum=0),
        nbytes=c.as_int(c.get(m, t.NBYTES, where), c.field_path(where, t.NBYTES), minimum=0),
        path=c.as_path(c.get(m, t.PATH, where), c.field_path(where, t.PATH)),
        identity=_identity_from_wire(c.get(m, t.IDENTITY, where), c.field_path(where, t.IDENTITY)),
    )


def _fingerprint_from_wire(m: Mapping[str, Any], where: str) -> str | None:
    key = Fields.Tensor.FINGERPRINT
    value = c.get(m, key, where)
    if value is None:
        return None
    return c.as_bounded_str(value, c.field_path(where, key), limit=MAX_FINGERPRINT_LENGTH)


def job_to_wire(job: Job) -> dict[str, Any]:
    """A plan job: the record's fields plus ``fingerprint`` (nil when unknown)."""
    return {**record_to_wire(job.source), Fields.Tensor.FINGERPRINT: job.fingerprint}


def job_from_wire(d: object, *, where: str = "job") -> Job:
    record = record_from_wire(d, where=where)
    return Job(source=record, fingerprint=_fingerprint_from_wire(c.require_map(d, where), where))


def plan_to_wire(plan: Plan) -> dict[str, Any]:
    """The body of a ``plan`` message (no envelope): ``make_message(PLAN, **plan_to_wire(p))``."""
    return {
        Fields.PLAN_ID: plan.plan_id,
        Fields.MODEL: plan.model,
        Fields.JOBS: [job_to_wire(job) for job in plan.jobs],
    }


def plan_from_wire(d: object) -> Plan:
    """A ``Plan`` from a ``plan`` message or body; job names must be unique."""
    m = c.require_map(d, "plan")
    plan_id = c.as_bounded_str(
        c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, limit=MAX_PLAN_ID_LENGTH, nonempty=True
    )
    model = c.as_bounded_str(c.get(m, Fields.MODEL, ""), Fields.MODEL, limit=MAX_NAME_LENGTH)
    jobs_raw = c.as_list(c.get(m, Fields.JOBS, ""), Fields.JOBS)
    if len(jobs_raw) > MAX_PLAN_JOBS:
        raise MalformedMessage(
            f"field 'jobs': at most {MAX_PLAN_JOBS} jobs per plan, found {len(jobs_raw)}"
        )
    jobs = tuple(
        job_from_wire(j, where=c.field_path(Fields.JOBS, i)) for i, j in enumerate(jobs_raw)
    )
    counts = Counter(job.name for job in jobs)
    duplicates = sorted(name for name, n in counts.items() if n > 1)
    if duplicates:
        raise MalformedMessage(f"field 'jobs': duplicate tensor names {duplicates}")
    return Plan(plan_id=plan_id, model=model, jobs=jobs)


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One loaded tensor as the runtime reports it: where it came from and where it lives."""

    record: TensorRecord
    fingerprint: str | None
    slot: SlotState


@dataclass(frozen=True, slots=True)
class RuntimeState:
    """The body of ``state_reply``: what the runtime has loaded, at which weight version.

    ``instance`` names the runtime's weight history: versions of two instances are unrelated
    (None from a runtime that answers no deltas). A delta (``since`` set) holds only the tensors
    whose slots changed after weight version ``since``, to apply over the full state read then.
    """

    model: str
    weight_version: int
    tensors: tuple[TensorEntry, ...]
    instance: str | None = None
    since: int | None = None
    events: str | None = None  # the runtime's PUB endpoint; None when it publishes none

    def by_name(self) -> dict[str, TensorEntry]:
        return {entry.record.name: entry for entry in self.tensors}


@dataclass(frozen=True, slots=True)
class StateRequest:
    """The body of ``state``: the full state, or with ``since`` (a weight version the client
    holds, read from runtime ``instance``) only what changed after it."""

    since: int | None = None
    instance: str | None = None


def state_request_to_wire(body: StateRequest) -> dict[str, Any]:
    if body.since is None:
        return {}
    return {Fields.SINCE: body.since, Fields.INSTANCE: body.instance}


def state_request_from_wire(d: object) -> StateRequest:
    m = c.require_map(d, "state")
    since = m.get(Fields.SINCE)
    if since is None:
        return StateRequest()
    if Fields.INSTANCE not in m:
        raise MalformedMessage(
            f"field {Fields.INSTANCE!r}: missing; a request with {Fields.SINCE!r} names the "
            f"runtime instance its weight version came from (state_reply.{Fields.INSTANCE})"
        )
    return StateRequest(
        since=c.as_int(since, Fields.SINCE, minimum=0),
        instance=c.as_str(m[Fields.INSTANCE], Fields.INSTANCE, nonempty=True),
    )


def state_to_wire(state: RuntimeState) -> dict[str, Any]:
    """The body of ``state_reply``; tensor entries are keyed by name and carry no ``name``."""
    t = Fields.Tensor
    tensors: dict[str, Any] = {}
    for entry in state.tensors:
        tensors[entry.record.name] = {
            **_record_fields(entry.record),
            t.FINGERPRINT: entry.fingerprint,
            t.SLOT: entry.slot.value,
        }
    body: dict[str, Any] = {
        Fields.MODEL: state.model,
        Fields.WEIGHT_VERSION: state.weight_version,
        Fields.INSTANCE: state.instance,
        Fields.SINCE: state.since,
        Fields.TENSORS: tensors,
    }
    if state.events is not None:
        body[Fields.EVENTS] = state.events
    return body


def _entry_fast(raw: object, name: object) -> TensorEntry | None:
    """Like :func:`_record_fast`, for a ``state_reply`` entry."""
    record = _record_fast(raw, name)
    if record is None:
        return None
    assert isinstance(raw, dict), "_record_fast reads only maps"
    t = Fields.Tensor
    fingerprint, slot = raw.get(t.FINGERPRINT, 0), raw.get(t.SLOT)  # 0: neither nil nor str
    state = _SLOTS.get(slot) if type(slot) is str else None
    if state is None or not (fingerprint is None or type(fingerprint) is str):
        return None
    return TensorEntry(record, fingerprint, state)


def _entry_strict(d: object, name: object) -> TensorEntry:
    where = f"{Fields.TENSORS}[{name!r}]"
    raw = c.require_map(d, where)
    record = record_from_wire(raw, where=where, name=c.as_str(name, where, nonempty=True))
    slot_where = c.field_path(where, Fields.Tensor.SLOT)
    slot = c.as_choice(c.get(raw, Fields.Tensor.SLOT, where), slot_where, tuple(_SLOTS))
    return TensorEntry(record, _fingerprint_from_wire(raw, where), _SLOTS[slot])


def state_from_wire(d: object) -> RuntimeState:
    """A ``state_reply`` body: the full state, or a delta when ``since`` is an integer."""
    m = c.require_map(d, "state_reply")
    tensors_raw = c.require_map(c.get(m, Fields.TENSORS, ""), Fields.TENSORS)
    entries = tuple(
        _entry_fast(raw, name) or _entry_strict(raw, name) for name, raw in tensors_raw.items()
    )
    since, instance = m.get(Fields.SINCE), m.get(Fields.INSTANCE)
    events = m.get(Fields.EVENTS)
    if since is not None and instance is None:
        raise MalformedMessage(
            f"field {Fields.INSTANCE!r}: a delta ({Fields.SINCE!r} = {since!r}) names the runtime "
            "instance it belongs to, found nil or missing"
        )
    return RuntimeState(
        model=c.as_str(c.get(m, Fields.MODEL, ""), Fields.MODEL),
        weight_version=c.as_int(
            c.get(m, Fields.WEIGHT_VERSION, ""), Fields.WEIGHT_VERSION, minimum=0
        ),
        tensors=entries,
        instance=None if instance is None else c.as_str(instance, Fields.INSTANCE, nonempty=True),
        since=None if since is None else c.as_int(since, Fields.SINCE, minimum=0),
        events=None if events is None else c.as_str(events, Fields.EVENTS, nonempty=True),
    )


@dataclass(frozen=True, slots=True)
class Reason:
    """Why one tensor cannot be applied (by the runtime) or planned (by the agent).

    ``tensor`` is the tensor's name, or ``*`` for the plan as a whole. ``stale``: the tensor's
    source file changed under the plan, so re-planning will fix it. The wire carries it once per
    plan (``rejected.stale``: every reason is stale), so a reason read from the wire is stale
    exactly when its plan was.
    """

    tensor: str
    reason: str
    stale: bool = False

    def __str__(self) -> str:
        return f"{self.tensor}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Committed:
    """The body of ``committed``: the plan is live from ``weight_version`` on."""

    plan_id: str
    weight_version: int
    stall_ms: float


@dataclass(frozen=True, slots=True)
class Rejected:
    """The body of ``rejected``; ``stale`` means a source file changed: re-plan and resend."""

    plan_id: str
    stale: bool
    reasons: tuple[Reason, ...]


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """The body of ``error``."""

    in_reply_to: str | None
    code: ErrorCode
    message: str


def committed_to_wire(body: Committed) -> dict[str, Any]:
    return {
        Fields.PLAN_ID: body.plan_id,
        Fields.WEIGHT_VERSION: body.weight_version,
        Fields.STALL_MS: body.stall_ms,
    }


def committed_from_wire(d: object) -> Committed:
    m = c.require_map(d, "committed")
    return Committed(
        plan_id=c.as_str(c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, nonempty=True),
        weight_version=c.as_int(
            c.get(m, Fields.WEIGHT_VERSION, ""), Fields.WEIGHT_VERSION, minimum=0
        ),
        stall_ms=c.as_number(c.get(m, Fields.STALL_MS, ""), Fields.STALL_MS, minimum=0.0),
    )


def reasons_to_wire(reasons: Iterable[Reason]) -> list[dict[str, Any]]:
    """``reasons`` as ``[{tensor, reason}]`` (the per-plan ``stale`` flag travels beside them)."""
    return [{Fields.TENSOR: r.tensor, Fields.REASON: r.reason} for r in reasons]


def reasons_from_wire(d: Mapping[str, Any], *, stale: bool) -> tuple[Reason, ...]:
    """The ``reasons`` of a map, each ``stale`` as its plan is."""
    reasons = []
    for i, raw in enumerate(c.as_list(c.get(d, Fields.REASONS, ""), Fields.REASONS)):
        where = c.field_path(Fields.REASONS, i)
        r = c.require_map(raw, where)
        reasons.append(
            Reason(
                tensor=c.as_str(c.get(r, Fields.TENSOR, where), c.field_path(where, Fields.TENSOR)),
                reason=c.as_str(c.get(r, Fields.REASON, where), c.field_path(where, Fields.REASON)),
                stale=stale,
            )
        )
    return tuple(reasons)


def rejected_to_wire(body: Rejected) -> dict[str, Any]:
    return {
        Fields.PLAN_ID: body.plan_id,
        Fields.STALE: body.stale,
        Fields.REASONS: reasons_to_wire(body.reasons),
    }


def rejected_from_wire(d: object) -> Rejected:
    m = c.require_map(d, "rejected")
    stale = c.as_bool(c.get(m, Fields.STALE, ""), Fields.STALE)
    return Rejected(
        plan_id=c.as_str(c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, nonempty=True),
        stale=stale,
        reasons=reasons_from_wire(m, stale=stale),
    )


def error_from_wire(d: object) -> ErrorReply:
    m = c.require_map(d, "error")
    code = c.as_int(c.get(m, Fields.CODE, ""), Fields.CODE)
    try:
        error_code = ErrorCode(code)
    except ValueError:
        error_code = ErrorCode.INTERNAL  # a newer peer's code: still an error, still readable
    return ErrorReply(
        in_reply_to=c.as_opt_str(c.get(m, Fields.IN_REPLY_TO, ""), Fields.IN_REPLY_TO),
        code=error_code,
        message=c.as_str(c.get(m, Fields.MESSAGE, ""), Fields.MESSAGE),
    )
