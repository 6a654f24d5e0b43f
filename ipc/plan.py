"""Reload plans: the unit of work the agent sends and the runtime applies atomically, and how
they travel: tensor records, jobs and plans as plain maps (``docs/protocol.md``) and back."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ggufswap.ipc import _check as c
from ggufswap.ipc.errors import MalformedMessage
from ggufswap.ipc.messages import MAX_ID_LENGTH, Fields
from ggufswap.shards.ggml_types import ggml_type as _ggml_type
from ggufswap.shards.records import FileIdentity, TensorRecord

GGML_MAX_DIMS = 4
# Bounds on what a plan may carry, checked while it is read (before any file-system call): a
# plan id as long as a message id, tensor and model names far over GGML_MAX_NAME, and more jobs
# than any model has tensors. Paths are bounded by ``_check.MAX_PATH_BYTES`` and
# ``MAX_PATH_COMPONENTS``.
MAX_PLAN_ID_LENGTH = MAX_ID_LENGTH
MAX_NAME_LENGTH = 256
MAX_FINGERPRINT_LENGTH = 128
MAX_PLAN_JOBS = 65536


@dataclass(frozen=True, slots=True)
class Job:
    """Load one tensor from ``source``; ``fingerprint`` (xxh3-128 hex of the data) when known."""

    source: TensorRecord
    fingerprint: str | None = None

    @property
    def name(self) -> str:
        return self.source.name


def _by_name(job: Job) -> str:
    return job.name


@dataclass(frozen=True, slots=True)
class Plan:
    """All jobs of a plan are committed together or not at all.

    ``plan_id`` is derived from the content (see the agent's reconciler), so re-sending the same
    plan is recognised as the same plan; the runtime applies a plan idempotently anyway.
    """

    plan_id: str
    model: str
    jobs: tuple[Job, ...]

    def names(self) -> tuple[str, ...]:
        return tuple(job.name for job in self.jobs)

    def same_as(self, other: Plan) -> bool:
        """Whether ``other`` is this plan sent again: the same model and jobs, in any order (a
        plan id names one plan's content)."""
        return self.model == other.model and sorted(self.jobs, key=_by_name) == sorted(
            other.jobs, key=_by_name
        )


# --------------------------------------------------------------------------- wire


def record_to_wire(record: TensorRecord) -> dict[str, Any]:
    """A ``TensorRecord`` as a plain map (``name`` included)."""
    return {Fields.Tensor.NAME: record.name, **record_fields(record)}


def record_fields(record: TensorRecord) -> dict[str, Any]:
    """The wire fields of a record but its name (a state entry is keyed by the name)."""
    t = Fields.Tensor
    return {
        t.PATH: record.path,
        t.OFFSET: record.offset,
        t.NBYTES: record.nbytes,
        t.TYPE: int(record.ggml_type),
        t.NE: list(record.ne),
        t.IDENTITY: list(record.identity.as_tuple()),
    }


def _identity_from_wire(value: object, where: str) -> FileIdentity:
    items = c.as_list(value, where)
    if len(items) != 5:
        raise MalformedMessage(
            f"field {where!r}: expected [dev, ino, size, mtime_ns, ctime_ns], "
            f"found {len(items)} items"
        )
    dev, ino, size = (
        c.as_int(v, c.field_path(where, i), minimum=0) for i, v in enumerate(items[:3])
    )
    mtime_ns, ctime_ns = (c.as_int(v, c.field_path(where, 3 + i)) for i, v in enumerate(items[3:]))
    return FileIdentity(dev, ino, size, mtime_ns, ctime_ns)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def record_fast(m: Any, name: object) -> TensorRecord | None:
    """The record of a well-formed map, read without building any error text; else None.

    None sends the caller to the strict reader, which names what is wrong. This accepts only
    what the strict reader accepts (exactly ``int``, ``str`` and ``list``, as msgpack decodes
    them), at a few microseconds a record: a state of thousands of tensors reads in milliseconds.
    """
    if type(m) is not dict or type(name) is not str or not 0 < len(name) <= MAX_NAME_LENGTH:
        return None
    t = Fields.Tensor
    path: Any = m.get(t.PATH)
    offset: Any = m.get(t.OFFSET)
    nbytes: Any = m.get(t.NBYTES)
    code: Any = m.get(t.TYPE)
    ne: Any = m.get(t.NE)
    ident: Any = m.get(t.IDENTITY)
    path_ok = type(path) is str and bool(path) and "\x00" not in path and c.path_within_bounds(path)
    ne_ok = type(ne) is list and 0 < len(ne) <= GGML_MAX_DIMS and all(map(_is_count, ne))
    ident_ok = type(ident) is list and len(ident) == 5 and all(type(v) is int for v in ident)
    ggml_type = _ggml_type(code) if type(code) is int else None
    if not (path_ok and ne_ok and ident_ok and _is_count(offset) and _is_count(nbytes)):
        return None
    if ggml_type is None or min(ident[:3]) < 0:
        return None
    return TensorRecord(name, ggml_type, tuple(ne), offset, nbytes, path, FileIdentity(*ident))


def record_from_wire(d: object, *, where: str = "record", name: str | None = None) -> TensorRecord:
    """The inverse of ``record_to_wire``; ``name`` overrides a missing ``name`` key (state maps)."""
    key = d.get(Fields.Tensor.NAME) if name is None and isinstance(d, dict) else name
    fast = record_fast(d, key)
    return fast if fast is not None else _record_strict(d, where=where, name=name)


def _record_strict(d: object, *, where: str, name: str | None) -> TensorRecord:
    t = Fields.Tensor
    m = c.require_map(d, where)
    if name is None:
        name = c.get(m, t.NAME, where)
    name = c.as_bounded_str(name, c.field_path(where, t.NAME), limit=MAX_NAME_LENGTH, nonempty=True)
    code = c.as_int(c.get(m, t.TYPE, where), c.field_path(where, t.TYPE), minimum=0)
    ggml_type = _ggml_type(code)
    if ggml_type is None:
        raise MalformedMessage(
            f"field {c.field_path(where, t.TYPE)!r}: unknown ggml type code {code} "
            f"(tensor {name!r})"
        )
    ne_where = c.field_path(where, t.NE)
    ne_items = c.as_list(c.get(m, t.NE, where), ne_where)
    if not 1 <= len(ne_items) <= GGML_MAX_DIMS:
        raise MalformedMessage(
            f"field {ne_where!r}: expected 1 to {GGML_MAX_DIMS} dimensions, found {len(ne_items)}"
        )
    ne = tuple(c.as_int(v, c.field_path(ne_where, i), minimum=0) for i, v in enumerate(ne_items))
    return TensorRecord(
        name=name,
        ggml_type=ggml_type,
        ne=ne,
        offset=c.as_int(c.get(m, t.OFFSET, where), c.field_path(where, t.OFFSET), minimum=0),
        nbytes=c.as_int(c.get(m, t.NBYTES, where), c.field_path(where, t.NBYTES), minimum=0),
        path=c.as_path(c.get(m, t.PATH, where), c.field_path(where, t.PATH)),
        identity=_identity_from_wire(c.get(m, t.IDENTITY, where), c.field_path(where, t.IDENTITY)),
    )


def fingerprint_from_wire(m: Mapping[str, Any], where: str) -> str | None:
    key = Fields.Tensor.FINGERPRINT
    value = c.get(m, key, where)
    if value is None:
        return None
    return c.as_bounded_str(value, c.field_path(where, key), limit=MAX_FINGERPRINT_LENGTH)


def job_to_wire(job: Job) -> dict[str, Any]:
    """A plan job: the record's fields plus ``fingerprint`` (nil when unknown)."""
    return {**record_to_wire(job.source), Fields.Tensor.FINGERPRINT: job.fingerprint}


def job_from_wire(d: object, *, where: str = "job") -> Job:
    record = record_from_wire(d, where=where)
    return Job(source=record, fingerprint=fingerprint_from_wire(c.require_map(d, where), where))


def plan_to_wire(plan: Plan) -> dict[str, Any]:
    """The body of a ``plan`` message (no envelope): ``make_message(PLAN, **plan_to_wire(p))``."""
    return {
        Fields.PLAN_ID: plan.plan_id,
        Fields.MODEL: plan.model,
        Fields.JOBS: [job_to_wire(job) for job in plan.jobs],
    }


def plan_from_wire(d: object) -> Plan:
    """A ``Plan`` from a ``plan`` message or body; job names must be unique."""
    m = c.require_map(d, "plan")
    plan_id = c.as_bounded_str(
        c.get(m, Fields.PLAN_ID, ""), Fields.PLAN_ID, limit=MAX_PLAN_ID_LENGTH, nonempty=True
    )
    model = c.as_bounded_str(c.get(m, Fields.MODEL, ""), Fields.MODEL, limit=MAX_NAME_LENGTH)
    jobs_raw = c.as_list(c.get(m, Fields.JOBS, ""), Fields.JOBS)
    if len(jobs_raw) > MAX_PLAN_JOBS:
        raise MalformedMessage(
            f"field 'jobs': at most {MAX_PLAN_JOBS} jobs per plan, found {len(jobs_raw)}"
        )
    jobs = tuple(
        job_from_wire(j, where=c.field_path(Fields.JOBS, i)) for i, j in enumerate(jobs_raw)
    )
    counts = Counter(job.name for job in jobs)
    duplicates = sorted(name for name, n in counts.items() if n > 1)
    if duplicates:
        raise MalformedMessage(f"field 'jobs': duplicate tensor names {duplicates}")
    return Plan(plan_id=plan_id, model=model, jobs=jobs)
