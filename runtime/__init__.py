"""ggufswap.runtime: the hot-swap core — tensor store, pools, staged atomic commits.

``SlotState`` and ``Reason`` are the wire contract's (:mod:`ggufswap.ipc`), ``Storage`` the
configuration's (:mod:`ggufswap.config`): one type per idea across the packages. The
architectures live in :mod:`ggufswap.runtime.models` and the reference server in
:mod:`ggufswap.runtime.serving`; this package imports neither. Its names are imported on
first use (PEP 562), so that ``ggufswap.runtime.serving``'s HTTP server can listen before torch
is imported (a start that answers ``/health`` at once); using any of them imports torch. The
agent never does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ggufswap.config import Storage
    from ggufswap.ipc import Reason, SlotState
    from ggufswap.runtime.engine import HotSwapRuntime
    from ggufswap.runtime.errors import (
        MapRefused,
        PlanRejected,
        PoolFull,
        RuntimeLibraryError,
        UnsupportedTypeError,
        WeightsLost,
    )
    from ggufswap.runtime.families import DerivedTensor, family_of, group_families
    from ggufswap.runtime.kernels import (
        KERNEL_TYPES,
        QuantizedExperts,
        QuantizedMatrix,
        dequantize,
        float_products,
        ggml_attn_front,
        ggml_flash_attn,
        ggml_front_args,
        ggml_geglu_layer,
        ggml_geglu_tail,
        ggml_moe_ffn,
        ggml_moe_layer,
        grouped,
        has_kernel,
        linear_all,
        routed_all,
        rows_rms_norm,
        rows_rope,
    )
    from ggufswap.runtime.placement import Placement
    from ggufswap.runtime.plans import PlanState, PlanTicket
    from ggufswap.runtime.pools import Buffer, Pool, PoolSet
    from ggufswap.runtime.store import Slot, TensorStore

_HOMES: dict[str, str] = {  # name -> the module that defines it
    "Storage": "ggufswap.config",
    "Reason": "ggufswap.ipc",
    "SlotState": "ggufswap.ipc",
    "HotSwapRuntime": "ggufswap.runtime.engine",
    "MapRefused": "ggufswap.runtime.errors",
    "PlanRejected": "ggufswap.runtime.errors",
    "PoolFull": "ggufswap.runtime.errors",
    "RuntimeLibraryError": "ggufswap.runtime.errors",
    "UnsupportedTypeError": "ggufswap.runtime.errors",
    "WeightsLost": "ggufswap.runtime.errors",
    "DerivedTensor": "ggufswap.runtime.families",
    "family_of": "ggufswap.runtime.families",
    "group_families": "ggufswap.runtime.families",
    "KERNEL_TYPES": "ggufswap.runtime.kernels",
    "QuantizedExperts": "ggufswap.runtime.kernels",
    "QuantizedMatrix": "ggufswap.runtime.kernels",
    "dequantize": "ggufswap.runtime.kernels",
    "float_products": "ggufswap.runtime.kernels",
    "ggml_attn_front": "ggufswap.runtime.kernels",
    "ggml_flash_attn": "ggufswap.runtime.kernels",
    "ggml_front_args": "ggufswap.runtime.kernels",
    "ggml_moe_ffn": "ggufswap.runtime.kernels",
    "ggml_moe_layer": "ggufswap.runtime.kernels",
    "ggml_geglu_layer": "ggufswap.runtime.kernels",
    "ggml_geglu_tail": "ggufswap.runtime.kernels",
    "grouped": "ggufswap.runtime.kernels",
    "has_kernel": "ggufswap.runtime.kernels",
    "linear_all": "ggufswap.runtime.kernels",
    "routed_all": "ggufswap.runtime.kernels",
    "rows_rms_norm": "ggufswap.runtime.kernels",
    "rows_rope": "ggufswap.runtime.kernels",
    "PlanState": "ggufswap.runtime.plans",
    "PlanTicket": "ggufswap.runtime.plans",
    "Buffer": "ggufswap.runtime.pools",
    "Pool": "ggufswap.runtime.pools",
    "PoolSet": "ggufswap.runtime.pools",
    "Placement": "ggufswap.runtime.placement",
    "Slot": "ggufswap.runtime.store",
    "TensorStore": "ggufswap.runtime.store",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "KERNEL_TYPES",
    "Buffer",
    "DerivedTensor",
    "HotSwapRuntime",
    "MapRefused",
    "Placement",
    "PlanRejected",
    "PlanState",
    "PlanTicket",
    "Pool",
    "PoolFull",
    "PoolSet",
    "QuantizedExperts",
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
    "float_products",
    "ggml_attn_front",
    "ggml_flash_attn",
    "ggml_front_args",
    "ggml_geglu_layer",
    "ggml_geglu_tail",
    "ggml_moe_ffn",
    "ggml_moe_layer",
    "group_families",
    "grouped",
    "has_kernel",
    "linear_all",
    "routed_all",
    "rows_rms_norm",
    "rows_rope",
]
