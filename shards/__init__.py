"""ggufswap.shards: the GGUF file format layer shared by the agent and the runtime."""

from __future__ import annotations

from ggufswap.shards.atomic import atomic_copy, atomic_replace, atomic_write
from ggufswap.shards.data import (
    check_readable,
    open_verified,
    read_into,
    read_range,
    read_tensor_bytes,
)
from ggufswap.shards.diff import ChangeKind, Field, TensorChange, diff_tables
from ggufswap.shards.errors import (
    CorruptHeaderError,
    FileChangedError,
    NotGGUFError,
    RequantError,
    ShardError,
    ShardSetError,
    TensorLayoutError,
    TruncatedError,
    UnsupportedVersionError,
)
from ggufswap.shards.fingerprint import Fingerprinter, fingerprint, fingerprint_bytes
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.presets import demo_moe, tiny_arch, tiny_dense, tiny_moe
from ggufswap.shards.reader import ShardHeader, read_array, read_header
from ggufswap.shards.records import ArrayRef, FileIdentity, TensorRecord, tensor_nbytes, type_sizes
from ggufswap.shards.requant import (
    SUPPORTED_TARGETS,
    requantize,
    requantize_bytes,
    restore,
    rewrite_tensor,
)
from ggufswap.shards.shardset import HeaderCache, ShardSet, open_shard_set
from ggufswap.shards.writer import (
    WRITABLE_TYPES,
    Layout,
    ModelSpec,
    Role,
    plan_tensors,
    write_model,
)

__all__ = [
    "SUPPORTED_TARGETS",
    "WRITABLE_TYPES",
    "Arch",
    "ArrayRef",
    "ChangeKind",
    "CorruptHeaderError",
    "Field",
    "FileChangedError",
    "FileIdentity",
    "Fingerprinter",
    "GGMLType",
    "HeaderCache",
    "Keys",
    "Layout",
    "ModelSpec",
    "NotGGUFError",
    "RequantError",
    "Role",
    "ShardError",
    "ShardHeader",
    "ShardSet",
    "ShardSetError",
    "TensorChange",
    "TensorLayoutError",
    "TensorRecord",
    "TruncatedError",
    "UnsupportedVersionError",
    "atomic_copy",
    "atomic_replace",
    "atomic_write",
    "check_readable",
    "demo_moe",
    "diff_tables",
    "fingerprint",
    "fingerprint_bytes",
    "open_shard_set",
    "open_verified",
    "plan_tensors",
    "read_array",
    "read_header",
    "read_into",
    "read_range",
    "read_tensor_bytes",
    "requantize",
    "requantize_bytes",
    "restore",
    "rewrite_tensor",
    "tensor_nbytes",
    "tiny_arch",
    "tiny_dense",
    "tiny_moe",
    "type_sizes",
    "write_model",
]
