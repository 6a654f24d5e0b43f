"""ggufswap.shards: the GGUF file format layer shared by the agent and the runtime."""

from __future__ import annotations

from ggufswap.shards.errors import (
    CorruptHeaderError,
    FileChangedError,
    NotGGUFError,
    ShardError,
    ShardSetError,
    TensorLayoutError,
    TruncatedError,
    UnsupportedVersionError,
)
from ggufswap.shards.keys import Keys
from ggufswap.shards.records import ArrayRef, FileIdentity, TensorRecord, tensor_nbytes, type_sizes

__all__ = [
    "ArrayRef",
    "CorruptHeaderError",
    "FileChangedError",
    "FileIdentity",
    "Keys",
    "NotGGUFError",
    "ShardError",
    "ShardSetError",
    "TensorLayoutError",
    "TensorRecord",
    "TruncatedError",
    "UnsupportedVersionError",
    "tensor_nbytes",
    "type_sizes",
]
