"""Qwen3-Next (``general.architecture = qwen3next``): llama.cpp's ``llama_model_qwen3next``
(``src/models/qwen3next.cpp``).

Qwen3.5's hybrid decoder (:mod:`.qwen35`) with three differences: one fused projection
``ssm_ba`` gives beta and alpha (grouped by key head: ``[b, a]`` of ``n_v / n_k`` value heads
each), value heads read key head ``h // (n_v / n_k)`` (interleaved, as its converter lays them
out), and RoPE is plain NEOX on the first ``rope.dimension_count`` dims. Every block's FFN is
routed experts plus a gated shared expert (``expert_count`` > 0 required). Files with the legacy
fused ``ssm_in`` projection are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from torch import Tensor, nn

from ggufswap.runtime.models._moe_hparams import QWEN_MOE_KEYS, qwen_moe_kwargs
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.delta_net import GatedDeltaNet
from ggufswap.runtime.models.blocks.weights import TensorSpec, linear
from ggufswap.runtime.models.hparams import Arch, KeyReader
from ggufswap.runtime.models.qwen35 import (
    HYBRID_KEYS,
    HybridBlock,
    HybridTransformer,
    hybrid_kwargs,
)
from ggufswap.shards.keys import TensorNames

KEYS: Final = (*HYBRID_KEYS, *QWEN_MOE_KEYS)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_qwen3next::load_arch_hparams: the delta-net keys, the layer pattern and the
    expert widths (no RoPE sections)."""
    return hybrid_kwargs(reader, common) | qwen_moe_kwargs(reader, common)


class NextDeltaNet(GatedDeltaNet):
    """Qwen3-Next's delta net: ``ssm_ba`` and interleaved value heads."""

    tiled: ClassVar[bool] = False

    def beta_alpha_tensors(self, spec: TensorSpec, layer: int) -> None:
        """``ssm_ba``: per key head, ``n_v / n_k`` beta rows then as many alpha rows."""
        rows = (2 * self.s.n_v_heads, self.config.n_embd)
        self.wba = spec.need(TensorNames.SSM_BETA_ALPHA.format(layer), rows)
        legacy = TensorNames.SSM_IN.format(layer)
        spec.refuse(self.weights, [legacy], "the legacy fused ssm_in form is not implemented")

    def beta_alpha(self, x: Tensor) -> tuple[Tensor, Tensor]:
        s = self.s
        ratio = s.n_v_heads // s.n_k_heads
        ba = linear(x, self.weights.matrix(self.wba)).unflatten(-1, (s.n_k_heads, 2 * ratio))
        return ba[..., :ratio].flatten(-2), ba[..., ratio:].flatten(-2)  # [B, T, n_v] each


class NextBlock(HybridBlock):
    """A hybrid block whose delta net is Qwen3-Next's."""

    delta_net_cls: ClassVar[type[nn.Module]] = NextDeltaNet


class Qwen3NextTransformer(HybridTransformer):
    """qwen3next: NEOX RoPE, ``ssm_ba``, routed experts and a gated shared expert."""

    arch = Arch.QWEN3NEXT
    block = NextBlock


ARCHITECTURE = Architecture(
    arch=Arch.QWEN3NEXT, decoder=Qwen3NextTransformer, read_keys=read_keys, keys=KEYS
)
