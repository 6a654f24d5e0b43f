"""Reload plans: the unit of work the agent sends and the runtime applies atomically."""

from __future__ import annotations

from dataclasses import dataclass

from ggufswap.shards.records import TensorRecord


@dataclass(frozen=True, slots=True)
class Job:
    """Load one tensor from ``source``; ``fingerprint`` (xxh3-128 hex of the data) when known."""

    source: TensorRecord
    fingerprint: str | None = None

    @property
    def name(self) -> str:
        return self.source.name


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
