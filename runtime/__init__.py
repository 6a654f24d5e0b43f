"""ggufswap.runtime: the inference side — tensor store, pools, staged atomic commits, models.

Importing this package imports torch; the agent never does.
"""

from __future__ import annotations

from ggufswap.runtime.architectures import Decoder, build_model
from ggufswap.runtime.dequant import KERNEL_TYPES, dequantize, has_kernel
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.errors import PlanRejected, Reason, RuntimeLibraryError, UnsupportedTypeError
from ggufswap.runtime.families import DerivedTensor, family_of, group_families
from ggufswap.runtime.model import (
    DictWeightProvider,
    MissingWeightError,
    Transformer,
    WeightProvider,
)
from ggufswap.runtime.model_config import Arch, ModelConfig, ModelConfigError, RopeType
from ggufswap.runtime.perplexity import NllStats, evaluate_batches, make_eval_tokens, perplexity
from ggufswap.runtime.plans import PlanState, PlanTicket
from ggufswap.runtime.pools import Buffer, Pool, PoolFull, PoolSet
from ggufswap.runtime.store import Placement, Slot, SlotState, Storage, TensorStore
from ggufswap.runtime.tokenizer import GgufTokenizer, TokenizerError

__all__ = [
    "KERNEL_TYPES",
    "Arch",
    "Buffer",
    "Decoder",
    "DerivedTensor",
    "DictWeightProvider",
    "GgufTokenizer",
    "HotSwapRuntime",
    "MissingWeightError",
    "ModelConfig",
    "ModelConfigError",
    "NllStats",
    "Placement",
    "PlanRejected",
    "PlanState",
    "PlanTicket",
    "Pool",
    "PoolFull",
    "PoolSet",
    "Reason",
    "RopeType",
    "RuntimeLibraryError",
    "Slot",
    "SlotState",
    "Storage",
    "TensorStore",
    "TokenizerError",
    "Transformer",
    "UnsupportedTypeError",
    "WeightProvider",
    "build_model",
    "dequantize",
    "evaluate_batches",
    "family_of",
    "group_families",
    "has_kernel",
    "make_eval_tokens",
    "perplexity",
]
