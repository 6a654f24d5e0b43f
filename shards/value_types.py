"""GGUF metadata value type codes (``GGUFValueType``), the project's own, and a value with its
type (``TypedValue``, what the writer encodes).

The same names and codes as gguf-py's ``GGUFValueType`` (checked equal by the tests); both are
``IntEnum``s, so a member of one compares and hashes equal to the other's of the same code.
Kept here so that reading a file (the reader, the runtime, the agent) does not import gguf-py,
whose package import pulls in its writer, quantizers and vocabulary tools (``docs/serving.md``:
the runtime's start path).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

__all__ = ["GGUFValueType", "TypedValue"]


class GGUFValueType(IntEnum):
    """The type code of a GGUF metadata value (``gguf_type`` in ggml's ``gguf.h``)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


@dataclass(frozen=True, slots=True)
class TypedValue:
    """One metadata value with its GGUF type (``sub_type`` for arrays)."""

    vtype: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None
