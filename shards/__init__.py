"""ggufswap.shards: the GGUF file format layer shared by the agent and the runtime.

The names below are imported on first use (PEP 562), as ``ggufswap.runtime``'s are: a module
that needs one light part (``ggml_types``, ``records``: the IPC layer, the CLI's parser, a
runtime opening its port) does not pay for gguf-py and numpy, which the reader, writer and
requantizer import.

A name that is also a submodule's (``fingerprint``) is bound here at import, not on first use:
importing the submodule makes the package attribute that module, and ``__getattr__`` would never
be asked (``from ggufswap.shards import fingerprint`` would give the module, depending on what was
imported before). ``fingerprint`` is light (xxhash, the data readers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Bound at import: the submodule of the same name (see above).
from ggufswap.shards.fingerprint import fingerprint

if TYPE_CHECKING:
    from ggufswap.shards.atomic import (
        atomic_copy,
        atomic_replace,
        atomic_write,
    )
    from ggufswap.shards.data import (
        check_readable,
        open_verified,
        read_into,
        read_range,
        read_tensor_bytes,
    )
    from ggufswap.shards.diff import (
        ChangeKind,
        Field,
        TensorChange,
        diff_tables,
    )
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
    from ggufswap.shards.fingerprint import Fingerprinter, fingerprint_bytes
    from ggufswap.shards.ggml_types import GGMLType
    from ggufswap.shards.keys import Arch, Keys
    from ggufswap.shards.presets import (
        demo_moe,
        tiny_arch,
        tiny_dense,
        tiny_moe,
    )
    from ggufswap.shards.reader import (
        ShardHeader,
        read_array,
        read_header,
    )
    from ggufswap.shards.records import (
        ArrayRef,
        FileIdentity,
        TensorRecord,
        tensor_nbytes,
        type_sizes,
    )
    from ggufswap.shards.requant import (
        SUPPORTED_TARGETS,
        requantize,
        requantize_bytes,
        restore,
        rewrite_tensor,
    )
    from ggufswap.shards.shardset import (
        HeaderCache,
        ShardSet,
        open_shard_set,
    )
    from ggufswap.shards.writer import (
        WRITABLE_TYPES,
        Layout,
        ModelSpec,
        Role,
        plan_tensors,
        write_model,
    )

_HOMES: dict[str, str] = {  # name -> the module that defines it
    "Arch": "ggufswap.shards.keys",
    "ArrayRef": "ggufswap.shards.records",
    "ChangeKind": "ggufswap.shards.diff",
    "CorruptHeaderError": "ggufswap.shards.errors",
    "Field": "ggufswap.shards.diff",
    "FileChangedError": "ggufswap.shards.errors",
    "FileIdentity": "ggufswap.shards.records",
    "Fingerprinter": "ggufswap.shards.fingerprint",
    "GGMLType": "ggufswap.shards.ggml_types",
    "HeaderCache": "ggufswap.shards.shardset",
    "Keys": "ggufswap.shards.keys",
    "Layout": "ggufswap.shards.writer",
    "ModelSpec": "ggufswap.shards.writer",
    "NotGGUFError": "ggufswap.shards.errors",
    "RequantError": "ggufswap.shards.errors",
    "Role": "ggufswap.shards.writer",
    "SUPPORTED_TARGETS": "ggufswap.shards.requant",
    "ShardError": "ggufswap.shards.errors",
    "ShardHeader": "ggufswap.shards.reader",
    "ShardSet": "ggufswap.shards.shardset",
    "ShardSetError": "ggufswap.shards.errors",
    "TensorChange": "ggufswap.shards.diff",
    "TensorLayoutError": "ggufswap.shards.errors",
    "TensorRecord": "ggufswap.shards.records",
    "TruncatedError": "ggufswap.shards.errors",
    "UnsupportedVersionError": "ggufswap.shards.errors",
    "WRITABLE_TYPES": "ggufswap.shards.writer",
    "atomic_copy": "ggufswap.shards.atomic",
    "atomic_replace": "ggufswap.shards.atomic",
    "atomic_write": "ggufswap.shards.atomic",
    "check_readable": "ggufswap.shards.data",
    "demo_moe": "ggufswap.shards.presets",
    "diff_tables": "ggufswap.shards.diff",
    "fingerprint_bytes": "ggufswap.shards.fingerprint",
    "open_shard_set": "ggufswap.shards.shardset",
    "open_verified": "ggufswap.shards.data",
    "plan_tensors": "ggufswap.shards.writer",
    "read_array": "ggufswap.shards.reader",
    "read_header": "ggufswap.shards.reader",
    "read_into": "ggufswap.shards.data",
    "read_range": "ggufswap.shards.data",
    "read_tensor_bytes": "ggufswap.shards.data",
    "requantize": "ggufswap.shards.requant",
    "requantize_bytes": "ggufswap.shards.requant",
    "restore": "ggufswap.shards.requant",
    "rewrite_tensor": "ggufswap.shards.requant",
    "tensor_nbytes": "ggufswap.shards.records",
    "tiny_arch": "ggufswap.shards.presets",
    "tiny_dense": "ggufswap.shards.presets",
    "tiny_moe": "ggufswap.shards.presets",
    "type_sizes": "ggufswap.shards.records",
    "write_model": "ggufswap.shards.writer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


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
