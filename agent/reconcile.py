"""Reconciliation: desired (the shard index) minus actual (the runtime's state) is the plan.

A plan is computed from two states, never from file events, so re-running it after a restart,
a lost message or an overflow gives the same answer. Its ``plan_id`` is a hash of its content
(model, the runtime's weight version it applies to, every job's source and fingerprint): the
same desired state against the same actual state always yields the same id, and the runtime
applies an id at most once.

Comparison per tensor that both sides have:

* ``verify: stat``: the same file version (device, inode, size, mtime, ctime), offset, type and
  size means unchanged; anything else is a job without fingerprint.
* ``verify: checksum``: the same file version is unchanged without reading anything; otherwise the
  content fingerprint (computed on demand, cached by file identity) decides, so a rewritten shard
  plans only the tensors whose bytes or type changed. Jobs carry the fingerprint, which the
  runtime re-checks against the bytes it reads.

Never planned (reported as blocked instead): logical shape changes (the runtime refuses them, and
one refused job would sink the whole atomic plan), tensors the runtime has not loaded, tensors it
refused before from the very same source, and tensors whose file changed while being hashed.

Jobs are ordered so that tensors likely to return to their original buffer go first (those the
runtime reports ``DETACHED`` or ``FALLBACK_CPU``), then those that shrink, freeing memory before
anything grows; the runtime orders again by what it knows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ggufswap.config import VerifyMode
from ggufswap.ipc import Job, Plan, Reason, SlotState, TensorEntry
from ggufswap.ipc.bodies import LOST_FINGERPRINT
from ggufswap.shards import ShardError, TensorRecord

PLAN_ID_BYTES = 16


@dataclass(frozen=True, slots=True)
class Reconciliation:
    plan: Plan | None  # None when nothing is to be done
    blocked: tuple[Reason, ...] = ()  # desired changes that are not planned, and why
    not_loaded: tuple[str, ...] = ()  # desired tensors the runtime does not report
    unchanged: int = 0
    why: Mapping[str, str] = field(default_factory=dict)  # job name -> what differs


def plan_id_for(model: str, base_version: int, jobs: tuple[Job, ...]) -> str:
    """A content hash of the plan: equal inputs give equal ids, on any host."""
    body = [
        model,
        base_version,
        [
            [
                j.name,
                j.source.path,
                j.source.offset,
                j.source.nbytes,
                int(j.source.ggml_type),
                list(j.source.ne),
                list(j.source.identity.as_tuple()),
                j.fingerprint,
            ]
            for j in sorted(jobs, key=lambda j: j.name)
        ],
    ]
    text = json.dumps(body, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=PLAN_ID_BYTES).hexdigest()


def _same_version(old: TensorRecord, new: TensorRecord) -> bool:
    return (
        old.identity == new.identity
        and old.offset == new.offset
        and old.ggml_type == new.ggml_type
        and old.nbytes == new.nbytes
        and old.ne == new.ne
    )


def _differences(old: TensorRecord, new: TensorRecord) -> str:
    parts = []
    if old.ggml_type != new.ggml_type:
        parts.append(f"type {old.ggml_type.name} -> {new.ggml_type.name}")
    if old.path != new.path:
        parts.append("file")
    elif old.identity != new.identity:
        parts.append("file rewritten")
    if old.offset != new.offset:
        parts.append("offset")
    return ", ".join(parts) or "content"


def reconcile(
    desired: Mapping[str, TensorRecord],
    actual: Mapping[str, TensorEntry],
    *,
    model: str,
    base_version: int,
    verify: VerifyMode,
    fingerprint: Callable[[TensorRecord], str],
    refused: Mapping[str, tuple[TensorRecord, str]] | None = None,
    plan_unloaded: bool = False,
    suspect: frozenset[str] = frozenset(),
) -> Reconciliation:
    """The plan that takes ``actual`` to ``desired`` (see the module docstring for the rules).

    ``plan_unloaded`` plans tensors the runtime does not report (a dry run against an empty
    state); the daemon leaves it off, since a runtime refuses tensors it has not loaded.
    ``suspect`` names tensors whose bytes the scrub found changed under an unchanged file
    identity: they are compared by fingerprint even though their records are equal.
    """
    refused = refused or {}
    jobs: list[tuple[tuple[int, int, str], Job]] = []
    blocked: list[Reason] = []
    not_loaded: list[str] = []
    why: dict[str, str] = {}
    unchanged = 0
    checksum = verify is VerifyMode.CHECKSUM
    for name in sorted(desired):
        record = desired[name]
        entry = actual.get(name)
        prior = refused.get(name)
        if prior is not None and prior[0] == record:
            blocked.append(Reason(name, f"refused by the runtime: {prior[1]}"))
            continue
        if entry is None and not plan_unloaded:
            not_loaded.append(name)
            continue
        before = len(blocked)
        change = _reload(
            record,
            entry,
            checksum=checksum,
            suspect=name in suspect,
            fingerprint=fingerprint,
            blocked=blocked,
        )
        if change is not None:
            jobs.append(change[:2])
            why[name] = change[2]
        elif len(blocked) == before:
            unchanged += 1
    ordered = tuple(job for _key, job in sorted(jobs, key=lambda kj: kj[0]))
    plan = (
        Plan(plan_id=plan_id_for(model, base_version, ordered), model=model, jobs=ordered)
        if ordered
        else None
    )
    return Reconciliation(
        plan=plan,
        blocked=tuple(blocked),
        not_loaded=tuple(not_loaded),
        unchanged=unchanged,
        why=why,
    )


def _reload(
    record: TensorRecord,
    entry: TensorEntry | None,
    *,
    checksum: bool,
    suspect: bool,
    fingerprint: Callable[[TensorRecord], str],
    blocked: list[Reason],
) -> tuple[tuple[int, int, str], Job, str] | None:
    """The job that loads ``record`` over the runtime's ``entry`` (None: not loaded), with its
    order key (see the module docstring) and why; or None: the same content (unchanged), or a
    change that cannot be made (a reason added to ``blocked``)."""
    name = record.name
    if entry is None:
        fp = _fingerprint_or_none(record, fingerprint, blocked) if checksum else None
        if checksum and fp is None:
            return None
        return (1, record.nbytes, name), Job(record, fp), "not loaded"
    old = entry.record
    if old.shape != record.shape:
        blocked.append(
            Reason(
                name,
                f"logical shape {list(old.shape)} -> {list(record.shape)} in {record.path}: "
                "the runtime cannot change a shape live; restart it to load this file",
            )
        )
        return None
    lost = entry.fingerprint == LOST_FINGERPRINT  # out of service: reloaded whatever
    if _same_version(old, record) and not (checksum and suspect) and not lost:
        return None
    fp = None
    if checksum:
        fp = _fingerprint_or_none(record, fingerprint, blocked)
        if fp is None:
            return None
        if fp == entry.fingerprint and record.ggml_type == old.ggml_type:
            return None  # same bytes, moved or rewritten: nothing to load
    detached = entry.slot is not SlotState.ON_ORIGINAL
    key = (0 if detached else 1, record.nbytes - old.nbytes, name)
    return key, Job(record, fp), _differences(old, record)


def _fingerprint_or_none(
    record: TensorRecord, fingerprint: Callable[[TensorRecord], str], blocked: list[Reason]
) -> str | None:
    try:
        return fingerprint(record)
    except (ShardError, OSError) as exc:
        blocked.append(Reason(record.name, f"cannot hash (file changed?): {exc}"))
        return None
