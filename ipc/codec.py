"""Frame codec: one msgpack map per frame, size-capped, no extension types, never pickle.

``decode`` is the only place untrusted bytes are parsed, in three steps, each bounded:

1. **Object budget.** A frame over ``SCAN_ABOVE_BYTES`` is walked once without building anything
   (``_count_objects``): more than ``MAX_DECODED_OBJECTS`` objects (a container counts
   ``CONTAINER_COST``, a scalar 1) is refused before one is built. msgpack's own limits bound
   each container's length, not their number: 64 MiB of ``0x80`` bytes is 64 million empty maps
   (3.2 GiB decoded, issue 28). Smaller frames cannot build more than ~70x their size.
2. **Envelope first.** The top-level map's ``v``, ``type`` and ``id`` are read (every other value
   skipped, not built), the version and the id checked, and the type against what the socket
   serves (``types``): a status socket refuses a ``plan`` before reading its jobs.
3. **Body.** The whole map is decoded with every length bounded by the protocol's own bounds
   (``MAX_CONTAINER_LEN``, and the frame's length), ext types refused (msgpack's timestamp
   too), string map keys required everywhere.

Any failure is a ``MalformedMessage``, ``UnsupportedVersion``, ``UnknownMessageType`` or
``MessageTooLarge``: nothing else escapes, whatever the bytes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

import msgpack

from ggufswap.ipc.errors import MalformedMessage, MessageTooLarge, UnknownMessageType
from ggufswap.ipc.messages import Fields, MessageType, check_envelope
from ggufswap.ipc.plan import MAX_PLAN_JOBS

DEFAULT_MAX_MSG_SIZE = 64 * 1024 * 1024
# What a status socket reads: ``status`` and ``ping`` requests are a few dozen bytes (the replies
# are not bounded by this; they are the server's own).
STATUS_MAX_REQUEST_SIZE: Final = 64 * 1024
# The object budget. A plan of MAX_PLAN_JOBS jobs is ~50 units a job; a state reply of a model
# with 10,000 tensors ~500,000 units. At the budget, empty maps cost ~40 MB, short strings
# ~250 MB (every scalar its own object): the most one frame can make the process allocate.
MAX_DECODED_OBJECTS: Final = 1 << 22
CONTAINER_COST: Final = 8  # an empty map is 64 bytes, a short string ~50
SCAN_ABOVE_BYTES: Final = 256 * 1024  # below: at most ~18 MB decoded, not worth a walk
# No array or map of the protocol is longer than the jobs of a plan (the tensors of a state
# reply, keyed by name, are fewer than a plan's bound).
MAX_CONTAINER_LEN: Final = 4 * MAX_PLAN_JOBS
# A file name need not be UTF-8 (Linux names are bytes). Python reads such a name as a str with
# surrogate escapes; strings are packed and unpacked with the same handler, so the name crosses
# the wire byte for byte (its msgpack str then holds those bytes, not valid UTF-8), instead of
# failing to encode.
UNICODE_ERRORS = "surrogateescape"


def _refuse_ext(code: int, data: bytes) -> object:
    raise MalformedMessage(f"msgpack ext type {code} ({len(data)} bytes) is not allowed")


_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})


def _check_plain(obj: object) -> None:
    """Walk the decoded value: only nil, bool, int, float, str, bin, array and str-keyed map
    (msgpack's own Timestamp, for one, is refused). Each container's members are checked by
    their set of types (``map(type, ...)`` runs in C), so a long array of scalars costs no
    Python work per element."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            if set(map(type, item)) - {str}:
                key = next(k for k in item if type(k) is not str)
                raise MalformedMessage(f"map keys must be strings, found {key!r}")
            members: Iterable[object] = item.values()
        elif type(item) is list:
            members = item
        else:
            continue
        kinds = set(map(type, members)) - _SCALARS
        if not kinds:
            continue
        if kinds - {list, dict}:
            found = next(t for t in kinds if t is not list and t is not dict)
            raise MalformedMessage(f"value of type {found.__name__} is not allowed")
        stack.extend(m for m in members if type(m) is list or type(m) is dict)


def encode(msg: Mapping[str, Any]) -> bytes:
    """Pack a message map; refuses a missing envelope and any non-plain value."""
    check_envelope(dict(msg))
    try:
        return msgpack.packb(
            dict(msg), use_bin_type=True, datetime=False, unicode_errors=UNICODE_ERRORS
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedMessage(f"cannot encode message {msg.get('type')!r}: {exc}") from exc


def decode(
    frame: bytes,
    *,
    max_size: int = DEFAULT_MAX_MSG_SIZE,
    types: Collection[MessageType] | None = None,
) -> dict[str, Any]:
    """Parse one frame into an envelope-checked message map; ``types``: the message types
    the caller serves (another is ``UnknownMessageType``, before its body is read)."""
    size = len(frame)
    if size > max_size:
        raise MessageTooLarge(size, max_size)
    if size == 0:
        raise MalformedMessage("empty frame: expected a msgpack map")
    try:
        if size > SCAN_ABOVE_BYTES:
            _count_objects(frame, MAX_DECODED_OBJECTS)
        _check_envelope_first(frame, types)
        obj = msgpack.unpackb(frame, **_limits(size))
    except (MalformedMessage, UnknownMessageType):
        raise
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as exc:
        # ExtraData, FormatError, StackError, OutOfData and UnicodeDecodeError are ValueErrors;
        # an unhashable map key (a map used as a key) is a TypeError.
        raise MalformedMessage(f"not a msgpack message: {type(exc).__name__}: {exc}") from exc
    msg = check_envelope(obj)
    try:
        _check_plain(msg)
    except MalformedMessage as exc:
        exc.msg_id = msg[Fields.ID]
        raise
    return msg


def _limits(size: int) -> dict[str, Any]:
    """msgpack's unpacker options: every length bounded by the frame and the protocol."""
    return {
        "raw": False,
        "unicode_errors": UNICODE_ERRORS,
        "strict_map_key": True,
        "use_list": True,
        "ext_hook": _refuse_ext,
        "max_str_len": size,
        "max_bin_len": size,
        "max_array_len": min(size, MAX_CONTAINER_LEN),
        "max_map_len": min(size // 2, MAX_CONTAINER_LEN),
        "max_ext_len": 0,
    }


_ENVELOPE: Final = frozenset({Fields.V, Fields.TYPE, Fields.ID})


def _check_envelope_first(frame: bytes, types: Collection[MessageType] | None) -> None:
    """Read only the top-level ``v``, ``type`` and ``id`` (skipping every other value) and
    check them, and the type against ``types``, before the body is decoded."""
    unpacker = msgpack.Unpacker(**_limits(len(frame)))
    unpacker.feed(frame)
    try:
        pairs = unpacker.read_map_header()
    except ValueError:
        return  # not a map: the full decode says what it is
    envelope: dict[str, Any] = {}
    for _ in range(pairs):
        key = unpacker.unpack()
        if isinstance(key, str) and key in _ENVELOPE and key not in envelope:
            envelope[key] = unpacker.unpack()
        else:
            unpacker.skip()
    check_envelope(envelope)  # names a missing field
    if types is not None:
        found = envelope[Fields.TYPE]
        if found not in {t.value for t in types}:
            error = UnknownMessageType(found, served=tuple(sorted(t.value for t in types)))
            error.msg_id = envelope[Fields.ID]
            raise error


# First byte -> (payload bytes after it, or -n: an n-byte big-endian length follows; values
# it contains: 0, or -n: an n-byte count follows, doubled for maps). For 0xc0-0xdf.
_SIZED: Final[dict[int, tuple[int, int]]] = {
    0xC0: (0, 0), 0xC2: (0, 0), 0xC3: (0, 0),  # nil, false, true
    0xC4: (-1, 0), 0xC5: (-2, 0), 0xC6: (-4, 0),  # bin 8/16/32
    0xC7: (-1, 0), 0xC8: (-2, 0), 0xC9: (-4, 0),  # ext (refused later; skipped here)
    0xCA: (4, 0), 0xCB: (8, 0),  # float 32/64
    0xCC: (1, 0), 0xCD: (2, 0), 0xCE: (4, 0), 0xCF: (8, 0),  # uint
    0xD0: (1, 0), 0xD1: (2, 0), 0xD2: (4, 0), 0xD3: (8, 0),  # int
    0xD4: (2, 0), 0xD5: (3, 0), 0xD6: (5, 0), 0xD7: (9, 0), 0xD8: (17, 0),  # fixext
    0xD9: (-1, 0), 0xDA: (-2, 0), 0xDB: (-4, 0),  # str 8/16/32
    0xDC: (0, -2), 0xDD: (0, -4),  # array 16/32
    0xDE: (0, -2), 0xDF: (0, -4),  # map 16/32
}  # fmt: skip


def _count_objects(frame: bytes, budget: int) -> int:
    """Walk the msgpack value in ``frame`` without building it; the cost of what decoding it
    would build (a container ``CONTAINER_COST``, a scalar 1), or ``MalformedMessage`` once it
    passes ``budget`` (or the frame ends inside a value). One pass, a few operations a byte of
    structure: a hostile 64 MiB frame is refused within about a second."""
    size, pos, cost, pending = len(frame), 0, 0, 1
    while pending:
        if pos >= size:
            raise MalformedMessage("frame ends inside a msgpack value")
        b = frame[pos]
        pending -= 1
        if b <= 0x7F or b >= 0xE0:  # fixint
            cost += 1
            pos += 1
        elif b <= 0x9F:  # fixmap, fixarray
            pending += (b & 0x0F) * (2 if b <= 0x8F else 1)
            cost += CONTAINER_COST
            pos += 1
        elif b <= 0xBF:  # fixstr
            cost += 1
            pos += 1 + (b & 0x1F)
        else:
            if b not in _SIZED:  # 0xc1, never used
                raise MalformedMessage(f"byte {pos}: 0x{b:02x} is not a msgpack type")
            payload, count = _SIZED[b]
            if payload < 0:
                pos += 1 - payload + int.from_bytes(frame[pos + 1 : pos + 1 - payload], "big")
                cost += 1
            elif count < 0:
                n = int.from_bytes(frame[pos + 1 : pos + 1 - count], "big")
                pending += n * (2 if b >= 0xDE else 1)
                cost += CONTAINER_COST
                pos += 1 - count
            else:
                cost += 1
                pos += 1 + payload
        if cost > budget:
            raise MalformedMessage(
                f"frame of {size} bytes decodes to more than {budget} objects (the decode "
                "budget; a protocol message is far smaller): refused before decoding"
            )
    if pos > size:
        raise MalformedMessage("frame ends inside a msgpack value")
    return cost
