"""Errors raised by the inference-side runtime: every one is a :class:`RuntimeLibraryError`.

Why a tensor of a plan cannot be applied is a :class:`~ggufswap.ipc.Reason`, the record the wire
carries (re-exported here and as ``ggufswap.runtime.Reason``).
"""

from __future__ import annotations

from ggufswap.ipc.messages import Reason


class RuntimeLibraryError(Exception):
    """Base class of every error the runtime raises."""


class UnsupportedTypeError(RuntimeLibraryError, TypeError):
    """A GGML type has no torch kernel and strict mode forbids the CPU fallback."""


class PlanRejected(RuntimeLibraryError):
    """A plan was refused as a whole; ``reasons`` lists every tensor that failed and why."""

    def __init__(self, plan_id: str, reasons: list[Reason], *, stale: bool = False):
        self.plan_id = plan_id
        self.reasons = tuple(reasons)
        self.stale = stale
        kind = "stale" if stale else "rejected"
        lines = "\n  ".join(str(r) for r in self.reasons)
        super().__init__(f"plan {plan_id} {kind}:\n  {lines}")


class PoolFull(RuntimeLibraryError):
    """A pool cannot hold an allocation (budget, or the device itself is out of memory)."""

    def __init__(self, pool: str, nbytes: int, free: int) -> None:
        self.pool = pool
        self.nbytes = nbytes
        self.free = free
        super().__init__(f"pool {pool!r}: {nbytes} bytes requested, {free} free")


class StagingFailed(RuntimeLibraryError):
    """Staging a plan stopped at one tensor; ``reason`` says which and why."""

    def __init__(self, reason: Reason) -> None:
        self.reason = reason
        super().__init__(str(reason))


class StaleJob(StagingFailed):
    """A job's file or content changed under the plan: re-planning will fix it."""


class Unplaceable(StagingFailed):
    """A tensor (or its family) fits no pool, or its new bytes cannot be decoded."""


class PlanStateError(RuntimeLibraryError, RuntimeError):
    """An illegal plan lifecycle transition: a bug in the runtime, never an input problem."""


class WeightsLost(RuntimeLibraryError):
    """Served tensors whose bytes a writer changed outside any commit (a mapped shard file
    truncated, or written after the kernel broke its lease): no batch runs until a commit
    restores them. ``lost`` maps each tensor to why."""

    def __init__(self, lost: dict[str, str]) -> None:
        self.lost = dict(lost)
        names = sorted(self.lost)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        why = sorted(set(self.lost.values()))
        super().__init__(
            f"{len(names)} tensor(s) out of service, their bytes changed outside any commit "
            f"({shown}): {'; '.join(why[:3])}. Batches are refused until a commit restores "
            "them: the runtime reports their fingerprint as 'lost', so the agent re-plans them "
            "from the files"
        )


class SlotStateError(RuntimeLibraryError, RuntimeError):
    """A commit would put a slot in a state its buffers do not match: a bug, never an input
    problem. Raised before the commit changes anything."""


__all__ = [
    "PlanRejected",
    "PlanStateError",
    "PoolFull",
    "Reason",
    "RuntimeLibraryError",
    "SlotStateError",
    "StagingFailed",
    "StaleJob",
    "Unplaceable",
    "UnsupportedTypeError",
    "WeightsLost",
]
