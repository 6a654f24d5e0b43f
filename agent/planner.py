"""What a link plans next: the model's desired state against its runtime's, less what was refused.

A :class:`~ggufswap.agent.link.RuntimeLink` talks to its runtime; this is what it asks when it
is idle. The planner holds the latest scan (the desired state), the tensors the runtime refused
(not planned again until their file changes), the tensors the scrub found changed under an
equal file identity (compared by fingerprint until a plan has them desired), and what the last
reconciliation blocked. :meth:`Planner.next_plan` runs :func:`~ggufswap.agent.reconcile.reconcile`
once per new pair (desired generation, runtime weight version): a scan that found nothing new
against a state that did not move plans nothing, at no cost.

Thread safety: the link thread plans and records refusals; the daemon's thread hands over
scans and the scrub's thread reports changed content; ``status`` may run anywhere. One lock
guards what they share.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

from ggufswap.agent._actual import ActualState
from ggufswap.agent.index import ModelSnapshot
from ggufswap.agent.reconcile import reconcile
from ggufswap.config import ModelConfig
from ggufswap.ipc import Plan, Reason
from ggufswap.shards import Fingerprinter, TensorRecord

REJECT_ALL: Final = "*"  # a reason's tensor when the plan as a whole was refused


class Planner:
    """The next plan for one link's runtime, from the desired state and what it refused."""

    def __init__(self, model: ModelConfig, fingerprinter: Fingerprinter, *, log: Any) -> None:
        self.model = model
        self.fingerprinter = fingerprinter
        self.log = log
        self._lock = threading.Lock()
        self._desired: ModelSnapshot | None = None
        self._last_key: tuple[int, int] | None = None  # (generation, weight version) planned
        self._reconciled_generation = 0
        self._refused: dict[str, tuple[TensorRecord, str]] = {}
        self._blocked: tuple[Reason, ...] = ()
        self._not_loaded = 0
        self._suspect: set[str] = set()  # bytes changed under an equal identity (the scrub)

    # -- inputs ------------------------------------------------------------------------------

    def set_desired(self, snapshot: ModelSnapshot) -> None:
        """The latest scan; with suspects, planned again even if it found nothing new."""
        with self._lock:
            self._desired = snapshot
            if self._suspect:
                self._last_key = None

    def desired(self) -> Mapping[str, TensorRecord]:
        """The desired tensors of the latest scan (none before the first)."""
        with self._lock:
            return self._desired.desired if self._desired is not None else {}

    def content_changed(self, record: TensorRecord) -> None:
        """``record``'s bytes changed under the same file identity (the scrub): forget its
        fingerprint and compare it by fingerprint in the next plans until one has it desired."""
        self.fingerprinter.forget(record)
        with self._lock:
            self._suspect.add(record.name)

    def reconsider(self) -> None:
        """Plan at the next call even if neither the scan nor the runtime's version moved (a
        fresh actual state, a refusal)."""
        with self._lock:
            self._last_key = None

    def refuse_plan(self, plan: Plan, reasons: Iterable[Reason]) -> None:
        """The runtime rejected ``plan`` (not stale): each tensor a reason names is refused with
        its reason; a reason for the whole plan (``*``), or none naming a tensor of the plan,
        refuses every job (with the reasons joined, where a job has no reason of its own)."""
        reasons = tuple(reasons)
        jobs = {job.name: job for job in plan.jobs}
        named = {r.tensor for r in reasons if r.tensor in jobs}
        refuse_all = not named or any(r.tensor == REJECT_ALL for r in reasons)
        with self._lock:
            for r in reasons:
                if r.tensor in jobs:
                    self._refused[r.tensor] = (jobs[r.tensor].source, r.reason)
            if refuse_all:
                text = "; ".join(str(r) for r in reasons) or "rejected without reasons"
                for name, job in jobs.items():
                    self._refused.setdefault(name, (job.source, text))

    def refuse_all(self, plan: Plan, why: str) -> None:
        """Every job of ``plan`` is refused for ``why`` (an error reply to the plan)."""
        with self._lock:
            for job in plan.jobs:
                self._refused[job.name] = (job.source, why)

    # -- the plan ----------------------------------------------------------------------------

    def next_plan(self, actual: ActualState) -> Plan | None:
        """The plan that brings the runtime (its state held in ``actual``) to the desired
        state, or None: nothing desired or known yet, nothing new since the last call, or
        nothing to change."""
        with self._lock:
            desired, state = self._desired, actual.state
            if desired is None or state is None:
                return None
            key = (desired.generation, state.weight_version)
            if key == self._last_key:
                return None
            self._last_key = key
            self._reconciled_generation = desired.generation
            suspect = frozenset(self._suspect)
            # Compared by fingerprint now (planned, or found equal); a held one stays suspect.
            self._suspect -= set(desired.desired)
            refused = dict(self._refused)
        result = reconcile(
            desired.desired,
            actual.by_name,
            model=self.model.name,
            base_version=state.weight_version,
            verify=self.model.verify,
            fingerprint=self.fingerprinter,
            refused=refused,
            suspect=suspect,
        )
        with self._lock:
            self._blocked = result.blocked
            self._not_loaded = len(result.not_loaded)
        if result.blocked:
            self.log.warning(
                "plan.blocked",
                count=len(result.blocked),
                first=[f"{b.tensor}: {b.reason}" for b in result.blocked[:5]],
            )
        if result.plan is None:
            self.log.debug("link.in_sync", generation=desired.generation)
        return result.plan

    def status(self) -> dict[str, Any]:
        """The planner's part of the link's status."""
        with self._lock:
            return {
                "reconciled_generation": self._reconciled_generation,
                "blocked": [{"tensor": b.tensor, "reason": b.reason} for b in self._blocked[:50]],
                "blocked_count": len(self._blocked),
                "not_loaded_count": self._not_loaded,
                "refused": sorted(self._refused),
            }
