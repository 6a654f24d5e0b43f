"""What staging prepares and a commit applies: targets, contents, staged operations and plans.

Shared by the stager (``staging``), the placement of split families (``split_staging``) and
the commit (``commit``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ggufswap.ipc import Plan, SlotState
from ggufswap.runtime.pools import Buffer, Pool
from ggufswap.runtime.split import Part
from ggufswap.runtime.store import Slot
from ggufswap.shards import TensorRecord


class Target(enum.Enum):
    """Where a tensor's content lives after the commit."""

    ORIGINAL = "original"  # the buffer it was loaded into
    PRIVATE_HOME = "private_home"  # a private buffer in its home pool
    PRIVATE_FALLBACK = "private_fallback"  # a private buffer in the fallback pool

    @property
    def state(self) -> SlotState:
        return _TARGET_STATE[self]


_TARGET_STATE = {
    Target.ORIGINAL: SlotState.ON_ORIGINAL,
    Target.PRIVATE_HOME: SlotState.DETACHED,
    Target.PRIVATE_FALLBACK: SlotState.FALLBACK_CPU,
}
STATE_TARGET = {state: target for target, state in _TARGET_STATE.items()}


@dataclass(frozen=True)
class Content:
    """What a tensor will hold: its source record and fingerprint, and staged bytes if read."""

    record: TensorRecord
    fingerprint: str
    raw: torch.Tensor | None  # the new bytes as read (uint8, CPU); None: the slot's own content


@dataclass(eq=False)
class StagedOp:
    """One slot's change, prepared: commit applies it with pointer moves or one copy."""

    slot: Slot
    content: Content
    target: Target
    new_buffer: Buffer | None = None  # becomes the active (and, for ORIGINAL, original) buffer
    copy_into_original: torch.Tensor | None = None  # in-place source for stable pointers
    # Pool pressure (no room for a second copy): the commit decodes the bytes read
    # (``content.raw``) straight into the original buffer, given this buffer.
    decode_into_original: Callable[[torch.Tensor], None] | None = None
    reattach: bool = False
    # A split slot's new active parts (its original parts, or new private ones), and the
    # contents to copy into its original parts at commit, one per part.
    parts: tuple[Part, ...] | None = None
    part_copies: tuple[torch.Tensor, ...] = ()


@dataclass(eq=False)
class StagedPlan:
    plan: Plan
    ops: list[StagedOp]
    derived: dict[str, torch.Tensor] = field(default_factory=dict)
    allocated: list[Buffer] = field(default_factory=list)
    bytes_read: int = 0

    def discard(self) -> None:
        """Free everything staging allocated (the plan will not be committed)."""
        for buffer in self.allocated:
            buffer.release()
        self.allocated.clear()


def content_of(slot: Slot, contents: dict[str, Content]) -> Content:
    """The content ``slot`` will hold: the plan's, or its own when the plan does not touch it."""
    return contents.get(slot.name) or Content(slot.record, slot.fingerprint, None)


def allocate(
    pool: Pool, spec: tuple[int, torch.dtype], staged: StagedPlan, credit: dict[Pool, int]
) -> Buffer:
    """A buffer for ``staged``, counting ``credit``: every byte its commit releases in a pool.

    ``pool.used`` already counts what staging allocated, so the credit is not spent by an
    allocation.
    """
    numel, dtype = spec
    buffer = pool.allocate(numel, dtype, credit=credit.get(pool, 0))
    staged.allocated.append(buffer)
    return buffer


def scratch_buffer(spec: tuple[int, torch.dtype], device: torch.device) -> torch.Tensor:
    """A staging scratch buffer (contents a commit copies into an original in place) on
    ``device``, or in host memory when the device's allocator refuses it (out of memory): the
    commit's copy crosses devices then, and the plan still commits."""
    numel, dtype = spec
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except RuntimeError:  # torch.OutOfMemoryError is one
        if device.type == "cpu":
            raise
        return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
