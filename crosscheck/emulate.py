"""An experiment, not a product path: ggml's CPU activation rounding, emulated in the decoder.

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

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from gguf import GGMLQuantizationType, GGUFReader

from ggufswap.runtime.models import deepseek2, gpt_oss, llama
from ggufswap.runtime.models.deepseek2 import RoutedExperts
from ggufswap.runtime.models.hparams import Gating
from ggufswap.runtime.models.llama import MoEFeedForward

Q = GGMLQuantizationType
K_QUANTS = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
Q8_TYPES = frozenset({Q.Q4_0, Q.Q8_0, Q.Q5_0, Q.Q4_1, Q.Q5_1, Q.MXFP4})
Q4_1_BLOCK_BYTES = 20  # d (f16), m (f16), qs[16]


def _q8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0/Q8_1 rounding of ``x [N, K]``: rounded values, per-block F16 scale, integer sums."""
    blocks = x.reshape(x.shape[0], -1, 32)  # [N, K/32, 32]
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)  # half to even, as the AVX2 kernels round
    d16 = d.half().float()
    return (q * d16).reshape(x.shape), d, q.sum(-1)


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """Q8_K rounding of ``x [N, K]`` (quantize_row_q8_K_ref)."""
    blocks = x.reshape(x.shape[0], -1, 256)
    idx = blocks.abs().argmax(-1, keepdim=True)
    peak = blocks.gather(-1, idx)  # the signed value of largest magnitude
    iscale = torch.where(peak != 0, -127.0 / peak, torch.zeros_like(peak))
    q = torch.clamp(torch.round(iscale * blocks), max=127)
    d = torch.where(peak != 0, 1.0 / iscale, torch.zeros_like(peak))
    return (q * d).reshape(x.shape)


class _Weight:
    """What ggml would do with one weight: its type and, for Q4_1, its block minima (None: the
    F16 rounding of Q8_1's block sums is not emulated)."""

    def __init__(self, ggml_type: GGMLQuantizationType, mins: torch.Tensor | None) -> None:
        self.ggml_type, self.mins = ggml_type, mins  # mins: [out, K/32]


def _emulated(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, info: _Weight) -> Any:
    t, flat = info.ggml_type, x.reshape(-1, x.shape[-1]).to(torch.float64)
    extra = None
    if t == Q.F16:
        xq = flat.half().double()
    elif t in K_QUANTS:
        xq = _q8_k(flat.float()).double()
    elif t in Q8_TYPES:
        xq32, d, qsum = _q8_blocks(flat.float())
        xq = xq32.double()
        if t == Q.Q4_1 and info.mins is not None:
            s16 = (d[..., 0] * qsum).half().double()  # Q8_1's s, rounded to F16
            extra = (s16 - d[..., 0].half().double() * qsum.double()) @ info.mins.double().T
    else:
        xq = flat
    y = F.linear(xq, w.double(), None if b is None else b.double())
    if extra is not None:
        y = y + extra
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


_GELU = F.gelu


def _gelu_fp16_table(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """ggml_vec_gelu_f32 / ggml_vec_geglu_f32 with GGML_GELU_FP16: the tanh GELU of the input
    rounded to F16, itself rounded to F16; the identity from 10 up, zero from -10 down."""
    assert approximate == "tanh", "ggml's table holds the tanh GELU"
    x = input
    table = _GELU(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))


def _q4_1_mins(reader: GGUFReader, name: str) -> torch.Tensor:
    """``[rows, K/32]`` block minima of a Q4_1 tensor (rows over every expert)."""
    t = next(t for t in reader.tensors if t.name == name)
    raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, Q4_1_BLOCK_BYTES)
    mins = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    k = int(t.shape[0])
    return torch.from_numpy(mins.reshape(-1, k // 32))


@contextmanager
def emulating(runtime: Any, path: Path, *, q8_1_sums: bool = True) -> Iterator[None]:
    """Within the block, ``llama.linear`` rounds activations as ggml's CPU matmul does for the
    type of the weight it multiplies (found by the weight's data pointer in ``runtime.store``),
    and GELU goes through ggml's F16 table. ``q8_1_sums=False`` leaves out the F16 rounding of
    Q8_1's block sums (Q4_1 weights), to measure what it alone contributes."""
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
    original = llama.linear
    original_gelu = F.gelu

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

    llama.linear = linear
    deepseek2.head_linear = head_linear
    gpt_oss.linear = linear
    F.gelu = _gelu_fp16_table
    try:
        yield
    finally:
        llama.linear = original
        deepseek2.head_linear = original_head
        gpt_oss.linear = original
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
