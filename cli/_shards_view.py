"""What ``ggufswap inspect`` and ``ggufswap diff`` print (``_cmd_shards`` registers them): this
module imports gguf-py and the shards package, which the other commands do not pay for."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from ggufswap.shards import (
    ArrayRef,
    ChangeKind,
    Field,
    Fingerprinter,
    ShardError,
    ShardSet,
    TensorChange,
    TensorRecord,
    diff_tables,
    open_shard_set,
)
from ggufswap.shards.reader import MetaValue
from ggufswap.shards.value_types import GGUFValueType

EXIT_OK = 0
EXIT_FAILURE = 1
# Fields that only say where a tensor lives: without --checksum its content is not compared.
_LOCATION_FIELDS = frozenset({Field.SHARD, Field.OFFSET, Field.IDENTITY})
_SHOWN_ARRAY_ITEMS = 8


def _fail(error: ShardError) -> int:
    print(f"ggufswap: error: {error}", file=sys.stderr)
    return EXIT_FAILURE


# --- inspect -----------------------------------------------------------------------------------


def _meta_json(value: MetaValue) -> Any:
    if isinstance(value, ArrayRef):
        return {"array_of": _type_name(value.elem_type), "count": value.count}
    if isinstance(value, tuple):
        return list(value)
    return value


def _type_name(code: int) -> str:
    return GGUFValueType(code).name


def _meta_text(value: MetaValue) -> str:
    if isinstance(value, ArrayRef):
        return f"[{_type_name(value.elem_type)} x {value.count}]"
    if isinstance(value, tuple):
        shown = ", ".join(repr(v) for v in value[:_SHOWN_ARRAY_ITEMS])
        more = f", ... ({len(value)} items)" if len(value) > _SHOWN_ARRAY_ITEMS else ""
        return f"[{shown}{more}]"
    return repr(value)


def _tensor_row(t: TensorRecord) -> dict[str, Any]:
    return {
        "name": t.name,
        "type": t.ggml_type.name,
        "shape": list(t.shape),
        "ne": list(t.ne),
        "offset": t.offset,
        "bytes": t.nbytes,
        "shard": t.path,
    }


def _totals(tensors: Mapping[str, TensorRecord]) -> dict[str, dict[str, int]]:
    totals: dict[str, dict[str, int]] = {}
    for t in tensors.values():
        entry = totals.setdefault(t.ggml_type.name, {"tensors": 0, "bytes": 0, "elements": 0})
        entry["tensors"] += 1
        entry["bytes"] += t.nbytes
        entry["elements"] += t.n_elements
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]["bytes"]))


def inspect_document(shard_set: ShardSet) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain JSON-ready data."""
    tensors = sorted(shard_set.tensors.values(), key=lambda t: (t.path, t.offset))
    return {
        "shards": [
            {
                "path": h.path,
                "split_no": h.split_no,
                "version": h.version,
                "alignment": h.alignment,
                "data_offset": h.data_offset,
                "size": h.identity.size,
                "tensors": len(h.tensors),
                "tensor_bytes": sum(t.nbytes for t in h.tensors),
            }
            for h in shard_set.shards
        ],
        "metadata": {k: _meta_json(v) for k, v in shard_set.metadata.items()},
        "tensors": [_tensor_row(t) for t in tensors],
        "totals": _totals(shard_set.tensors),
        "total": {
            "tensors": len(shard_set.tensors),
            "bytes": sum(t.nbytes for t in shard_set.tensors.values()),
        },
    }


def _table(rows: list[list[str]], out: TextIO, *, right: frozenset[int] = frozenset()) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip(), file=out)


