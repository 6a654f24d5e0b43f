"""An experiment: ggml's CPU activation rounding patched into a decoder, with its variants.

The product path is ``build_model(..., numerics="ggml")`` (``ggufswap.runtime.models.
ggml_numerics``, whose rounding this module uses); this patch adds what studies need: float64
products, and leaving out Q8_1's F16 block sums (``q8_1_sums=False``, ``q4_1_study.py``).

ggml's CPU matrix multiply does not multiply a quantized weight by float activations: it first
converts the activations to the weight type's ``vec_dot_type`` and takes integer dot products.

- F16 weights: activations rounded to F16.
- Q8_0, Q4_0: activations as Q8_0 (blocks of 32, ``d = amax / 127`` stored as F16,
  ``q = round(x / d)``).
- Q4_1: activations as Q8_1 (Q8_0's rounding, plus ``s = d * sum(q)`` stored as F16); the dot
  product is ``d_w d_x sum(q_w q_x) + m_w s_x``, so besides the rounded activations the block
  minimum ``m_w`` meets an F16-rounded block sum.
- K-quants: activations as Q8_K (blocks of 256, ``q = nearest_int(-127 x / max)``, float scale).

It also rounds GELU as ggml's CPU kernels do (``GGML_GELU_FP16``: the input rounded to F16, the
result read from a table of F16 values; gemma3's GeGLU).

``emulating(runtime, path)`` patches the decoder's ``linear`` so that every matmul with a weight of
the file rounds its activations that way (F32 weights, the routers and norms, stay exact). With it
the project's decoder reproduces llama.cpp's logits to float-summation noise (docs/models.md), so
whatever remains without it is that rounding, not a difference in dequantization or graph.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from gguf import GGMLQuantizationType, GGUFReader

from ggufswap.runtime.models import deepseek2
from ggufswap.runtime.models.blocks import MoEFeedForward, RoutedExperts, weights
from ggufswap.runtime.models.ggml_numerics import VEC_DOT, gelu, q8_blocks, round_activations
from ggufswap.runtime.models.hparams import Gating
from ggufswap.shards.ggml_types import GGMLType

Q = GGMLQuantizationType
Q4_1_BLOCK_BYTES = 20  # d (f16), m (f16), qs[16]


class _Weight:
    """What ggml would do with one weight: its type and, for Q4_1, its block minima (None: the
    F16 rounding of Q8_1's block sums is not emulated)."""

    def __init__(self, ggml_type: GGMLQuantizationType, mins: torch.Tensor | None) -> None:
        self.ggml_type, self.mins = ggml_type, mins  # mins: [out, K/32]


def _emulated(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, info: _Weight) -> Any:
    """The product in float64 on activations rounded by the package's ggml numerics."""
    flat = x.reshape(-1, x.shape[-1]).float()
    vec_dot = VEC_DOT.get(GGMLType(int(info.ggml_type)), GGMLType.F32)
    xq = round_activations(flat, vec_dot).double()
    extra = None
    if vec_dot is GGMLType.Q8_1 and info.mins is not None:
        _, d, qsum = q8_blocks(flat)
        s16 = (d[..., 0] * qsum).half().double()  # Q8_1's s, rounded to F16
        extra = (s16 - d[..., 0].half().double() * qsum.double()) @ info.mins.double().T
    y = F.linear(xq, w.double(), None if b is None else b.double())
    if extra is not None:
        y = y + extra
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _gelu_fp16_table(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    assert approximate == "tanh", "ggml's table holds the tanh GELU"
    return gelu(input)


def _q4_1_mins(reader: GGUFReader, name: str) -> torch.Tensor:
    """``[rows, K/32]`` block minima of a Q4_1 tensor (rows over every expert)."""
    t = next(t for t in reader.tensors if t.name == name)
    raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, Q4_1_BLOCK_BYTES)
    mins = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    k = int(t.shape[0])
    return torch.from_numpy(mins.reshape(-1, k // 32))


@contextmanager
def emulating(runtime: Any, path: Path, *, q8_1_sums: bool = True) -> Iterator[None]:
    """Within the block, the decoders' ``linear`` rounds activations as ggml's CPU matmul does
    for the type of the weight it multiplies (found by the weight's data pointer in
    ``runtime.store``), and GELU goes through ggml's F16 table. ``q8_1_sums=False`` leaves out
    the F16 rounding of Q8_1's block sums (Q4_1 weights), to measure what it alone contributes."""
    reader = GGUFReader(path)
    types = {t.name: GGMLQuantizationType(t.tensor_type) for t in reader.tensors}
    table: dict[int, _Weight] = {}
    store = runtime.store
    for name, ggml_type in types.items():
        with_sums = q8_1_sums and ggml_type == Q.Q4_1
        mins = _q4_1_mins(reader, name) if with_sums else None
        w = store.experts(name)
        if w.dim() == 3:
            for e in range(w.shape[0]):
                rows = w.shape[1]
                part = None if mins is None else mins[e * rows : (e + 1) * rows]
                table[w[e].data_ptr()] = _Weight(ggml_type, part)
        else:
            table[w.data_ptr()] = _Weight(ggml_type, mins)
    original = weights.linear
    original_gelu = F.gelu
    # Every module of the models package that multiplies through ``linear`` (blocks and
    # architectures alike) calls the name it imported: patch each of them.
    users = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("ggufswap.runtime.models")
        and getattr(module, "linear", None) is original
    ]

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        info = table.get(w.data_ptr())
        if info is None or info.ggml_type == Q.F32:
            return original(x, w, b)
        out: torch.Tensor = _emulated(x, w, b, info)
        return out

    original_head = deepseek2.head_linear

    def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """deepseek2's per-head products (attn_k_b, attn_v_b): one ggml matmul per head."""
        return torch.stack([linear(x[..., h, :], w[h]) for h in range(w.shape[0])], dim=-2)

    for module in users:
        module.linear = linear  # type: ignore[attr-defined]
    deepseek2.head_linear = head_linear
    F.gelu = _gelu_fp16_table
    try:
        yield
    finally:
        for module in users:
            module.linear = original  # type: ignore[attr-defined]
        deepseek2.head_linear = original_head
        F.gelu = original_gelu


# --- routing ---------------------------------------------------------------------------------

Routing = list[tuple[torch.Tensor, torch.Tensor]]  # per MoE call: (top-k ids, sorted probs)


@contextmanager
def recording(out: Routing) -> Iterator[None]:
    """Record every MoE block's expert choice (in call order: block by block)."""
    original = MoEFeedForward.route

    def route(self: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original(self, x)
        router = self.weights.weight(self.router)
        probs = torch.nn.functional.linear(x, router.to(x.dtype)).float().softmax(-1)
        out.append((ids.sort(-1).values, probs.sort(-1, descending=True).values))
        return weights, ids

    original_ds = RoutedExperts.route

    def route_ds(self: RoutedExperts, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original_ds(self, x)
        logits = torch.nn.functional.linear(x, self.weights.weight(self.router).to(x.dtype))
        c = self.config
        scores = logits.float().softmax(-1) if c.gating is Gating.SOFTMAX else logits.sigmoid()
        if self.bias is not None:  # the selection scores (groups aside)
            scores = scores + self.weights.weight(self.bias).float()
        out.append((ids.sort(-1).values, scores.sort(-1, descending=True).values))
        return weights, ids

    MoEFeedForward.route = route  # type: ignore[method-assign]
    RoutedExperts.route = route_ds  # type: ignore[method-assign]
    try:
        yield
    finally:
        MoEFeedForward.route = original  # type: ignore[method-assign]
        RoutedExperts.route = original_ds  # type: ignore[method-assign]


def flips(exact: Routing, emulated: Routing) -> tuple[int, int, float]:
    """Decisions whose expert sets differ, all decisions, smallest margin among the flipped."""
    changed, total, margin = 0, 0, float("inf")
    k = exact[0][0].shape[-1] if exact else 0
    for (ids_a, probs_a), (ids_b, _) in zip(exact, emulated, strict=True):
        differ = (ids_a != ids_b).any(-1)
        total += differ.numel()
        changed += int(differ.sum())
        if differ.any():
            gap = probs_a[:, k - 1] - probs_a[:, k]
            margin = min(margin, float(gap[differ].min()))
    return changed, total, margin
