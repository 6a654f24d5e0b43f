"""Commit: the one place that changes what the model reads, between two batches.

The store's load creates the slots; staging (``staging``, ``split_staging``) prepares every
change of a plan off the critical path without touching them. :func:`commit` (inference thread,
at a batch boundary) applies a staged plan, and is the only code that changes a slot, a derived
tensor or the store's ``weight_version`` after the load:

1. every slot's move is checked first (:func:`check_move`): the state must be one the slot's
   state may go to (``_MOVES``), and the slot's buffers after the commit must be where that
   state says they are. A bug raises ``SlotStateError`` with the model as it was;
2. every slot the plan touches is stamped ``changed_at = weight_version + 1`` (the version this
   commit moves to, or would: a byte-identical source that only moved changes the slot's record
   but no weight), before any of it changes, so a ``state`` read at the old version can tell it
   missed the slot (the ``since`` delta of ``control.py``);
3. pointer moves, or in-place copies of staged contents where pointers stay stable (CUDA
   graphs); each slot takes its new source record, fingerprint and state;
4. derived tensors take the values staging rebuilt;
5. ``weight_version + 1`` when anything the model reads changed.

Every operation was prepared and checked by staging, so a commit cannot fail half-way on bad
input. The buffers the plan replaced are returned, for the caller to release after the commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ggufswap.ipc import SlotState, TensorFallbackEvent, TensorReattachedEvent
from ggufswap.ipc.bodies import LOST_FINGERPRINT
from ggufswap.runtime.errors import SlotStateError
from ggufswap.runtime.pools import Buffer, Pool
from ggufswap.runtime.split import Part
from ggufswap.runtime.staged import StagedOp, StagedPlan, Target
from ggufswap.runtime.store import Slot, TensorStore

# Every state reaches every state, each move for a reason of its own:
#   → ON_ORIGINAL   the content fits the buffer it was loaded into (from a private buffer: a
#                   reattachment, the private buffer freed);
#   → DETACHED      it grew past that buffer, and its home pool has room for a private one;
#   → FALLBACK_CPU  its home pool is full: its whole family moves to the fallback pool;
# and staying is a content change in place or into a new private buffer. What each state
# demands of the slot's buffers is checked by ``_mismatch``.
_MOVES: Final[dict[SlotState, frozenset[SlotState]]] = {
    SlotState.ON_ORIGINAL: frozenset(SlotState),
    SlotState.DETACHED: frozenset(SlotState),
    SlotState.FALLBACK_CPU: frozenset(SlotState),
}

TensorEvent = TensorFallbackEvent | TensorReattachedEvent


@dataclass(frozen=True)
class Applied:
    """What a commit did: the version the model now reads, the tensors whose bytes changed, the
    buffers the plan replaced (to release) and the tensor events to report."""

    weight_version: int
    changed: tuple[str, ...]
    retired: tuple[Buffer, ...]
    events: tuple[TensorEvent, ...]


@dataclass(frozen=True)
class _After:
    """A slot's buffers once its op is applied."""

    active: Buffer
    original: Buffer
    parts: tuple[Part, ...]


def commit(store: TensorStore, staged: StagedPlan) -> Applied:
    """Apply a staged plan (inference thread, between two batches)."""
    fallback = store.pools.fallback
    for op in staged.ops:
        check_move(op, fallback)
    stamp = store.weight_version + 1
    for op in staged.ops:
        op.slot.changed_at = stamp
    retired: list[Buffer] = []
    for op in staged.ops:
        retired.extend(_apply_split(op) if op.parts is not None else _apply_whole(op, store))
    store.derived_values.update(staged.derived)
    store.views.clear()  # the buffers a forward read may have changed
    staged.allocated.clear()  # now owned by the slots
    changed = tuple(op.slot.name for op in staged.ops if op.content.raw is not None)
    moved = any(
        op.new_buffer is not None
        or op.copy_into_original is not None
        or op.decode_into_original is not None
        or op.parts is not None
        for op in staged.ops
    )
    if changed or staged.derived or moved:
        store.weight_version += 1
    return Applied(store.weight_version, changed, tuple(retired), _events(staged, fallback))


def distrust_original(slot: Slot) -> None:
    """The mapped pages of ``slot``'s original buffer changed outside a commit: a later return to
    the original content is staged from the file again, never reattached to those pages."""
    slot.held = ("", slot.held[1])


def take_out_of_service(store: TensorStore, slot: Slot) -> None:
    """``slot``'s served bytes changed outside a commit (runtime/integrity.py): its fingerprint
    reads 'lost', in the next ``state`` delta, until a commit restores it."""
    slot.fingerprint = LOST_FINGERPRINT
    slot.changed_at = store.weight_version + 1


