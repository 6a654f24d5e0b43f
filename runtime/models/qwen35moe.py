"""Qwen3.5 / Qwen3.6 MoE (``general.architecture = qwen35moe``): llama.cpp's
``llama_model_qwen35moe`` (``src/models/qwen35moe.cpp``).

Qwen3.5's hybrid decoder (:mod:`.qwen35`) whose FFNs are routed experts (softmax over every
expert, top-k, renormalised) plus a shared expert under a sigmoid gate in every block
(:class:`~.blocks.moe.MoEFeedForward`). ``expert_feed_forward_length`` sizes the experts (else
``feed_forward_length / expert_used_count``), ``expert_shared_feed_forward_length`` the shared
one (else ``feed_forward_length``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ggufswap.runtime.models import qwen35
from ggufswap.runtime.models._moe_hparams import QWEN_MOE_KEYS, qwen_moe_kwargs
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.hparams import Arch, KeyReader
from ggufswap.runtime.models.qwen35 import HybridTransformer

KEYS: Final = (*qwen35.KEYS, *QWEN_MOE_KEYS)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_qwen35moe::load_arch_hparams: qwen35's keys and the expert widths."""
    return qwen35.read_keys(reader, common) | qwen_moe_kwargs(reader, common)


class Qwen35MoeTransformer(HybridTransformer):
    """qwen35moe: routed experts and a gated shared expert in every block."""

    arch = Arch.QWEN35MOE


ARCHITECTURE = Architecture(
    arch=Arch.QWEN35MOE, decoder=Qwen35MoeTransformer, read_keys=read_keys, keys=KEYS
)
