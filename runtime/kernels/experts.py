"""Routed experts' products, one call per projection: ``y[t, j] = W[ids[t, j]] @ x[t, j]``.

llama.cpp multiplies a MoE layer's routed experts with one ``ggml_mul_mat_id`` per projection:
the rows of every token routed to an expert are gathered and multiplied together, whatever the
experts present. :class:`QuantizedExperts` (a stack of experts in its GGUF blocks, native
storage) does exactly that through ggml's kernels where a libggml is loaded (:mod:`._ggml`);
:func:`grouped` is the same product for any stack, one product per expert present (ascending,
so sums are deterministic), for float stacks and wherever ggml does not run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ggufswap.runtime.kernels import _ggml
from ggufswap.runtime.kernels.qmatmul import QuantizedMatrix
from ggufswap.shards.ggml_types import GGMLType, row_nbytes

__all__ = ["QuantizedExperts", "grouped", "routed_all"]


def grouped(
    product: Callable[[int, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    ids: torch.Tensor,
    rows: int,
) -> torch.Tensor:
    """``[N, k, rows]``: ``product(e, inputs)`` for the inputs routed to each expert ``e``.

    ``x`` is ``[N, cols]`` (every slot of a token reads the token's row) or ``[N, k, cols]``
    (slot ``j`` reads ``x[t, j]``); ``ids`` ``[N, k]``. The result has ``product``'s dtype.
    """
    n, k = ids.shape
    out: torch.Tensor | None = None
    for e in ids.unique().tolist():  # ascending
        token, slot = (ids == e).nonzero(as_tuple=True)
        y = product(e, x[token] if x.dim() == 2 else x[token, slot])  # [routed, rows]
        if out is None:
            out = y.new_zeros(n, k, rows)
        out[token, slot] = y
    return out if out is not None else x.new_zeros(n, k, rows)


@dataclass(frozen=True, eq=False)
class QuantizedExperts:
    """A stack of ``[n_expert, rows, cols]`` expert matrices in their GGUF blocks (``raw``:
    uint8, the whole stack, experts one after another, as ggml lays them out)."""

    raw: torch.Tensor
    ggml_type: GGMLType
    shape: tuple[int, int, int]
    name: str

    def __post_init__(self) -> None:
        n_expert, rows, cols = self.shape
        expected = n_expert * rows * row_nbytes(self.ggml_type, cols)
        if self.raw.dtype != torch.uint8 or self.raw.shape != (expected,):
            raise ValueError(
                f"{self.name}: {n_expert} experts [{rows}, {cols}] need {expected} bytes "
                f"(uint8, 1-D), found {self.raw.dtype} {tuple(self.raw.shape)}"
            )

    def expert(self, e: int) -> QuantizedMatrix:
        """Expert ``e``'s blocks (a view)."""
        n_expert, rows, cols = self.shape
        unit = self.raw.numel() // n_expert
        flat = self.raw[e * unit : (e + 1) * unit]
        return QuantizedMatrix(flat, self.ggml_type, (rows, cols), self.name)

    @functools.cached_property
    def _library(self) -> _ggml.Library | None:
        """The libggml that multiplies this stack (its type, row length and device), if any:
        asked once per stack (the store makes a stack's blocks once per commit), not per call."""
        library = _ggml.library()
        if library is None or not library.multiplies(
            self.ggml_type, self.shape[2], self.raw.device
        ):
            return None
        return library

    @property
    def ggml_multiplies(self) -> bool:
        """Whether the loaded libggml multiplies this stack (outside
        :func:`~._ggml.float_products`: :attr:`ggml` says whether it does here, now)."""
        return self._library is not None

    @property
    def ggml(self) -> bool:
        """Whether :meth:`routed` is one call into ggml here (else one product per expert)."""
        return self._library is not None and not _ggml.float_only()

    def routed(self, x: torch.Tensor, ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
        """``[N, k, rows]`` products of the routed experts (``x``, ``ids`` as :func:`grouped`):
        float32 from ggml, else each expert's ``linear`` in ``dtype``."""
        library = self._library
        if library is not None and not _ggml.float_only():
            raw = self.raw if self.raw.is_contiguous() else self.raw.contiguous()
            return library.mul_mat_id(raw, self.ggml_type, self.shape, x, ids)
        return grouped(
            lambda e, rows: self.expert(e).linear(rows, dtype=dtype), x, ids, self.shape[1]
        )


# The most stacks one ggml call multiplies by the same activations and routing (csrc/ggmlcall.c).
MAX_ROUTED = 3


def routed_all(
    stacks: list[QuantizedExperts], x: torch.Tensor, ids: torch.Tensor
) -> list[torch.Tensor] | None:
    """``[s.routed(x, ids)]`` for stacks read by the same activations and routing (a MoE
    layer's gate and up), float32: one ggml graph where ggml multiplies every one of them (the
    activations quantized once, the ids converted and checked once), the same values as one
    call each; None where that does not apply (the caller calls each)."""
    library = stacks[0]._library if stacks else None
    cols = stacks[0].shape[2] if stacks else 0
    if (
        library is None
        or _ggml.float_only()
        or len(stacks) > MAX_ROUTED
        or not hasattr(library.module, "mul_mat_ids")
        or any(s._library is not library or s.shape[2] != cols for s in stacks)
        or not all(s.raw.is_contiguous() for s in stacks)
    ):
        return None
    n_tokens, n_used = ids.shape
    per_token = 1 if x.dim() == 2 else x.shape[1]
    flat = _ggml._activations(x, cols)  # [N * per_token, cols]
    outs = [torch.empty(n_tokens, n_used, s.shape[1], dtype=torch.float32) for s in stacks]
    picked = _ggml._expert_ids(ids, min(s.shape[0] for s in stacks))
    work = sum(picked.numel() * s.raw.numel() // s.shape[0] for s in stacks)
    library.module.mul_mat_ids(
        flat.data_ptr(),
        per_token,
        n_tokens,
        picked.data_ptr(),
        n_used,
        cols,
        _ggml.threads(work),
        [
            (s.raw.data_ptr(), int(s.ggml_type), s.shape[0], s.shape[1], out.data_ptr())
            for s, out in zip(stacks, outs, strict=True)
        ],
    )
    return outs
