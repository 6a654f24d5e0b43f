"""ggufswap.shards: the GGUF file format layer shared by the agent and the runtime."""

from __future__ import annotations

from ggufswap.shards.data import check_readable, open_verified, read_into, read_tensor_bytes
from ggufswap.shards.diff import ChangeKind, Field, TensorChange, diff_tables
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
from ggufswap.shards.fingerprint import Fingerprinter, fingerprint, fingerprint_bytes
from ggufswap.shards.keys import Keys
from ggufswap.shards.reader import ShardHeader, read_array, read_header
from ggufswap.shards.records import ArrayRef, FileIdentity, TensorRecord, tensor_nbytes, type_sizes
from ggufswap.shards.shardset import HeaderCache, ShardSet, open_shard_set

__all__ = [
    "ArrayRef",
    "ChangeKind",
    "CorruptHeaderError",
    "Field",
    "FileChangedError",
    "FileIdentity",
    "Fingerprinter",
    "HeaderCache",
    "Keys",
    "NotGGUFError",
    "ShardError",
    "ShardHeader",
    "ShardSet",
    "ShardSetError",
    "TensorChange",
    "TensorLayoutError",
    "TensorRecord",
    "TruncatedError",
    "UnsupportedVersionError",
    "check_readable",
    "diff_tables",
    "fingerprint",
    "fingerprint_bytes",
    "open_shard_set",
    "open_verified",
    "read_array",
    "read_header",
    "read_into",
    "read_tensor_bytes",
    "tensor_nbytes",
    "type_sizes",
]
