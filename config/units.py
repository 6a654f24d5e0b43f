"""Quantities as operators write them: byte sizes (``70GiB``, ``512MiB``, ``1.5GB``, ``1048576``)
and thread counts (``4``, ``auto``)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Decimal units are powers of 1000, binary units ("i") powers of 1024, as in IEC 80000-13.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_COUNT = re.compile(r"[0-9]{1,9}")
_MAX_DIGITS = 30  # far beyond any memory size; keeps Decimal arithmetic cheap on hostile input

UNIT_NAMES = ("B", "KB", "MB", "GB", "TB", "PB", "KiB", "MiB", "GiB", "TiB", "PiB")

AUTO_THREADS = "auto"  # the thread count follows the process's CPU affinity
MAX_THREADS = 1024  # far beyond any host's cores; catches a typo before torch starts the threads


def parse_size(text: str | int) -> int:
    """Number of bytes in ``text``; a fractional byte count is rounded down.

    Accepts a non-negative ``int`` (bytes) or a string: a number, optionally with a decimal part,
    then an optional unit from ``UNIT_NAMES`` (case-insensitive, spaces allowed). Raises
    ``ValueError`` with the accepted forms otherwise.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a size such as 70GiB, found {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, found {text}")
        return text
    match = _SIZE.fullmatch(text)
    if match is None or len(match.group(1)) > _MAX_DIGITS:
        raise ValueError(
            f"expected a size such as 70GiB, 512MiB, 1.5GB or a number of bytes, found {text!r}"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"unknown size unit {unit!r} in {text!r}; expected one of {', '.join(UNIT_NAMES)}"
        )
    try:
        value = Decimal(number) * factor
    except InvalidOperation as exc:  # the pattern admits only digits; kept for safety
        raise ValueError(f"expected a size such as 70GiB, found {text!r}") from exc
    return int(value)


def parse_threads(value: object) -> int | None:
    """A thread count: an integer in ``1..MAX_THREADS`` (also as text), or ``None`` for ``auto``.

    Raises ``ValueError`` saying what was expected and what was found.
    """
    if value == AUTO_THREADS:
        return None
    if isinstance(value, str) and _COUNT.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer >= 1 or '{AUTO_THREADS}', found {value!r}")
    if not 1 <= value <= MAX_THREADS:
        raise ValueError(
            f"expected an integer between 1 and {MAX_THREADS} or '{AUTO_THREADS}', found {value}"
        )
    return value


def format_threads(threads: int | None) -> str:
    """``threads`` as written in a configuration: the count, or ``auto`` for ``None``."""
    return AUTO_THREADS if threads is None else str(threads)


def format_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps the number >= 1 (``70.0 GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the loop returns at TiB")
