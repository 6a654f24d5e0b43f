"""Frozen records describing a GGUF file's tensors.

Shapes: GGUF stores dimensions in ggml ``ne`` order, fastest-varying first (``ne[0]`` is the
row length). PyTorch's logical shape is the reverse. ``TensorRecord.ne`` keeps the on-disk order;
``TensorRecord.shape`` is the logical torch order (a ``[n_embd, n_vocab]`` ``ne`` is a
``(n_vocab, n_embd)`` tensor).
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass

from ggufswap.shards import ggml_types
from ggufswap.shards.ggml_types import GGMLType


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What identifies one version of a file: a rename, rewrite or truncation changes it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of_stat(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @classmethod
    def of_fd(cls, fd: int) -> FileIdentity:
        return cls.of_stat(os.fstat(fd))

    @classmethod
    def of_path(cls, path: str | os.PathLike[str]) -> FileIdentity:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{os.fspath(path)}: not a regular file")
        return cls.of_stat(st)

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns)


def type_sizes(ggml_type: GGMLType) -> tuple[int, int]:
    """``(block_size, type_size)``: elements per block and bytes per block (see
    :mod:`.ggml_types`; a few ik_llama.cpp types add a per-row header, which
    :func:`tensor_nbytes` counts)."""
    layout = ggml_types.LAYOUTS[GGMLType(ggml_type)]
    return layout.block_size, layout.type_size


def tensor_nbytes(ggml_type: GGMLType, ne: tuple[int, ...]) -> int:
    """Byte size of a tensor of ``ne`` (ggml order) elements; ``ne[0]`` must fill whole blocks."""
    return ggml_types.tensor_nbytes(ggml_type, ne)


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor of one shard, as its header describes it."""

    name: str
    ggml_type: GGMLType
    ne: tuple[int, ...]  # ggml order, ne[0] fastest-varying
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    path: str  # real path of the shard file
    identity: FileIdentity  # the file version the record was read from

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (torch) shape: ``ne`` reversed."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """A metadata array left on disk: where it is, not what it holds (vocabularies are large)."""

    elem_type: int  # a gguf.GGUFValueType code
    count: int
    offset: int  # byte offset of the first element
    nbytes: int  # byte length of all elements
