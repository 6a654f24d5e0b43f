"""Re-lay a model's files: one tensor per shard (so a sweep round rewrites one small file), or
everything back into one file.

The metadata section is copied key by key (``split.*`` keys dropped, then written anew as
gguf-split writes them: the first shard holds every key, the others only ``split.no``,
``split.count`` and ``split.tensors.count``); tensors keep their order, types and bytes, read
from the source files without loading the model into memory. Shards are written last to first,
so the file to load appears only when the rest of the set is in place. The result loads with
llama.cpp and ``ggufswap`` exactly as the source does (``ggufswap diff --checksum`` shows no
change).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Final

import numpy as np
from gguf import Keys

from ggufswap.shards.errors import ShardError
from ggufswap.shards.reader import read_header
from ggufswap.shards.requant import _kv_section, _skip_value
from ggufswap.shards.shardset import ShardSet, open_shard_set, split_path
from ggufswap.shards.value_types import GGUFValueType
from ggufswap.shards.writer import RawTensor, TypedValue, encode_metadata, write_gguf

_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_SPLIT_PREFIX: Final = "split."


def kv_entries(path: str, data_offset: int) -> list[tuple[str, bytes]]:
    """``(key, raw entry bytes)`` of every metadata key of a validated file, in file order."""
    with open(path, "rb") as f:
        blob = f.read(data_offset)
    n_kv, section = _kv_section(blob)
    entries, pos = [], 0
    for _ in range(n_kv):
        start = pos
        key_len = _U64.unpack_from(section, pos)[0]
        key = section[pos + 8 : pos + 8 + key_len].decode()
        pos += 8 + key_len
        vtype = GGUFValueType(_U32.unpack_from(section, pos)[0])
        pos = _skip_value(section, pos + 4, vtype)
        entries.append((key, section[start:pos]))
    return entries


def _tensors(shard_set: ShardSet) -> list[RawTensor]:
    """Every tensor of the set in shard order, its bytes a read-only map of the source file."""
    out = []
    for header in shard_set.shards:
        if not header.tensors:
            continue
        mapped = np.memmap(header.path, dtype=np.uint8, mode="r")
        for t in header.tensors:
            if t.offset + t.nbytes > mapped.size:
                raise ShardError(header.path, f"{t.name}: its bytes run past the end of the file")
            data = mapped[t.offset : t.offset + t.nbytes]
            out.append(RawTensor(t.name, t.ggml_type, t.ne, data))
    return out


def _stem(shard_set: ShardSet) -> str:
    first = Path(shard_set.first.path)
    name = first.name.removesuffix(".gguf")
    if shard_set.first.split_count > 1:
        suffix = split_path("", 0, shard_set.first.split_count).removesuffix(".gguf")
        name = name.removesuffix(suffix)
    return name


def split_per_tensor(model: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``model`` (any layout) into ``out_dir`` as one shard per tensor; returns the files,
    the first one being the file to load."""
    shard_set = open_shard_set(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kv = [(k, raw) for k, raw in kv_entries(shard_set.first.path, shard_set.first.data_offset)]
    kv = [(k, raw) for k, raw in kv if not k.startswith(_SPLIT_PREFIX)]
    tensors = _tensors(shard_set)
    n = len(tensors)
    stem = _stem(shard_set)
    paths = [Path(split_path(str(out_dir / stem), i, n)) for i in range(n)]
    alignment = shard_set.first.alignment
    for i in reversed(range(n)):
        split_kv = encode_metadata(
            [
                (Keys.Split.LLM_KV_SPLIT_NO, TypedValue(GGUFValueType.UINT16, i)),
                (Keys.Split.LLM_KV_SPLIT_COUNT, TypedValue(GGUFValueType.UINT16, n)),
                (Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, TypedValue(GGUFValueType.INT32, n)),
            ]
        )
        own = kv if i == 0 else []
        write_gguf(
            paths[i],
            n_kv=len(own) + 3,
            kv_bytes=b"".join(raw for _, raw in own) + split_kv,
            tensors=[tensors[i]],
            alignment=alignment,
        )
    return paths


def merge_to_one(model: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write ``model`` (any layout) as one file ``out``."""
    shard_set = open_shard_set(model)
    kv = kv_entries(shard_set.first.path, shard_set.first.data_offset)
    kv = [(k, raw) for k, raw in kv if not k.startswith(_SPLIT_PREFIX)]
    path = write_gguf(
        Path(out),
        n_kv=len(kv),
        kv_bytes=b"".join(raw for _, raw in kv),
        tensors=_tensors(shard_set),
        alignment=shard_set.first.alignment,
    )
    read_header(path)  # the written file parses with every bound checked
    return path
