"""Where the decoders read their weights from, and the checks of what they read.

The modules own no weights: each ``forward`` asks a :class:`WeightProvider` (the runtime's tensor
store when serving) for the tensors it needs, so a swap committed between two batches is what the
next batch computes with. Weights may live on different devices (mixed pools); activations move
to a weight's device for each matmul and come back (llama.cpp's hybrid CPU/GPU style).

:class:`TensorSpec` records every tensor a decoder's modules read, with its shape, at
construction; :func:`check_weights` refuses a provider that lacks one, holds it misshapen, or
holds tensors the architecture does not have, all of them in one message.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, TypeAlias

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor

from ggufswap.runtime import QuantizedExperts, QuantizedMatrix, grouped, linear_all, routed_all
from ggufswap.runtime.models.errors import MissingWeightError
from ggufswap.runtime.models.ggml_numerics import GgmlMatrix


class ExpertStack(Protocol):
    """Stacked experts ``[E, ...]`` read one expert at a time: a tensor, or the store's view of
    a stack whose expert ranges live on different devices, or whose experts stay in their GGUF
    blocks (``[e]`` is then a :class:`~ggufswap.runtime.QuantizedMatrix`, which ``linear``
    multiplies from)."""

    @property
    def shape(self) -> torch.Size: ...

    def __getitem__(self, e: int, /) -> Tensor | QuantizedMatrix | GgmlMatrix: ...

    def routed(self, x: Tensor, ids: Tensor) -> Tensor:
        """``[N, k, rows]``: the products of the experts ``ids [N, k]`` routes each token to,
        ``x`` ``[N, cols]`` (or ``[N, k, cols]``, one input per slot), in one grouped call."""
        ...


class WeightProvider(Protocol):
    """Where the model reads its weights from at forward time (the runtime's tensor store)."""

    def weight(self, name: str) -> Tensor:
        """The tensor in logical torch shape (reversed ggml ``ne``), compute dtype, own device."""
        ...

    def experts(self, name: str) -> Tensor | ExpertStack:
        """A stacked expert tensor; ``[e]`` is expert ``e`` on the device that holds it."""
        ...

    def matrix(self, name: str) -> Tensor | QuantizedMatrix | GgmlMatrix:
        """A weight ``linear`` multiplies by: the tensor, or (native storage) its GGUF blocks
        where multiplying from them is the cheaper way, or (numerics "ggml") its blocks to
        multiply as ggml does."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's logical torch shape, without reading its data."""
        ...

    def rows(self, name: str, ids: Tensor) -> Tensor:
        """Rows ``ids`` (any shape of int64) of a 2-D tensor: ``[*ids.shape, ne[0]]`` in the
        compute dtype, on the tensor's device (an embedding lookup)."""
        ...

    def has(self, name: str) -> bool:
        """Whether the model file holds a tensor of this name."""
        ...


class DictWeightProvider:
    """A provider over a plain dict: for tests, tools and models loaded without the store."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self._tensors = dict(tensors)

    def weight(self, name: str) -> Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise MissingWeightError(f"no tensor named {name!r} in this provider") from None

    def experts(self, name: str) -> Tensor:
        return self.weight(name)

    def matrix(self, name: str) -> Tensor:
        return self.weight(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weight(name).shape)

    def rows(self, name: str, ids: Tensor) -> Tensor:
        w = self.weight(name)
        return F.embedding(ids.to(w.device), w)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def set(self, name: str, tensor: Tensor) -> None:
        """Replace (or add) one tensor; the next forward sees it."""
        self._tensors[name] = tensor

    def names(self) -> Iterator[str]:
        return iter(self._tensors)


def linear(x: Tensor, w: Tensor | QuantizedMatrix | GgmlMatrix, b: Tensor | None = None) -> Tensor:
    """``x @ w.T (+ b)`` on ``w``'s device and dtype; the result returns to ``x``'s device/dtype.

    ``w`` may be a matrix still in its GGUF blocks (native storage's experts): it multiplies
    from them (:class:`~ggufswap.runtime.QuantizedMatrix`); or a weight of a decoder with ggml's
    numerics: the activations are rounded as ggml's CPU matmul rounds them (:mod:`.ggml_numerics`).
    """
    if isinstance(w, GgmlMatrix):
        return w.linear(x, b)
    if isinstance(w, QuantizedMatrix):
        y = w.linear(x, dtype=x.dtype if x.is_floating_point() else torch.float32)
        if b is not None:
            y = y + b.to(device=y.device, dtype=y.dtype)
        return y.to(device=x.device, dtype=x.dtype)
    xw = x.to(device=w.device, dtype=w.dtype)
    bw = None if b is None else b.to(device=w.device, dtype=w.dtype)
    return F.linear(xw, w, bw).to(device=x.device, dtype=x.dtype)


Matrix: TypeAlias = "Tensor | QuantizedMatrix | GgmlMatrix"


def linears(x: Tensor, ws: list[Matrix], biases: list[Tensor | None] | None = None) -> list[Tensor]:
    """``[linear(x, w, b)]`` for several weights read by the same ``x`` (a layer's q, k and v;
    gate and up): one call where ggml multiplies them all (``x`` quantized once, as llama.cpp's
    graph does), the same values as one call each."""
    bs = biases if biases is not None else [None] * len(ws)
    blocks = [w.blocks if isinstance(w, GgmlMatrix) else w for w in ws]
    if not all(isinstance(m, QuantizedMatrix) and m.ggml for m in blocks):
        return [linear(x, w, b) for w, b in zip(ws, bs, strict=True)]
    ys = linear_all(x, [m for m in blocks if isinstance(m, QuantizedMatrix)], dtype=torch.float32)
    biased = [y if b is None else y + b.to(y.device, y.dtype) for y, b in zip(ys, bs, strict=True)]
    return [y.to(device=x.device, dtype=x.dtype) for y in biased]


def routed_linears(stacks: list[Tensor | ExpertStack], x: Tensor, ids: Tensor) -> list[Tensor]:
    """``[routed_linear(s, x, ids)]`` for stacks read by the same ``x`` and ``ids`` (a MoE
    layer's gate and up): one ggml call where ggml multiplies every one of them from its blocks
    (the activations quantized once), the same values as one call each."""
    blocks = [getattr(s, "blocks", None) for s in stacks]
    found = [b() if callable(b) else None for b in blocks]
    whole = [q for q in found if isinstance(q, QuantizedExperts)]
    usable = len(whole) == len(stacks) and x.dtype is torch.float32 and x.is_cpu
    outs = routed_all(whole, x, ids) if usable else None
    if outs is None:
        return [routed_linear(s, x, ids) for s in stacks]
    return outs


def routed_linear(stack: Tensor | ExpertStack, x: Tensor, ids: Tensor) -> Tensor:
    """``[N, k, rows]``: ``x @ W[ids[t, j]].T`` for every token ``t`` and slot ``j``, one grouped
    product (``x``: ``[N, cols]``, or ``[N, k, cols]`` one input per slot); a plain tensor stack
    multiplies each expert present once, over the rows routed to it."""
    if isinstance(stack, Tensor):
        return grouped(lambda e, rows: linear(rows, stack[e]), x, ids, stack.shape[1])
    return stack.routed(x, ids)


class TensorSpec:
    """Expected shapes of the tensors a module reads, checked once at construction."""

    def __init__(self) -> None:
        self.required: dict[str, tuple[int, ...]] = {}
        self.unexpected: list[str] = []  # tensors the architecture does not have

    def need(self, name: str, shape: tuple[int, ...]) -> str:
        self.required[name] = shape
        return name

    def need_experts(self, name: str, shape: tuple[int, ...]) -> str:
        """A stacked expert tensor (read per expert, through ``experts``)."""
        return self.need(name, shape)

    def maybe(self, weights: WeightProvider, name: str, shape: tuple[int, ...]) -> str | None:
        return self.need(name, shape) if weights.has(name) else None

    def refuse(self, weights: WeightProvider, names: Iterable[str], reason: str) -> None:
        """Record tensors present that llama.cpp's loader would refuse for this architecture."""
        self.unexpected += [
            f"{name}: {reason} (llama.cpp refuses the file: wrong number of tensors)"
            for name in names
            if weights.has(name)
        ]


# The per-tensor weight scales llama.cpp's loader reads, for every architecture, beside these
# matrices of a block (``blk.N.<name>.scale``, shape {1} or {n_expert}; llama_model_base's
# create_tensor of ``*_s``) and multiplies their products by.
WEIGHT_SCALES = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_qkv",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
)


def refuse_weight_scales(
    spec: TensorSpec, weights: WeightProvider, layer: int, *, read: Iterable[str] = ()
) -> None:
    """Record the weight scales of block ``layer`` present in the file that the decoder does not
    apply (all but ``read``): llama.cpp would multiply by them, so ignoring them would compute
    something else."""
    skip = set(read)
    names = [f"blk.{layer}.{t}.scale" for t in WEIGHT_SCALES if t not in skip]
    spec.unexpected += [
        f"{name}: llama.cpp multiplies its matrix's product by this scale; the reference "
        "decoder does not implement it"
        for name in names
        if weights.has(name)
    ]


def check_weights(weights: WeightProvider, spec: TensorSpec, *, shapes: bool) -> None:
    """Raise one error listing every missing, misshapen and unexpected tensor."""
    problems = [f"{name}: missing" for name in spec.required if not weights.has(name)]
    problems += spec.unexpected
    if shapes and not problems:
        for name, expected in spec.required.items():
            found = weights.shape(name)
            if _ggml_dims(found) != _ggml_dims(expected):
                problems.append(f"{name}: expected shape {list(expected)}, found {list(found)}")
    if problems:
        lines = "\n  ".join(problems)
        raise MissingWeightError(f"the weights do not fit the model config:\n  {lines}")


def _ggml_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A logical torch shape without its leading 1s: ggml's trailing ``ne`` of 1, which
    llama.cpp's check_tensor_dims accepts as absent (the converter writes the shared expert's gate
    of Qwen2-MoE / Qwen3.5-MoE as ``{n_embd, 1}``)."""
    start = 0
    while start < len(shape) - 1 and shape[start] == 1:
        start += 1
    return shape[start:]
