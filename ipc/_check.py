"""Strict field readers for decoded maps: each failure names the field path, expected and found."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggufswap.ipc.errors import MalformedMessage


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def field_path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def require_map(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise MalformedMessage(f"field {where!r}: expected a map, found {_describe(value)}")
    return value


def get(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise MalformedMessage(f"field {field_path(where, key)!r}: missing")
    return d[key]


def as_int(value: object, where: str, *, minimum: int | None = None) -> int:
    # bool is an int subclass in Python but a distinct msgpack type: refuse it.
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedMessage(f"field {where!r}: expected an integer, found {_describe(value)}")
    if minimum is not None and value < minimum:
        raise MalformedMessage(f"field {where!r}: expected an integer >= {minimum}, found {value}")
    return value


def as_number(value: object, where: str, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedMessage(f"field {where!r}: expected a number, found {_describe(value)}")
    if minimum is not None and not value >= minimum:  # also refuses NaN
        raise MalformedMessage(f"field {where!r}: expected a number >= {minimum}, found {value}")
    return float(value)


def as_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise MalformedMessage(f"field {where!r}: expected a boolean, found {_describe(value)}")
    return value


def as_str(value: object, where: str, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise MalformedMessage(f"field {where!r}: expected a string, found {_describe(value)}")
    if nonempty and not value:
        raise MalformedMessage(f"field {where!r}: expected a non-empty string, found ''")
    return value


# Bounds on a path read from the wire, checked before the path reaches any file-system call:
# Linux's PATH_MAX, and a component count far above any real tree (resolving a path costs time
# quadratic in its components).
MAX_PATH_BYTES = 4096
MAX_PATH_COMPONENTS = 256


def path_within_bounds(text: str) -> bool:
    """Whether ``text`` is at most MAX_PATH_BYTES long (UTF-8) with at most MAX_PATH_COMPONENTS
    components; cheap enough for the fast record reader."""
    if len(text) > MAX_PATH_BYTES or text.count("/") > MAX_PATH_COMPONENTS:
        return False
    return text.isascii() or len(text.encode("utf-8", "surrogatepass")) <= MAX_PATH_BYTES


def as_path(value: object, where: str) -> str:
    """A file path: a non-empty string without NUL (no file system accepts one), within
    MAX_PATH_BYTES and MAX_PATH_COMPONENTS."""
    text = as_str(value, where, nonempty=True)
    if "\x00" in text:
        raise MalformedMessage(f"field {where!r}: a path cannot contain a NUL character")
    if not path_within_bounds(text):
        raise MalformedMessage(
            f"field {where!r}: a path of at most {MAX_PATH_BYTES} bytes and "
            f"{MAX_PATH_COMPONENTS} components, found {len(text.encode('utf-8', 'surrogatepass'))}"
            f" bytes and {text.count('/')} separators"
        )
    return text


def as_bounded_str(value: object, where: str, *, limit: int, nonempty: bool = False) -> str:
    """A string of at most ``limit`` characters."""
    text = as_str(value, where, nonempty=nonempty)
    if len(text) > limit:
        raise MalformedMessage(f"field {where!r}: at most {limit} characters, found {len(text)}")
    return text


def as_opt_str(value: object, where: str) -> str | None:
    return None if value is None else as_str(value, where)


def as_list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise MalformedMessage(f"field {where!r}: expected an array, found {_describe(value)}")
    return list(value)


def as_choice(value: object, where: str, choices: tuple[str, ...]) -> str:
    text = as_str(value, where)
    if text not in choices:
        raise MalformedMessage(f"field {where!r}: expected one of {list(choices)}, found {text!r}")
    return text