def print_inspect(shard_set: ShardSet, out: TextIO) -> None:
    doc = inspect_document(shard_set)
    n = len(shard_set.shards)
    print(f"model: {shard_set.first.path} ({n} shard{'s' if n > 1 else ''})", file=out)
    shard_rows = [["#", "file", "version", "tensors", "tensor bytes", "file size"]]
    for s in doc["shards"]:
        shard_rows.append(
            [
                str(s["split_no"] + 1),
                os.path.basename(s["path"]),
                str(s["version"]),
                str(s["tensors"]),
                f"{s['tensor_bytes']:,}",
                f"{s['size']:,}",
            ]
        )
    _table(shard_rows, out, right=frozenset({0, 2, 3, 4, 5}))
    print("\nmetadata:", file=out)
    for key, value in shard_set.metadata.items():
        print(f"  {key} = {_meta_text(value)}", file=out)
    print("\ntensors:", file=out)
    rows = [["name", "type", "shape", "offset", "bytes", "shard"]]
    shard_no = {h.path: h.split_no + 1 for h in shard_set.shards}
    for t in doc["tensors"]:
        rows.append(
            [
                t["name"],
                t["type"],
                "x".join(str(d) for d in t["shape"]),
                str(t["offset"]),
                f"{t['bytes']:,}",
                str(shard_no[t["shard"]]),
            ]
        )
    _table(rows, out, right=frozenset({3, 4, 5}))
    print("\ntotals by type:", file=out)
    totals = [["type", "tensors", "bytes"]]
    totals += [[k, str(v["tensors"]), f"{v['bytes']:,}"] for k, v in doc["totals"].items()]
    totals.append(["all", str(doc["total"]["tensors"]), f"{doc['total']['bytes']:,}"])
    _table(totals, out, right=frozenset({1, 2}))


def run_inspect(args: argparse.Namespace) -> int:
    try:
        shard_set = open_shard_set(args.path)
    except ShardError as error:
        return _fail(error)
    if args.json:
        json.dump(inspect_document(shard_set), sys.stdout, indent=1)
        print()
    else:
        print_inspect(shard_set, sys.stdout)
    return EXIT_OK


# --- diff --------------------------------------------------------------------------------------


def _is_relocation(change: TensorChange, *, checksum: bool) -> bool:
    """A change that only says the tensor lives elsewhere (content not compared)."""
    return (
        not checksum
        and change.kind is ChangeKind.MODIFIED
        and bool(change.fields)
        and change.fields <= _LOCATION_FIELDS
    )


def _change_json(change: TensorChange, *, checksum: bool) -> dict[str, Any]:
    return {
        "name": change.name,
        "kind": change.kind.value,
        "fields": sorted(f.value for f in change.fields),
        "relocated_only": _is_relocation(change, checksum=checksum),
        "old": _tensor_row(change.old) if change.old else None,
        "new": _tensor_row(change.new) if change.new else None,
        "description": change.describe(),
    }


def diff_document(old: ShardSet, new: ShardSet, *, checksum: bool) -> dict[str, Any]:
    """The diff of two models as plain JSON-ready data."""
    fingerprint = Fingerprinter() if checksum else None
    changes = diff_tables(old.tensors, new.tensors, fingerprint=fingerprint)
    counts = {kind.value: 0 for kind in ChangeKind if kind is not ChangeKind.UNCHANGED}
    relocated = 0
    for c in changes:
        if _is_relocation(c, checksum=checksum):
            relocated += 1
        else:
            counts[c.kind.value] += 1
    common = len(old.tensors.keys() & new.tensors.keys())
    return {
        "old": list(old.paths),
        "new": list(new.paths),
        "content_compared": checksum,
        "counts": {**counts, "relocated_only": relocated, "common": common},
        "changes": [_change_json(c, checksum=checksum) for c in changes],
    }


def print_diff(doc: dict[str, Any], out: TextIO) -> None:
    shown = [c for c in doc["changes"] if not c["relocated_only"]]
    for c in shown:
        print(f"{c['kind'].upper():<13} {c['name']}: {c['description']}", file=out)
    counts = doc["counts"]
    summary = ", ".join(
        f"{counts[k]} {k.replace('_', ' ')}"
        for k in ("added", "removed", "modified", "shape_changed")
    )
    print(f"{len(shown)} change(s): {summary}", file=out)
    if counts["relocated_only"]:
        print(
            f"{counts['relocated_only']} tensor(s) of the same type and shape live at another "
            "shard/offset; their content was not compared (use --checksum)",
            file=out,
        )


def run_diff(args: argparse.Namespace) -> int:
    try:
        old = open_shard_set(args.old)
        new = open_shard_set(args.new)
        doc = diff_document(old, new, checksum=args.checksum)
    except ShardError as error:
        return _fail(error)
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print_diff(doc, sys.stdout)
    return EXIT_OK
