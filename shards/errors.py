"""Errors raised while reading, validating and comparing GGUF shards.

Every error names the file, the byte position where that makes sense, and what was expected
against what was found, so that an operator can act on the message alone.
"""

from __future__ import annotations

import os


class ShardError(Exception):
    """Base class: a GGUF file or shard set is unusable."""

    def __init__(self, path: str | os.PathLike[str], message: str, *, pos: int | None = None):
        self.path = os.fspath(path)
        self.pos = pos
        self.detail = message
        where = f"{self.path}" if pos is None else f"{self.path} @ byte {pos}"
        super().__init__(f"{where}: {message}")


class NotGGUFError(ShardError):
    """The file does not start with the GGUF magic."""


class UnsupportedVersionError(ShardError):
    """The GGUF version is not one this reader understands (2 and 3)."""


class TruncatedError(ShardError):
    """The file ends before a structure it declares (a copy still in progress, or damage)."""


class CorruptHeaderError(ShardError):
    """A count, length, type code or key in the header is impossible."""


class TensorLayoutError(ShardError):
    """The tensor table is inconsistent: bad dims, type, offset, overlap or duplicate names."""


class ShardSetError(ShardError):
    """The shards of a split model do not form one consistent set."""


class FileChangedError(ShardError):
    """The file changed identity while it was being read."""


class RequantError(ShardError, ValueError):
    """A requantization request cannot be carried out (unknown tensor, unsupported type...)."""
