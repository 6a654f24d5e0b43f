"""Errors raised by the inference-side runtime."""

from __future__ import annotations

from dataclasses import dataclass


class RuntimeLibraryError(Exception):
    """Base class of every error the runtime raises."""


class UnsupportedTypeError(RuntimeLibraryError, TypeError):
    """A GGML type has no torch kernel and strict mode forbids the CPU fallback."""


@dataclass(frozen=True, slots=True)
class Reason:
    """Why one tensor of a plan cannot be applied."""

    tensor: str
    reason: str
    stale: bool = False  # the file changed under the plan: re-planning will fix it

    def __str__(self) -> str:
        return f"{self.tensor}: {self.reason}"


class PlanRejected(RuntimeLibraryError):
    """A plan was refused as a whole; ``reasons`` lists every tensor that failed and why."""

    def __init__(self, plan_id: str, reasons: list[Reason], *, stale: bool = False):
        self.plan_id = plan_id
        self.reasons = tuple(reasons)
        self.stale = stale
        kind = "stale" if stale else "rejected"
        lines = "\n  ".join(str(r) for r in self.reasons)
        super().__init__(f"plan {plan_id} {kind}:\n  {lines}")
