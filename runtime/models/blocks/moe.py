"""Mixture-of-experts FFNs (llama.cpp's ``build_moe_ffn``) and their routing.

- :class:`MoEFeedForward`: softmax over every expert, top-k, renormalised or not, times
  ``expert_weights_scale``; an optional shared expert with a sigmoid gate (qwen2moe, qwen3.5).
- :class:`RoutedExperts`: softmax or sigmoid gating, the ``exp_probs_b`` selection bias,
  group-limited choice, weights renormalised (sum clamped) and scaled, plus ungated shared
  experts (deepseek2, glm4moe).

Every module here is ``moe(config, weights, layer, spec)`` and ``moe(x [B, T, D]) -> [B, T, D]``;
the experts a router chose run through :func:`routed_swiglu` where they are stacked SwiGLU
experts (one grouped product per projection: ggml's ``mul_mat_id`` in native storage where a
libggml multiplies them, llama.cpp's one call), else through :func:`combine_experts`, the one
place that loops over experts (biased, pre-weighted or per-file experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor, nn

from ggufswap.runtime.models.blocks.ffn import FeedForward, swiglu
from ggufswap.runtime.models.blocks.ggml_steps import moe_step
from ggufswap.runtime.models.blocks.weights import (
    TensorSpec,
    WeightProvider,
    linear,
    routed_linear,
    routed_linears,
)
from ggufswap.runtime.models.hparams import Arch, Gating, HParams
from ggufswap.shards.keys import TensorNames

TN: Final = TensorNames
# build_moe_ffn clamps the sum of the selected weights to the smallest normal F16 before dividing.
WEIGHTS_SUM_MIN = 6.103515625e-5
SHARED_EXPERT_TENSORS: Final = (
    TensorNames.FFN_GATE_SHEXP,
    TensorNames.FFN_UP_SHEXP,
    TensorNames.FFN_DOWN_SHEXP,
    TensorNames.FFN_GATE_INP_SHEXP,
)


def combine_experts(
    flat: Tensor,
    top_w: Tensor,
    top_i: Tensor,
    expert: Callable[[Tensor, int], Tensor],
    *,
    weight_before: bool = False,
) -> Tensor:
    """``sum_k top_w[n, k] * expert(flat[n], top_i[n, k])`` per token: each chosen expert runs
    once over the tokens routed to it, in ascending expert order (deterministic sums). With
    ``weight_before`` (llama4) the weight scales the expert's input instead:
    ``sum_k expert(top_w[n, k] * flat[n], top_i[n, k])``."""
    # flat: [N, D]; top_w, top_i: [N, k]
    out = torch.zeros_like(flat)
    for e in top_i.unique().tolist():
        rows, slot = (top_i == e).nonzero(as_tuple=True)  # tokens routed to e, and which slot
        w = top_w[rows, slot, None].to(flat.dtype)
        y = expert(flat[rows] * w, e) if weight_before else expert(flat[rows], e) * w
        out.index_add_(0, rows, y)
    return out


def routed_swiglu(
    weights: WeightProvider, names: tuple[str, str, str], flat: Tensor, top_w: Tensor, top_i: Tensor
) -> Tensor:
    """``sum_k top_w[n, k] * down(silu(gate(x)) * up(x))`` with the stacked experts ``names``
    (gate, up, down) ``top_i [N, k]`` chooses for each token of ``flat [N, D]``: one grouped
    product per projection (:func:`~.weights.routed_linear`), the slots summed in order as
    llama.cpp's ``build_moe_ffn`` adds its views; ``[N, D]``."""
    gate_exps, up_exps, down_exps = (weights.experts(name) for name in names)
    gate, up = routed_linears([gate_exps, up_exps], flat, top_i)  # [N, k, ff] each: one call
    y = routed_linear(down_exps, F.silu(gate) * up, top_i)  # [N, k, D]
    return (y * top_w.unsqueeze(-1).to(y.dtype)).sum(dim=1)


