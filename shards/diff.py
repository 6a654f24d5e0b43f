"""Differences between two tensor tables, as frozen :class:`TensorChange` records.

The agent diffs what is on disk (desired) against what the runtime has loaded (actual); the
command line diffs two files. A logical shape change is flagged, since the runtime refuses it.
Content is compared by fingerprint when a fingerprint function is given; without one a new file
version (identity) counts as a possible content change.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ggufswap.shards.records import TensorRecord


class ChangeKind(enum.Enum):
    ADDED = "added"
    REMOVED = "removed"
    MODIFIED = "modified"
    SHAPE_CHANGED = "shape_changed"
    UNCHANGED = "unchanged"


class Field(enum.Enum):
    """What differs between the old and the new record of a tensor."""

    TYPE = "type"
    NBYTES = "nbytes"
    OFFSET = "offset"
    SHARD = "shard"
    IDENTITY = "identity"  # same place, new file version
    CONTENT = "content"


@dataclass(frozen=True, slots=True)
class TensorChange:
    name: str
    kind: ChangeKind
    old: TensorRecord | None
    new: TensorRecord | None
    fields: frozenset[Field] = frozenset()

    def describe(self) -> str:
        if self.kind is ChangeKind.ADDED and self.new is not None:
            return f"added {self.new.ggml_type.name} {list(self.new.shape)}"
        if self.kind is ChangeKind.REMOVED:
            return "removed"
        if self.old is None or self.new is None:
            return self.kind.value
        if self.kind is ChangeKind.SHAPE_CHANGED:
            return f"shape {list(self.old.shape)} -> {list(self.new.shape)} (will be refused)"
        parts = []
        if Field.TYPE in self.fields:
            parts.append(f"type {self.old.ggml_type.name} -> {self.new.ggml_type.name}")
        if Field.NBYTES in self.fields:
            parts.append(f"bytes {self.old.nbytes} -> {self.new.nbytes}")
        parts.extend(
            f.value for f in (Field.SHARD, Field.OFFSET, Field.CONTENT) if f in self.fields
        )
        if not parts and Field.IDENTITY in self.fields:
            parts.append("file rewritten")
        return ", ".join(parts) or self.kind.value


Fingerprint = Callable[[TensorRecord], str]


def compare(
    old: TensorRecord, new: TensorRecord, fingerprint: Fingerprint | None = None
) -> TensorChange:
    """Classify one tensor present on both sides."""
    if old.shape != new.shape:
        return TensorChange(old.name, ChangeKind.SHAPE_CHANGED, old, new, frozenset())
    fields: set[Field] = set()
    if old.ggml_type != new.ggml_type:
        fields.add(Field.TYPE)
    if old.nbytes != new.nbytes:
        fields.add(Field.NBYTES)
    if old.path != new.path:
        fields.add(Field.SHARD)
    if old.offset != new.offset:
        fields.add(Field.OFFSET)
    if old.identity != new.identity:
        fields.add(Field.IDENTITY)
    if fields and fingerprint is not None:
        if fields & {Field.TYPE, Field.NBYTES} or fingerprint(old) != fingerprint(new):
            fields.add(Field.CONTENT)
        if Field.CONTENT not in fields:
            # Same bytes, same type: only where the tensor lives changed.
            kind = ChangeKind.UNCHANGED
            return TensorChange(old.name, kind, old, new, frozenset(fields))
    elif fields & {Field.TYPE, Field.NBYTES}:
        fields.add(Field.CONTENT)
    kind = ChangeKind.MODIFIED if fields else ChangeKind.UNCHANGED
    return TensorChange(old.name, kind, old, new, frozenset(fields))


def diff_tables(
    old: Mapping[str, TensorRecord],
    new: Mapping[str, TensorRecord],
    *,
    fingerprint: Fingerprint | None = None,
    include_unchanged: bool = False,
) -> list[TensorChange]:
    """Every tensor's change from ``old`` to ``new``, sorted by name."""
    changes: list[TensorChange] = []
    for name in sorted(old.keys() | new.keys()):
        before, after = old.get(name), new.get(name)
        if before is None:
            changes.append(TensorChange(name, ChangeKind.ADDED, None, after))
        elif after is None:
            changes.append(TensorChange(name, ChangeKind.REMOVED, before, None))
        else:
            change = compare(before, after, fingerprint)
            if include_unchanged or change.kind is not ChangeKind.UNCHANGED:
                changes.append(change)
    return changes
