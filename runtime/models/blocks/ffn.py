"""Dense gated FFNs: SwiGLU and GeGLU (llama.cpp's ``build_ffn`` with LLM_FFN_PAR)."""

from __future__ import annotations

from typing import Final

import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor, nn

from ggufswap.runtime.models.blocks.weights import (
    Matrix,
    TensorSpec,
    WeightProvider,
    linear,
    linears,
)
from ggufswap.runtime.models.ggml_numerics import GgmlMatrix, gelu
from ggufswap.runtime.models.hparams import Activation, HParams
from ggufswap.shards.keys import TensorNames


def swiglu(x: Tensor, gate: Matrix, up: Matrix, down: Matrix) -> Tensor:
    """``down(silu(gate(x)) * up(x))``: llama.cpp's LLM_FFN_SILU + LLM_FFN_PAR."""
    g, u = linears(x, [gate, up])  # one ggml call where it multiplies both
    return linear(F.silu(g) * u, down)


def geglu(x: Tensor, gate: Matrix, up: Matrix, down: Matrix) -> Tensor:
    """``down(gelu_tanh(gate(x)) * up(x))``: llama.cpp's LLM_FFN_GELU + LLM_FFN_PAR (gemma); with
    ggml's numerics (a :class:`GgmlMatrix` gate), GELU through ggml's F16 table."""
    g, u = linears(x, [gate, up])
    act = gelu(g) if isinstance(gate, GgmlMatrix) else F.gelu(g, approximate="tanh")
    return linear(act * u, down)


GATED_FFN: Final = {Activation.SILU: swiglu, Activation.GELU_TANH: geglu}


class FeedForward(nn.Module):
    """Dense gated FFN (SwiGLU, or GeGLU for gemma)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.weights = weights
        self.act = GATED_FFN[config.activation]
        self.gelu = config.activation is Activation.GELU_TANH  # GeGLU (gemma)
        d, ff = config.n_embd, config.n_ff
        self.gate = spec.need(TensorNames.FFN_GATE.format(layer), (ff, d))
        self.up = spec.need(TensorNames.FFN_UP.format(layer), (ff, d))
        self.down = spec.need(TensorNames.FFN_DOWN.format(layer), (d, ff))

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., D]
        w = self.weights.matrix
        return self.act(x, w(self.gate), w(self.up), w(self.down))
