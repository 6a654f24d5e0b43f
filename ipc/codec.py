"""Frame codec: one msgpack map per frame, size-capped, no extension types, never pickle.

``decode`` is the only place untrusted bytes are parsed. It bounds every length the unpacker may
allocate by the frame's own length, refuses ext types (including msgpack's timestamp), requires
string map keys everywhere and checks the envelope (``v`` first, then ``type`` and ``id``). Any
failure is a ``MalformedMessage``, ``UnsupportedVersion`` or ``MessageTooLarge``: nothing else
escapes, whatever the bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from ggufswap.ipc.errors import MalformedMessage, MessageTooLarge
from ggufswap.ipc.messages import Fields, check_envelope

DEFAULT_MAX_MSG_SIZE = 64 * 1024 * 1024
# A file name need not be UTF-8 (Linux names are bytes). Python reads such a name as a str with
# surrogate escapes; strings are packed and unpacked with the same handler, so the name crosses
# the wire byte for byte (its msgpack str then holds those bytes, not valid UTF-8), instead of
# failing to encode.
UNICODE_ERRORS = "surrogateescape"


def _refuse_ext(code: int, data: bytes) -> object:
    raise MalformedMessage(f"msgpack ext type {code} ({len(data)} bytes) is not allowed")


def _check_plain(obj: object) -> None:
    """Walk the decoded value: only nil, bool, int, float, str, bin, array and str-keyed map."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if not isinstance(key, str):
                    raise MalformedMessage(f"map keys must be strings, found {key!r}")
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
        elif item is not None and not isinstance(item, bool | int | float | str | bytes):
            raise MalformedMessage(f"value of type {type(item).__name__} is not allowed")


def encode(msg: Mapping[str, Any]) -> bytes:
    """Pack a message map; refuses a missing envelope and any non-plain value."""
    check_envelope(dict(msg))
    try:
        return msgpack.packb(
            dict(msg), use_bin_type=True, datetime=False, unicode_errors=UNICODE_ERRORS
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedMessage(f"cannot encode message {msg.get('type')!r}: {exc}") from exc


def decode(frame: bytes, *, max_size: int = DEFAULT_MAX_MSG_SIZE) -> dict[str, Any]:
    """Parse one frame into an envelope-checked message map."""
    size = len(frame)
    if size > max_size:
        raise MessageTooLarge(size, max_size)
    if size == 0:
        raise MalformedMessage("empty frame: expected a msgpack map")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            unicode_errors=UNICODE_ERRORS,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            max_ext_len=0,
        )
    except MalformedMessage:
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
