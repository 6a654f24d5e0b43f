"""``PlannedTensor``: one tensor a writer spec implies (name, role, type, ``ne``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ggufswap.shards import ggml_types
from ggufswap.shards._roles import Role
from ggufswap.shards.ggml_types import GGMLType

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One tensor the spec implies: llama.cpp name, role, type, ``ne`` (ggml order)."""

    name: str
    role: Role
    ggml_type: GGMLQuantizationType | GGMLType
    ne: tuple[int, ...]
    block: int | None
    expert: int | None = None  # per-expert tensor (old Mixtral layout): its expert index

    @property
    def nbytes(self) -> int:
        return ggml_types.tensor_nbytes(self.ggml_type, self.ne)
