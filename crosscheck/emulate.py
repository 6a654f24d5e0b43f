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

With ``ROUNDING = "ik"`` it rounds as ik_llama.cpp's CPU kernels do instead: the activations of
every quantized weight to ik's Q8_2_X4 (``_ik_q8_2``), and the keys and values of attention to
F16, because ik keeps deepseek2's latent cache in the V cache's type, which it allows to be other
than F16 only with flash attention (which aborts on CPUs without AVX-VNNI).

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
from gguf import GGMLQuantizationType

from ggufswap.runtime.models import deepseek2
from ggufswap.runtime.models.blocks import MoEFeedForward, RoutedExperts, weights
from ggufswap.runtime.models.ggml_numerics import VEC_DOT, gelu, q8_blocks, round_activations
from ggufswap.runtime.models.hparams import Gating
from ggufswap.shards import read_header
from ggufswap.shards.ggml_types import GGMLType

Q = GGMLQuantizationType
Q4_1_BLOCK_BYTES = 20  # d (f16), m (f16), qs[16]


class _Weight:
    """What ggml would do with one weight: its type and, for Q4_1, its block minima (None: the
    F16 rounding of Q8_1's block sums is not emulated)."""

    def __init__(
        self, ggml_type: GGMLQuantizationType | GGMLType, mins: torch.Tensor | None
    ) -> None:
        self.ggml_type, self.mins = ggml_type, mins  # mins: [out, K/32]


# Whose CPU rounding ``emulating`` reproduces: llama.cpp's ggml, or ik_llama.cpp's ("ik": its
# AVX2 iqk kernels round the activations of every quantized type the cross-check uses to Q8_2_X4,
# ``_ik_q8_2``). ``families.py`` sets it for the family it checks.
ROUNDING = "llama.cpp"


def _ik_q8_2(x: torch.Tensor) -> torch.Tensor:
    """ik_llama.cpp's ``quantize_row_q8_2_x4`` (AVX2): blocks of 32, ``d = amax / 127`` rounded to
    BF16, ``q = rint(x * (1 / d))`` with ties to even; each block's integer sum is kept exact, so
    a Q4_1 weight's minimum meets no rounded sum. ``x [N, K]`` float32 -> ``q * d``."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127.0).bfloat16().float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def _emulated(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, info: _Weight) -> Any:
    """The product in float64 on activations rounded by the package's ggml numerics (or by
    ik_llama.cpp's rule, ``ROUNDING``)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    weight_type = GGMLType(int(info.ggml_type))
    vec_dot = VEC_DOT.get(weight_type, GGMLType.F32)
    if ROUNDING == "ik" and weight_type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        # ik's AVX2 vec_dot types: Q8_K for its IQ*_K and IQ*_KS types, Q8_2_X4 for the others
        ik_q8_k = weight_type.name.startswith("IQ") and "_K" in weight_type.name
        xq = round_activations(flat, GGMLType.Q8_K) if ik_q8_k else _ik_q8_2(flat)
        y = F.linear(xq.double(), w.double(), None if b is None else b.double())
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
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


def _q4_1_mins(record: Any) -> torch.Tensor:
    """``[rows, K/32]`` block minima of a Q4_1 tensor (rows over every expert)."""
    with open(record.path, "rb") as f:
        f.seek(record.offset)
        raw = np.frombuffer(f.read(record.nbytes), dtype=np.uint8).reshape(-1, Q4_1_BLOCK_BYTES)
    mins = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    return torch.from_numpy(mins.reshape(-1, record.ne[0] // 32))


def _row_groups(metadata: Any, name: str, w: torch.Tensor) -> int:
    """How many matrices ggml multiplies ``w`` as: its experts (or heads) when 3-D; the heads of
    ik_llama.cpp's 2-D ``attn_k_b`` / ``attn_v_b`` (``[H * rows, cols]``, reshaped per head in its
    graph); else 1."""
    if w.dim() == 3:
        return int(w.shape[0])
    if name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
        return int(metadata["deepseek2.attention.head_count"])
    return 1


@contextmanager
def emulating(runtime: Any, path: Path, *, q8_1_sums: bool = True) -> Iterator[None]:
    """Within the block, the decoders' ``linear`` rounds activations as ggml's CPU matmul does
    for the type of the weight it multiplies (found by the weight's data pointer in
    ``runtime.store``), and GELU goes through ggml's F16 table. ``q8_1_sums=False`` leaves out
    the F16 rounding of Q8_1's block sums (Q4_1 weights), to measure what it alone contributes."""
    header = read_header(path)  # the project's reader: ik_llama.cpp's types too
    table: dict[int, _Weight] = {}
    store = runtime.store
    for name, record in header.tensor_map().items():
        ggml_type = record.ggml_type
        with_sums = q8_1_sums and ggml_type == Q.Q4_1
        mins = _q4_1_mins(record) if with_sums else None
        w = store.experts(name)
        groups = _row_groups(header.metadata, name, w)
        if groups > 1:  # one matrix per head or expert: ggml multiplies each on its own
            rows = w.shape[-2] if w.dim() == 3 else w.shape[0] // groups
            flat = w.reshape(groups, rows, -1)
            for e in range(groups):
                part = None if mins is None else mins[e * rows : (e + 1) * rows]
                table[flat[e].data_ptr()] = _Weight(ggml_type, part)
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

    original_attention = F.scaled_dot_product_attention

    def f16_cache_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
    ) -> torch.Tensor:
        """ik_llama.cpp keeps the latent cache in the V cache's type, F16 (module docstring)."""
        return original_attention(q, k.half().to(k.dtype), v.half().to(v.dtype), **kw)

    for module in users:
        module.linear = linear  # type: ignore[attr-defined]
    deepseek2.head_linear = head_linear
    F.gelu = _gelu_fp16_table
    if ROUNDING == "ik":
        F.scaled_dot_product_attention = f16_cache_attention
    try:
        yield
    finally:
        for module in users:
            module.linear = original  # type: ignore[attr-defined]
        deepseek2.head_linear = original_head
        F.gelu = original_gelu
        F.scaled_dot_product_attention = original_attention


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
