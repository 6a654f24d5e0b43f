"""Families: tensors that must share placement, and tensors derived from others.

Family membership is decided from parsed tensor names (llama.cpp's naming is the model's
metadata): the MoE expert tensors of one block, ``blk.N.ffn_{gate,up,down}_exps`` and a fused
``ffn_gate_up_exps`` (or, in old Mixtral files, one ``blk.N.ffn_{gate,up,down}.M.weight`` per
expert), form one family. When one member has to move (a fallback to host memory),
every member moves in the same commit.

Derived tensors are built at load time from source tensors (a fused or pre-scaled weight). Each
is registered with the function that rebuilds it; a plan that changes a source of a derived
tensor without a rebuild function is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import torch

_EXPERT_TENSOR: Final = re.compile(
    r"^blk\.(?P<block>\d+)\.ffn_(?:gate|up|down|gate_up)_exps\.(?:weight|bias|scale)$"
)
# Old Mixtral files hold one tensor per expert, blk.N.ffn_{gate,up,down}.M.weight: the same family.
_PER_EXPERT_TENSOR: Final = re.compile(
    r"^blk\.(?P<block>\d+)\.ffn_(?:gate|up|down)\.(?P<expert>\d+)\.weight$"
)
_BLOCK: Final = re.compile(r"^blk\.(?P<block>\d+)\.")


def block_of(name: str) -> int | None:
    """The transformer block a tensor belongs to, or None for model-level tensors."""
    match = _BLOCK.match(name)
    return int(match["block"]) if match else None


def family_of(name: str) -> str | None:
    """The placement family of a tensor (``blk.N.ffn_exps``), or None if it stands alone. The
    per-expert tensors of an old Mixtral file (``blk.N.ffn_gate.M.weight``) belong to their
    block's family as the stacked ones do."""
    match = _EXPERT_TENSOR.match(name) or _PER_EXPERT_TENSOR.match(name)
    return f"blk.{match['block']}.ffn_exps" if match else None


def expert_of(name: str) -> int | None:
    """The expert index of a per-expert tensor (``blk.N.ffn_up.M.weight`` -> M), else None."""
    match = _PER_EXPERT_TENSOR.match(name)
    return int(match["expert"]) if match else None


def group_families(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Family name → its member tensor names (sorted)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        family = family_of(name)
        if family is not None:
            groups.setdefault(family, []).append(name)
    return {family: tuple(sorted(members)) for family, members in groups.items()}


Rebuild = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class DerivedTensor:
    """A tensor computed at load from ``sources``; ``rebuild=None`` means it cannot be rebuilt."""

    name: str
    sources: tuple[str, ...]
    rebuild: Rebuild | None
    why_not: str = "no rebuild function was registered"