class MoEFeedForward(nn.Module):
    """Router -> top-k experts (each run over the tokens routed to it) + optional shared expert."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights = config, weights
        tn, d, n_exp, ff = TensorNames, config.n_embd, config.n_expert, config.n_ff_exp
        self.router = spec.need(tn.FFN_GATE_INP.format(layer), (n_exp, d))
        # Old Mixtral files (llama only) hold one tensor per expert instead of the stacks.
        self.per_expert: tuple[tuple[str, str, str], ...] | None = None
        stacked = tn.FFN_UP_EXPS.format(layer)
        old_form = not weights.has(stacked) and weights.has(tn.FFN_UP_EXPERT.format(layer, 0))
        if config.arch is Arch.LLAMA and old_form:
            self.per_expert = tuple(
                (
                    spec.need(tn.FFN_GATE_EXPERT.format(layer, e), (ff, d)),
                    spec.need(tn.FFN_UP_EXPERT.format(layer, e), (ff, d)),
                    spec.need(tn.FFN_DOWN_EXPERT.format(layer, e), (d, ff)),
                )
                for e in range(n_exp)
            )
        if self.per_expert is None:
            self.gate_exps = spec.need_experts(tn.FFN_GATE_EXPS.format(layer), (n_exp, ff, d))
            self.up_exps = spec.need_experts(stacked, (n_exp, ff, d))
            self.down_exps = spec.need_experts(tn.FFN_DOWN_EXPS.format(layer), (n_exp, d, ff))
        self.shared: tuple[str, str, str] | None = None
        self.shared_gate: str | None = None
        names = [t.format(layer) for t in SHARED_EXPERT_TENSORS]
        if config.has_shared_expert:  # qwen2moe: all four in every block, as llama.cpp loads them
            sh = config.n_ff_shexp
            self.shared = (
                spec.need(names[0], (sh, d)),
                spec.need(names[1], (sh, d)),
                spec.need(names[2], (d, sh)),
            )
            self.shared_gate = spec.need(names[3], (d,))
        else:
            spec.refuse(weights, names, f"{config.arch.value} has no shared expert")

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k expert weights and ids per token: ``([N, k] float32, [N, k] int64)``."""
        # x: [N, D]
        c = self.config
        probs = linear(x, self.weights.weight(self.router)).float().softmax(dim=-1)  # [N, E]
        top_w, top_i = probs.topk(c.n_expert_used, dim=-1)  # [N, k]
        if c.norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w * c.expert_weights_scale, top_i

    def expert(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` applied to rows ``x`` (the stacked tensors index by expert; an old
        Mixtral file's per-expert tensors are plain matrices)."""
        if self.per_expert is not None:
            return swiglu(x, *(self.weights.matrix(name) for name in self.per_expert[e]))
        w = self.weights.experts
        return swiglu(x, w(self.gate_exps)[e], w(self.up_exps)[e], w(self.down_exps)[e])

    def forward(self, x: Tensor) -> Tensor:
        """The FFN of ``x [B, T, D]``; one token in a decoder with ggml's numerics: one compiled
        call, ggml's router, softmax, experts and sum (:func:`~.ggml_steps.moe_step`)."""
        y = moe_step(self.weights, self, x)
        if y is not None:
            return y
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        top_w, top_i = self.route(flat)  # [N, k]
        if self.per_expert is None:  # stacked experts: one grouped product per projection
            stacks = (self.gate_exps, self.up_exps, self.down_exps)
            out = routed_swiglu(self.weights, stacks, flat, top_w, top_i)
        else:
            out = combine_experts(flat, top_w, top_i, self.expert)
        return (out + self._shared(flat)).view_as(x)

    def _shared(self, x: Tensor) -> Tensor | float:
        # x: [N, D]
        if self.shared is None:
            return 0.0
        w = self.weights.weight
        y = swiglu(x, *(self.weights.matrix(name) for name in self.shared))  # [N, D]
        assert self.shared_gate is not None, "a shared expert always has its gate (qwen2moe)"
        gate = w(self.shared_gate).reshape(1, -1)  # {n_embd} or {n_embd, 1}: one row
        return y * torch.sigmoid(linear(x, gate))  # [N, 1]


class RoutedExperts(nn.Module):
    """build_moe_ffn as deepseek2 and glm4moe call it, plus the shared experts (see the module
    docstring; glm4moe's shared experts are optional, its exp_probs_b required)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights = config, weights
        d, n_exp, ff = config.n_embd, config.n_expert, config.n_ff_exp
        self.router = spec.need(TN.FFN_GATE_INP.format(layer), (n_exp, d))
        bias = TN.FFN_EXP_PROBS_B.format(layer)
        required = config.rules.glm  # glm4moe creates exp_probs_b without TENSOR_NOT_REQUIRED
        self.bias = spec.need(bias, (n_exp,)) if required else spec.maybe(weights, bias, (n_exp,))
        self.gate_exps = spec.need_experts(TN.FFN_GATE_EXPS.format(layer), (n_exp, ff, d))
        self.up_exps = spec.need_experts(TN.FFN_UP_EXPS.format(layer), (n_exp, ff, d))
        self.down_exps = spec.need_experts(TN.FFN_DOWN_EXPS.format(layer), (n_exp, d, ff))
        sh, a = config.n_ff_shexp, config.arch.value
        names = [t.format(layer) for t in (TN.FFN_GATE_SHEXP, TN.FFN_UP_SHEXP, TN.FFN_DOWN_SHEXP)]
        self.shared: tuple[str, ...] | None = None
        if config.has_shared_expert:
            shapes = ((sh, d), (sh, d), (d, sh))
            self.shared = tuple(spec.need(n, s) for n, s in zip(names, shapes, strict=True))
        else:
            spec.refuse(weights, names, f"{a}: expert_shared_count is 0")
        spec.refuse(weights, [TN.FFN_GATE_INP_SHEXP.format(layer)], f"{a}'s shared experts")

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k expert weights and ids per token: ``([N, k] float32, [N, k] int64)``."""
        # x: [N, D]
        c = self.config
        logits = linear(x, self.weights.weight(self.router)).float()  # [N, E]
        probs = logits.softmax(-1) if c.gating is Gating.SOFTMAX else logits.sigmoid()
        chosen = probs
        if self.bias is not None:  # selection only: the weights stay unbiased
            chosen = probs + self.weights.weight(self.bias).to(probs.device, torch.float32)
        if c.n_expert_groups > 1:
            chosen = _best_groups(chosen, c.n_expert_groups, c.n_group_used)
        top_i = chosen.topk(c.n_expert_used, dim=-1).indices  # [N, k]
        top_w = probs.gather(-1, top_i)
        if c.norm_topk:
            top_w = top_w / top_w.sum(-1, keepdim=True).clamp(min=WEIGHTS_SUM_MIN)
        if c.expert_weights_scale != 1.0:
            top_w = top_w * c.expert_weights_scale
        return top_w, top_i

    def expert(self, x: Tensor, e: int) -> Tensor:
        """Routed expert ``e`` applied to rows ``x``."""
        w = self.weights.experts
        return swiglu(x, w(self.gate_exps)[e], w(self.up_exps)[e], w(self.down_exps)[e])

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, T, D]
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        top_w, top_i = self.route(flat)  # [N, k]
        stacks = (self.gate_exps, self.up_exps, self.down_exps)
        out = routed_swiglu(self.weights, stacks, flat, top_w, top_i)
        if self.shared is not None:
            gate, up, down = (self.weights.matrix(name) for name in self.shared)
            out = out + swiglu(flat, gate, up, down)
        return out.view_as(x)


def _best_groups(scores: Tensor, n_groups: int, n_used: int) -> Tensor:
    """Keep the experts of the ``n_used`` groups whose two best scores sum highest; the others
    become -inf (build_moe_ffn's group-limited routing)."""
    # scores: [N, E]
    groups = scores.unflatten(-1, (n_groups, -1))  # [N, G, E/G]
    group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [N, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(-1, group_scores.topk(n_used, dim=-1).indices, True)
    return groups.masked_fill(~keep[..., None], -math.inf).flatten(-2)


def lead_dense_ffn(config: HParams, layer: int) -> type[nn.Module]:
    """The FFN of ``layer`` in deepseek2 and glm4moe: dense SwiGLU in the
    ``leading_dense_block_count`` first blocks, routed experts after."""
    return FeedForward if layer < config.n_layer_dense_lead else RoutedExperts