def check_move(op: StagedOp, fallback: Pool) -> None:
    """Raise ``SlotStateError`` unless ``op`` moves its slot to a state it may go to, with its
    buffers where that state says (naming the tensor, both states and what is wrong)."""
    slot, to = op.slot, op.target.state
    if to not in _MOVES[slot.state]:
        why: str | None = "a slot never makes this move"
    else:
        why = _mismatch(slot, _after(op), to, fallback)
    if why is not None:
        raise SlotStateError(
            f"tensor {slot.name}: cannot go from {slot.state.name} to {to.name}: {why}"
        )


def _after(op: StagedOp) -> _After:
    slot = op.slot
    if op.parts is not None:
        return _After(slot.active, slot.original, op.parts)
    original = slot.original
    if op.target is Target.ORIGINAL and op.new_buffer is not None:
        original = op.new_buffer
    if op.target is Target.ORIGINAL:
        active = original
    else:
        active = op.new_buffer if op.new_buffer is not None else slot.active
    return _After(active, original, slot.parts)


def _mismatch(slot: Slot, after: _After, to: SlotState, fallback: Pool) -> str | None:
    """What is wrong with ``slot`` in state ``to`` holding ``after``; None when nothing is."""
    if slot.is_split:
        on_original = after.parts is slot.original_parts
        pools = sorted({part.pool.name for part in after.parts})
        if to is SlotState.ON_ORIGINAL:
            return None if on_original else f"its parts are private ones, in pools {pools}"
        if on_original:
            return "its parts are still the ones it was loaded into"
        if to is SlotState.FALLBACK_CPU and pools != [fallback.name]:
            return f"its parts are in pools {pools}, not only the fallback pool {fallback.name!r}"
        return None
    pool = after.active.pool
    if to is SlotState.ON_ORIGINAL:
        on_original = after.active is after.original
        return None if on_original else f"its buffer is a private one, in pool {pool.name!r}"
    if after.active is after.original:
        return "its buffer is still the one it was loaded into"
    if to is SlotState.DETACHED and pool is not slot.home:
        return f"its private buffer is in pool {pool.name!r}, not its home {slot.home.name!r}"
    if to is SlotState.FALLBACK_CPU and (pool is not fallback or slot.home is fallback):
        return (
            f"its private buffer is in pool {pool.name!r} and its home is "
            f"{slot.home.name!r}; a fallback is a move from a home pool to {fallback.name!r}"
        )
    return None


def _apply_whole(op: StagedOp, store: TensorStore) -> list[Buffer]:
    """Apply one whole slot's op; returns the buffers it replaced. A write into the original
    in place holds off a move of the shard it may be mapped from (``store.maps.writing``)."""
    slot = op.slot
    release: list[Buffer] = []
    previous, old_original = slot.active, slot.original
    if op.target is Target.ORIGINAL:
        if op.new_buffer is not None:
            release.append(old_original)
            slot.original = op.new_buffer
            slot.held = (op.content.fingerprint, op.content.record.ggml_type)
        elif op.copy_into_original is not None:
            src = op.copy_into_original
            with store.maps.writing(slot.original.tensor):
                slot.original.tensor[: src.numel()].copy_(src)
            slot.held = (op.content.fingerprint, op.content.record.ggml_type)
        elif op.decode_into_original is not None:  # pool pressure: decoded in place
            with store.maps.writing(slot.original.tensor):
                op.decode_into_original(slot.original.tensor)
            slot.held = (op.content.fingerprint, op.content.record.ggml_type)
        slot.active = slot.original
    elif op.new_buffer is not None:
        slot.active = op.new_buffer
    if previous is not old_original and previous is not slot.active:
        release.append(previous)
    _take_content(op)
    return release


def _apply_split(op: StagedOp) -> list[Buffer]:
    """Apply one split slot's op; returns the private parts it replaced."""
    slot, parts = op.slot, op.parts
    assert parts is not None, f"{slot.name}: not a split op"
    if op.part_copies:
        for part, src in zip(slot.original_parts, op.part_copies, strict=True):
            part.buffer.tensor[: src.numel()].copy_(src)
        slot.held = (op.content.fingerprint, op.content.record.ggml_type)
    replaced = slot.parts
    slot.parts = parts
    _take_content(op)
    if replaced is slot.original_parts or replaced is parts:
        return []
    return [part.buffer for part in replaced]


def _take_content(op: StagedOp) -> None:
    """The slot's new source, fingerprint and state (its move was checked by ``check_move``)."""
    slot = op.slot
    slot.record = op.content.record
    slot.fingerprint = op.content.fingerprint
    slot.state = op.target.state


def _events(staged: StagedPlan, fallback: Pool) -> tuple[TensorEvent, ...]:
    events: list[TensorEvent] = []
    for op in staged.ops:
        if op.target.state is SlotState.FALLBACK_CPU:
            events.append(TensorFallbackEvent(tensor=op.slot.name, pool=fallback.name))
        elif op.reattach and op.target.state is SlotState.ON_ORIGINAL:
            events.append(TensorReattachedEvent(tensor=op.slot.name))
    return tuple(events)
