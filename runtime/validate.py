"""Checks a plan must pass before anything is touched; every failing tensor is reported."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence

import numpy as np

from ggufswap.ipc import Plan, Reason
from ggufswap.runtime.kernels import has_kernel
from ggufswap.runtime.store import TensorStore
from ggufswap.shards import (
    FileChangedError,
    ShardError,
    ShardHeader,
    TensorRecord,
    ggml_types,
    read_header,
    tensor_nbytes,
    type_sizes,
)


def inside_roots(path: str, roots: Sequence[str]) -> bool:
    """Whether the real path of ``path`` lies under one of ``roots`` (real paths too); a path
    that cannot name a file (an embedded NUL) lies under none."""
    try:
        real = os.path.realpath(path)
    except (ValueError, OSError):
        return False
    for root in roots:
        base = os.path.realpath(root)
        if os.path.commonpath([real, base]) == base:
            return True
    return False


def _resolved(path: str) -> str:
    """How a refused path resolves, for the reason: ``PATH resolves to REAL``."""
    try:
        return f"{path} resolves to {os.path.realpath(path)}"
    except (ValueError, OSError) as exc:
        return f"{path!r} names no file ({exc})"


@functools.cache
def can_dequantize(ggml_type: ggml_types.GGMLType) -> bool:
    """Whether a torch kernel or gguf's numpy code can dequantize ``ggml_type`` at all."""
    if has_kernel(ggml_type):
        return True
    if ggml_types.LAYOUTS[ggml_type].origin is not ggml_types.Origin.MAINLINE:
        return False  # gguf knows mainline's types only
    from gguf import GGMLQuantizationType, quants

    _, type_size = type_sizes(ggml_type)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            quants.dequantize(
                np.zeros((1, type_size), dtype=np.uint8), GGMLQuantizationType(int(ggml_type))
            )
    except NotImplementedError:
        return False
    return True


def validate_plan(plan: Plan, store: TensorStore, *, allowed_roots: Sequence[str]) -> list[Reason]:
    """Every reason the plan cannot be applied (empty when it can)."""
    reasons: list[Reason] = []
    seen: set[str] = set()
    headers: dict[str, ShardHeader | ShardError] = {}  # one parse per file per plan
    for job in plan.jobs:
        rec = job.source
        name = rec.name
        if name in seen:
            reasons.append(Reason(name, "appears twice in the plan"))
            continue
        seen.add(name)
        slot = store.slots.get(name)
        if slot is None:
            reasons.append(Reason(name, "the loaded model has no tensor of this name"))
            continue
        reasons.extend(_content_reasons(rec, slot.shape, strict=store.strict))
        if not inside_roots(rec.path, allowed_roots):
            reasons.append(
                Reason(
                    name,
                    f"{_resolved(rec.path)}, outside the allowed roots {list(allowed_roots)}",
                )
            )
            continue  # never stat a file outside the roots
        reason = _check_against_header(rec, headers)
        if reason is not None:
            reasons.append(reason)
    for derived in store.derived_of(seen):
        if derived.rebuild is None:
            changed = sorted(seen.intersection(derived.sources))
            reasons.extend(
                Reason(
                    src,
                    f"{derived.name} is derived from it at load and cannot be rebuilt "
                    f"({derived.why_not})",
                )
                for src in changed
            )
    return reasons


def _content_reasons(rec: TensorRecord, loaded: tuple[int, ...], *, strict: bool) -> list[Reason]:
    """What is wrong with the new content itself: a shape other than the loaded one, a size that
    is not its type's, or a type nothing here decodes."""
    name = rec.name
    reasons: list[Reason] = []
    if rec.shape != loaded:
        reasons.append(
            Reason(
                name,
                f"on-disk shape {list(rec.shape)} differs from loaded {list(loaded)}; "
                "a logical shape change needs a restart",
            )
        )
    block_size, _ = type_sizes(rec.ggml_type)
    if rec.ne[0] % block_size or rec.nbytes != tensor_nbytes(rec.ggml_type, rec.ne):
        reasons.append(
            Reason(
                name,
                f"{rec.nbytes} bytes is not a {rec.ggml_type.name} tensor of ne={list(rec.ne)}",
            )
        )
    if not can_dequantize(rec.ggml_type):
        reasons.append(
            Reason(
                name,
                f"type {rec.ggml_type.name} cannot be dequantized (no torch kernel, and "
                "gguf has no dequantizer for it)",
            )
        )
    elif strict and not has_kernel(rec.ggml_type):
        reasons.append(
            Reason(name, f"type {rec.ggml_type.name} has no torch kernel (strict_types is on)")
        )
    return reasons


def _check_against_header(
    rec: TensorRecord, headers: dict[str, ShardHeader | ShardError]
) -> Reason | None:
    """The file must still be the version the plan names, and its own header must list this
    tensor with the plan's type, dimensions, offset and size: a plan may name bytes only as the
    file itself describes them (never the header's bytes, another tensor's or another type)."""
    name = rec.name
    header = headers.get(rec.path)
    if header is None:
        try:
            header = read_header(rec.path)
        except ShardError as exc:
            header = exc
        headers[rec.path] = header
    if isinstance(header, FileChangedError):
        return Reason(name, f"stale: {header.detail}", stale=True)
    if isinstance(header, ShardError):
        return Reason(name, f"cannot read the header of {rec.path}: {header.detail}")
    if header.identity != rec.identity:
        return Reason(name, f"stale: {rec.path} changed since the plan was made", stale=True)
    on_disk = header.tensor_map().get(name)
    if on_disk is None:
        return Reason(
            name, f"{rec.path} has no tensor of this name (its header lists {len(header.tensors)})"
        )
    planned = (rec.ggml_type.name, list(rec.ne), rec.offset, rec.nbytes)
    described = (on_disk.ggml_type.name, list(on_disk.ne), on_disk.offset, on_disk.nbytes)
    if planned != described:
        return Reason(
            name,
            f"the plan's (type, ne, offset, nbytes) {planned} differ from what the header of "
            f"{rec.path} says, {described}",
        )
    return None
