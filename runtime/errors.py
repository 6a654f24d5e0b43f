"""Errors raised by the inference-side runtime: every one is a :class:`RuntimeLibraryError`.

Why a tensor of a plan cannot be applied is a :class:`~ggufswap.ipc.Reason`, the record the wire
carries (re-exported here and as ``ggufswap.runtime.Reason``).
"""

from __future__ import annotations

from ggufswap.ipc.bodies import Reason


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
    """A pool cannot hold an allocation: its budget, or the device's allocator refused it
    (``device_error``: CUDA out of memory, or any allocator error)."""

    def __init__(self, pool: str, nbytes: int, free: int, *, device_error: str | None = None):
        self.pool = pool
        self.nbytes = nbytes
        self.free = free
        self.device_error = device_error
        if device_error is None:
            message = f"pool {pool!r}: {nbytes} bytes requested, {free} free"
        else:
            first_line = device_error.strip().splitlines()[0] if device_error.strip() else "?"
            message = f"pool {pool!r}: the device could not allocate {nbytes} bytes ({first_line})"
        super().__init__(message)


class NoPoolFits(PoolFull):
    """Every pool a tensor (or its family) may go to, the fallback last, refused it; ``failures``
    holds each pool's refusal in the order they were tried."""

    def __init__(self, failures: list[PoolFull]) -> None:
        assert failures, "NoPoolFits needs the refusals of the pools that were tried"
        last = failures[-1]
        super().__init__(last.pool, last.nbytes, last.free, device_error=last.device_error)
        self.failures = tuple(failures)
        self.args = ("; then ".join(str(f) for f in failures),)

    def __str__(self) -> str:
        return str(self.args[0])


class StagingFailed(RuntimeLibraryError):
    """Staging a plan stopped at one tensor; ``reason`` says which and why."""

    def __init__(self, reason: Reason) -> None:
        self.reason = reason
        super().__init__(str(reason))


class StaleJob(StagingFailed):
    """A job's file or content changed under the plan: re-planning will fix it."""


class Unplaceable(StagingFailed):
    """A tensor (or its family) fits no pool, or its new bytes cannot be decoded."""


class RankLost(RuntimeLibraryError, RuntimeError):
    """A collective of a coordinated group failed: a rank is gone (``lost``: one line per rank
    that did not answer the roll call, ``runtime/rank_loss.py``). The group cannot agree on any
    plan again; every rank must stop, as a sharded model's ranks do when one dies."""

    def __init__(self, message: str, lost: tuple[str, ...]) -> None:
        self.lost = lost
        super().__init__(message)


class MapRefused(RuntimeLibraryError, RuntimeError):
    """``map_shards: true`` and a shard that cannot be served from a mapping (names the file)."""


class PlacementError(RuntimeLibraryError, ValueError):
    """A placement the runtime cannot honour (an override naming no pool), found at load."""


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


class GgmlLibraryError(RuntimeLibraryError, RuntimeError):
    """The libggml asked for cannot be this process's: its package is not installed, or another
    libggml already multiplies here (one a process, chosen before the first product)."""


class SlotStateError(RuntimeLibraryError, RuntimeError):
    """A commit would put a slot in a state its buffers do not match: a bug, never an input
    problem. Raised before the commit changes anything."""


__all__ = [
    "GgmlLibraryError",
    "MapRefused",
    "NoPoolFits",
    "PlacementError",
    "PlanRejected",
    "PlanStateError",
    "PoolFull",
    "RankLost",
    "Reason",
    "RuntimeLibraryError",
    "SlotStateError",
    "StagingFailed",
    "StaleJob",
    "Unplaceable",
    "UnsupportedTypeError",
    "WeightsLost",
]
