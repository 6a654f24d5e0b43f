"""ggufswap.runtime: the hot-swap core — tensor store, pools, staged atomic commits.

``SlotState`` and ``Reason`` are the wire contract's (:mod:`ggufswap.ipc`), ``Storage`` the
configuration's (:mod:`ggufswap.config`): one type per idea across the packages. The
architectures live in :mod:`ggufswap.runtime.models` and the reference server in
:mod:`ggufswap.runtime.serving`; this package imports neither. Importing it imports torch; the
agent never does.
"""

from __future__ import annotations

from ggufswap.config import Storage
from ggufswap.ipc import Reason, SlotState
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.errors import (
    PlanRejected,
    PoolFull,
    RuntimeLibraryError,
    UnsupportedTypeError,
    WeightsLost,
)
from ggufswap.runtime.families import DerivedTensor, family_of, group_families
from ggufswap.runtime.kernels import KERNEL_TYPES, QuantizedMatrix, dequantize, has_kernel
from ggufswap.runtime.plans import PlanState, PlanTicket
from ggufswap.runtime.pools import Buffer, Pool, PoolSet
from ggufswap.runtime.store import Placement, Slot, TensorStore

__all__ = [
    "KERNEL_TYPES",
    "Buffer",
    "DerivedTensor",
    "HotSwapRuntime",
    "Placement",
    "PlanRejected",
    "PlanState",
    "PlanTicket",
    "Pool",
    "PoolFull",
    "PoolSet",
    "QuantizedMatrix",
    "Reason",
    "RuntimeLibraryError",
    "Slot",
    "SlotState",
    "Storage",
    "TensorStore",
    "UnsupportedTypeError",
    "WeightsLost",
    "dequantize",
    "family_of",
    "group_families",
    "has_kernel",
]
