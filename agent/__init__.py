"""ggufswap.agent: the sidecar that watches GGUF shard directories and keeps runtimes in sync.

Data flow: watcher backends report changed paths into a :class:`ChangeQueue`; the
:class:`AgentDaemon`'s main loop lets them settle (:class:`Debouncer`) and re-scans the
:class:`ModelIndex`; each :class:`RuntimeLink` reconciles the scan against its runtime's state
(:func:`reconcile`) and sends at most one :class:`~ggufswap.ipc.Plan` at a time. The agent never
imports torch.
"""

from __future__ import annotations

from ggufswap.agent.daemon import AgentDaemon, DaemonState
from ggufswap.agent.debounce import Debouncer
from ggufswap.agent.errors import (
    AgentError,
    BackendUnavailable,
    LinkStateError,
    WatchError,
    WatchLimitError,
)
from ggufswap.agent.index import Health, ModelIndex, ModelSnapshot, ShardStatus, WatchRoot
from ggufswap.agent.ledger import Outcome, PlanRecord
from ggufswap.agent.link import RuntimeLink
from ggufswap.agent.link_state import LinkState
from ggufswap.agent.reconcile import Reconciliation, plan_id_for, reconcile
from ggufswap.agent.status import status_handler, status_line
from ggufswap.agent.watch import (
    BackendChoice,
    ChangeQueue,
    RescanReason,
    Watcher,
    backend_available,
    choose_backend,
    make_watcher,
)

__all__ = [
    "AgentDaemon",
    "AgentError",
    "BackendChoice",
    "BackendUnavailable",
    "ChangeQueue",
    "DaemonState",
    "Debouncer",
    "Health",
    "LinkState",
    "LinkStateError",
    "ModelIndex",
    "ModelSnapshot",
    "Outcome",
    "PlanRecord",
    "Reconciliation",
    "RescanReason",
    "RuntimeLink",
    "ShardStatus",
    "WatchError",
    "WatchLimitError",
    "WatchRoot",
    "Watcher",
    "backend_available",
    "choose_backend",
    "make_watcher",
    "plan_id_for",
    "reconcile",
    "status_handler",
    "status_line",
]
