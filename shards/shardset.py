"""Shard sets: one model as one file, gguf-split shards, or one tensor per shard file.

All three layouts are one mechanism. An unsplit file is a set of one; gguf-split writes
``split.no`` / ``split.count`` into every shard and names them ``PREFIX-00001-of-00004.gguf``
(llama.cpp's ``llama_split_path``); a per-expert sweep layout is the same with one tensor per
shard (``--split-max-tensors 1``). The metadata decides: the file-name convention is used only to
find the siblings, and each sibling must then declare the position its name implies.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from ggufswap.shards.errors import ShardError, ShardSetError
from ggufswap.shards.keys import Keys
from ggufswap.shards.reader import MetaValue, ShardHeader, read_header
from ggufswap.shards.records import FileIdentity, TensorRecord

_SPLIT_NAME: Final = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_path(prefix: str, split_no: int, split_count: int) -> str:
    """llama.cpp's ``llama_split_path``: ``split_no`` is 0-based."""
    return f"{prefix}-{split_no + 1:05d}-of-{split_count:05d}.gguf"


def split_prefix(header: ShardHeader, named: str | None = None) -> str:
    """The set's common path prefix, checked against what the header declares.

    ``named`` is the path the caller used. In a Hugging Face cache that is the link in
    ``snapshots/``, whose name follows the convention, while ``header.path`` is the blob it
    resolves to (a content hash): siblings are then looked for beside the link. A link that does
    not follow the convention (``current.gguf``) leads to siblings beside the real file.
    """
    expected = split_path("PREFIX", header.split_no, header.split_count).removeprefix("PREFIX")
    declared = (header.split_no + 1, header.split_count)
    for candidate in (named, header.path):
        if candidate is None:
            continue
        match = _SPLIT_NAME.match(os.path.basename(candidate))
        if match is not None and (int(match["no"]), int(match["count"])) == declared:
            return os.path.join(os.path.dirname(candidate), match["prefix"])
    raise ShardSetError(
        named or header.path,
        f"declares split {declared[0]} of {declared[1]}, so its name must end in "
        f"'{expected}' (the gguf-split naming convention)",
    )


class HeaderCache:
    """Parsed headers by real path, reused while the file keeps its identity. Thread-safe."""

    def __init__(self) -> None:
        self._headers: dict[str, ShardHeader] = {}
        self._lock = threading.Lock()

    def get(self, path: str | os.PathLike[str], *, resolved: bool = False) -> ShardHeader:
        """The header of ``path``, parsed again only when its identity changed. ``resolved``:
        ``path`` is already a real path (skips ``realpath``)."""
        real = os.fspath(path) if resolved else os.path.realpath(path)
        try:
            identity = FileIdentity.of_path(real)
        except FileNotFoundError:
            self.forget(real)
            raise ShardError(real, "no such file") from None
        except OSError as exc:
            raise ShardError(real, f"cannot stat: {exc}") from None
        with self._lock:
            cached = self._headers.get(real)
        if cached is not None and cached.identity == identity:
            return cached
        header = read_header(real)
        with self._lock:
            self._headers[real] = header
        return header

    def forget(self, path: str) -> None:
        with self._lock:
            self._headers.pop(os.path.realpath(path), None)

    def __len__(self) -> int:
        return len(self._headers)


@dataclass(frozen=True, slots=True)
class ShardSet:
    """A validated model: its shards in split order and one name → record view."""

    shards: tuple[ShardHeader, ...]
    tensors: Mapping[str, TensorRecord] = field(compare=False, hash=False, repr=False)

    @property
    def first(self) -> ShardHeader:
        return self.shards[0]

    @property
    def metadata(self) -> Mapping[str, MetaValue]:
        """The model's metadata (gguf-split keeps it in the first shard)."""
        return self.shards[0].metadata

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(s.path for s in self.shards)

    @classmethod
    def from_headers(cls, headers: Iterable[ShardHeader]) -> ShardSet:
        """Validate that ``headers`` (any order) form one complete, consistent set."""
        shards = sorted(headers, key=lambda h: h.split_no)
        if not shards:
            raise ValueError("a shard set needs at least one shard")
        first = shards[0]
        count = first.split_count
        problems: list[str] = []
        for h in shards:
            if h.split_count != count:
                problems.append(
                    f"{h.path}: declares {Keys.Split.COUNT}={h.split_count}, the set has {count}"
                )
        positions = [h.split_no for h in shards]
        if positions != list(range(count)):
            have = set(positions)
            missing = [n for n in range(count) if n not in have]
            dupes = sorted({n for n in positions if positions.count(n) > 1})
            if missing:
                names = (
                    [split_path(split_prefix(first), n, count) for n in missing]
                    if count > 1
                    else []
                )
                problems.append(
                    f"missing shard(s) {[n + 1 for n in missing]} of {count}"
                    + (f": {', '.join(names[:5])}" if names else "")
                    + (" ..." if len(names) > 5 else "")
                )
            if dupes:
                problems.append(f"shard number(s) {[n + 1 for n in dupes]} appear twice")
        tensors: dict[str, TensorRecord] = {}
        for h in shards:
            for t in h.tensors:
                other = tensors.get(t.name)
                if other is not None:
                    problems.append(f"tensor {t.name!r} is in both {other.path} and {h.path}")
                else:
                    tensors[t.name] = t
        declared = first.metadata.get(Keys.Split.TENSORS_COUNT)
        if count > 1 and isinstance(declared, int) and declared != len(tensors):
            problems.append(
                f"{Keys.Split.TENSORS_COUNT}={declared} in {first.path}, "
                f"but the shards hold {len(tensors)} tensors"
            )
        if problems:
            raise ShardSetError(first.path, "inconsistent shard set:\n  " + "\n  ".join(problems))
        return cls(shards=tuple(shards), tensors=MappingProxyType(tensors))


def open_shard_set(path: str | os.PathLike[str], *, cache: HeaderCache | None = None) -> ShardSet:
    """Discover and validate the whole set that ``path`` (any member) belongs to."""
    cache = cache if cache is not None else HeaderCache()
    header = cache.get(path)
    if header.split_count <= 1:
        return ShardSet.from_headers([header])
    prefix = split_prefix(header, os.path.abspath(path))
    headers: list[ShardHeader] = []
    missing: list[str] = []
    for n in range(header.split_count):
        member = split_path(prefix, n, header.split_count)
        if not os.path.exists(member):
            missing.append(member)
            continue
        h = cache.get(member)
        if h.split_no != n:
            raise ShardSetError(
                h.path, f"its name says shard {n + 1}, its metadata says {h.split_no + 1}"
            )
        headers.append(h)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ShardSetError(
            header.path,
            f"{len(missing)} of {header.split_count} shards are missing: {shown}",
        )
    return ShardSet.from_headers(headers)
