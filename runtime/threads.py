"""The runtime's CPU thread policy: how many threads torch's CPU operators use, and why.

torch sizes its intra-op pool from the machine's cores, whatever share of them the process may
actually use. An OpenMP team waits at the end of every operator for its slowest thread, so a team
larger than the CPUs the process gets (a cgroup or ``taskset`` limit, or cores busy with other
processes) stalls on every operator for as long as the scheduler keeps one of its threads off a
CPU: on a busy 2-core host, dequantization ran 4-10x slower with torch's default than with one
thread. The policy therefore counts the CPUs of the process's affinity mask
(``os.sched_getaffinity``, which ``taskset``, ``numactl`` and systemd's ``CPUAffinity=`` set),
and an operator who shares those CPUs with other busy work sets the count explicitly
(``--threads``, ``runtime.threads``, or ``OMP_NUM_THREADS`` as for any OpenMP program).
``docs/operations.md`` describes the policy for operators.

``resolve_threads`` decides (the flag beats the configuration, which beats the environment, which
beats the affinity: the more specific to this process, the stronger) and ``apply_thread_policy``
applies the decision once, at process start, before the model loads.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ggufswap.config import AUTO_THREADS, MAX_THREADS
from ggufswap.logs import get_logger

__all__ = [
    "AppliedThreads",
    "ThreadPolicy",
    "ThreadSource",
    "apply_thread_policy",
    "available_cpus",
    "resolve_threads",
]

log = get_logger(__name__)


class ThreadSource(str, enum.Enum):
    """Where the thread count of a ``ThreadPolicy`` came from."""

    FLAG = "--threads"
    CONFIG = "runtime.threads"
    ENVIRONMENT = "OMP_NUM_THREADS"
    AFFINITY = "cpu affinity"  # the CPUs this process may run on
    CPU_COUNT = "cpu count"  # no affinity API on this platform: every CPU of the machine


@dataclass(frozen=True, slots=True)
class ThreadPolicy:
    """A decided thread count, with the CPUs it was decided against and the reason."""

    threads: int
    source: ThreadSource
    cpus: int  # CPUs this process may run on (its affinity mask, else the machine's count)

    def __post_init__(self) -> None:
        assert 1 <= self.threads <= MAX_THREADS, f"thread count {self.threads} out of range"

    @property
    def oversubscribed(self) -> bool:
        """More threads than CPUs: every operator waits for threads the scheduler parks."""
        return self.threads > self.cpus

    @property
    def reason(self) -> str:
        """One sentence for the log: what decided the count."""
        if self.source is ThreadSource.AFFINITY:
            return f"{AUTO_THREADS}: one thread per CPU in the process's affinity mask"
        if self.source is ThreadSource.CPU_COUNT:
            return f"{AUTO_THREADS}: no CPU affinity on this platform, one thread per CPU"
        why = f"set by {self.source.value}"
        if self.oversubscribed:
            why += f", more than the {self.cpus} CPU(s) this process may use"
        return why


@dataclass(frozen=True, slots=True)
class AppliedThreads:
    """What ``apply_thread_policy`` set: torch's intra- and inter-op thread counts after it."""

    policy: ThreadPolicy
    intra_op: int
    inter_op: int
    inter_op_set: bool  # False when torch's inter-op pool had already started


def available_cpus() -> tuple[int, ThreadSource]:
    """How many CPUs this process may run on, and whether its affinity mask said so."""
    try:
        return len(os.sched_getaffinity(0)), ThreadSource.AFFINITY
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1, ThreadSource.CPU_COUNT


def resolve_threads(
    *,
    flag: int | None = None,
    config: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ThreadPolicy:
    """The thread count to run with: ``flag`` (``--threads``), else ``config``
    (``runtime.threads``), else ``OMP_NUM_THREADS`` of ``environ`` (default ``os.environ``), else
    one per CPU of the affinity mask. ``None`` means ``auto``; an ``OMP_NUM_THREADS`` that is not
    a count (OpenMP ignores it too) is passed over.

    Raises ``ValueError`` for an explicit count outside ``1..MAX_THREADS`` (or not an integer).
    """
    problems = [
        f"{source.value}: expected an integer between 1 and {MAX_THREADS} "
        f"(or None for {AUTO_THREADS}), found {value!r}"
        for source, value in ((ThreadSource.FLAG, flag), (ThreadSource.CONFIG, config))
        if value is not None
        and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS)
    ]
    if problems:
        raise ValueError("; ".join(problems))
    cpus, cpu_source = available_cpus()
    if flag is not None:
        return ThreadPolicy(threads=flag, source=ThreadSource.FLAG, cpus=cpus)
    if config is not None:
        return ThreadPolicy(threads=config, source=ThreadSource.CONFIG, cpus=cpus)
    from_env = _omp_num_threads(os.environ if environ is None else environ)
    if from_env is not None:
        return ThreadPolicy(threads=from_env, source=ThreadSource.ENVIRONMENT, cpus=cpus)
    return ThreadPolicy(threads=min(cpus, MAX_THREADS), source=cpu_source, cpus=cpus)


def _omp_num_threads(environ: Mapping[str, str]) -> int | None:
    """The outermost level of ``OMP_NUM_THREADS`` (``"4"``, or ``"4,2"`` for nested teams)."""
    first = environ.get(ThreadSource.ENVIRONMENT.value, "").split(",", 1)[0].strip()
    if not first.isascii() or not first.isdigit() or len(first) > len(str(MAX_THREADS)):
        return None
    count = int(first)
    return count if 1 <= count <= MAX_THREADS else None


def apply_thread_policy(policy: ThreadPolicy) -> AppliedThreads:
    """Set torch's thread counts from ``policy`` and log what was chosen and why.

    Call it once, at process start, before any torch work: the intra-op count applies to every
    thread from their next operator on; the inter-op count can be set only before torch's
    inter-op pool starts, and is left as it is (and said so in the log) when it has.
    """
    torch.set_num_threads(policy.threads)
    inter_op_set = True
    if torch.get_num_interop_threads() != policy.threads:
        try:
            torch.set_num_interop_threads(policy.threads)
        except RuntimeError:  # the pool has started (or was set before): torch refuses
            inter_op_set = False
    applied = AppliedThreads(
        policy=policy,
        intra_op=torch.get_num_threads(),
        inter_op=torch.get_num_interop_threads(),
        inter_op_set=inter_op_set,
    )
    log_method = log.warning if policy.oversubscribed else log.info
    log_method(
        "runtime.threads",
        threads=applied.intra_op,
        interop_threads=applied.inter_op,
        interop_set=inter_op_set,
        source=policy.source.value,
        cpus=policy.cpus,
        reason=policy.reason,
    )
    return applied
