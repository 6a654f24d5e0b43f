"""Staging for split families: keep a family on its expert split, or move it to a new one.

A family split over pools by expert ranges (``split``) is placed as a unit. Its members keep the
split they were loaded with while their contents fit it (new contents are copied into the
original parts at commit); a member that grows gets private parts with the same ranges; when
those do not fit, the whole family moves to a new split computed for the new sizes (its pools
first, the fallback pool last), siblings copied from their current parts; when no split fits,
the plan is rejected.
"""

from __future__ import annotations

import torch

from ggufswap.ipc import Reason
from ggufswap.runtime.errors import NoPoolFits, PoolFull, Unplaceable, UnsupportedTypeError
from ggufswap.runtime.pools import Pool, first_fit
from ggufswap.runtime.split import ExpertSplit, Part, copy_range, split_of
from ggufswap.runtime.staged import (
    Content,
    StagedOp,
    StagedPlan,
    Target,
    allocate,
    content_of,
    scratch_buffer,
)
from ggufswap.runtime.store import Slot, TensorStore


class SplitPlacer:
    """Chooses targets and prepares the operations of split families for one store."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store

    def _unit_bytes(self, content: Content) -> int:
        """Buffer bytes per expert of ``content`` in the store's storage mode."""
        return (
            self.store.expert_unit(content.record)
            * self.store.buffer_spec(content.record)[1].itemsize
        )

    def targets(self, members: list[Slot], contents: dict[str, Content]) -> dict[str, Target]:
        """The split the family was loaded with: members whose content fits their original parts
        stay there; a member that grew gets private parts with the same ranges."""
        targets = {}
        for slot in members:
            per_expert = self._unit_bytes(content_of(slot, contents))
            fits = all(
                per_expert * (p.stop - p.start) <= p.buffer.nbytes for p in slot.original_parts
            )
            targets[slot.name] = Target.ORIGINAL if fits else Target.PRIVATE_HOME
        return targets

    def _needs(
        self,
        members: list[Slot],
        contents: dict[str, Content],
        split: ExpertSplit,
        targets: dict[str, Target],
    ) -> tuple[dict[Pool, int], dict[Pool, int]]:
        """Bytes each pool must allocate for ``split``, and bytes the commit releases there."""
        need: dict[Pool, int] = {}
        credit: dict[Pool, int] = {}
        for slot in members:
            content = content_of(slot, contents)
            if self._unchanged(slot, content, split, targets[slot.name]):
                continue
            if slot.parts is not slot.original_parts:
                for part in slot.parts:
                    credit[part.pool] = credit.get(part.pool, 0) + part.buffer.nbytes
            if targets[slot.name] is not Target.ORIGINAL:
                per_expert = self._unit_bytes(content)
                for pool, start, stop in split.ranges:
                    need[pool] = need.get(pool, 0) + per_expert * (stop - start)
        return need, credit

    @staticmethod
    def _unchanged(slot: Slot, content: Content, split: ExpertSplit, target: Target) -> bool:
        if content.raw is not None:
            return False
        if target is Target.ORIGINAL:
            return slot.parts is slot.original_parts
        return slot.parts is not slot.original_parts and split_of(slot.parts) == split

    def _resplit(
        self, members: list[Slot], contents: dict[str, Content], credit: dict[Pool, int]
    ) -> ExpertSplit | None:
        """A new expert split of the whole family for its new sizes: the pools of its original
        split first, then the other pools, the fallback last; every member moves."""
        pools = self.store.pools
        home = split_of(members[0].original_parts)
        order = list(dict.fromkeys(pool for pool, _, _ in home.ranges))
        order += [p for p in pools.ordered() if p not in order]
        order = [p for p in order if p is not pools.fallback] + [pools.fallback]
        freed: dict[Pool, int] = {}
        for slot in members:
            if slot.parts is not slot.original_parts:
                for part in slot.parts:
                    freed[part.pool] = freed.get(part.pool, 0) + part.buffer.nbytes
        per_expert = sum(self._unit_bytes(content_of(s, contents)) for s in members)

        def room(pool: Pool) -> int | None:
            free = pool.free
            return None if free is None else free + credit.get(pool, 0) + freed.get(pool, 0)

        return ExpertSplit.greedy(members[0].ne[-1], per_expert, order, room)

    def place(
        self,
        members: list[Slot],
        contents: dict[str, Content],
        home_targets: dict[str, Target],
        staged: StagedPlan,
        credit: dict[Pool, int],
    ) -> None:
        """Stage a split family on the first placement whose allocations all succeed
        (:func:`first_fit`, as the load and whole families): the split it was loaded with, a new
        split for its new sizes, then every expert in the fallback pool."""
        loaded = split_of(members[0].original_parts)
        fallback = self.store.pools.fallback
        candidates = [(loaded, home_targets)]
        resplit = self._resplit(members, contents, credit)
        whole = ExpertSplit(((fallback, 0, members[0].ne[-1]),))
        for split in (resplit, whole):
            if split is not None and split not in (c for c, _ in candidates):
                target = (
                    Target.PRIVATE_FALLBACK if split.pools() == {fallback} else Target.PRIVATE_HOME
                )
                candidates.append((split, {slot.name: target for slot in members}))

        def attempt(
            candidate: tuple[ExpertSplit, dict[str, Target]],
        ) -> tuple[list[StagedOp], dict[Pool, int]]:
            split, targets = candidate
            need, freed = self._needs(members, contents, split, targets)
            room = {p: credit.get(p, 0) + freed.get(p, 0) for p in {*credit, *freed}}
            for pool, n in need.items():  # the budgets first: nothing is read or decoded
                if not pool.fits(n, credit=room.get(pool, 0)):
                    raise PoolFull(pool.name, n, (pool.free or 0) + room.get(pool, 0))
            ops = [
                self._prepare(
                    slot=slot,
                    content=content_of(slot, contents),
                    split=split,
                    target=targets[slot.name],
                    staged=staged,
                    credit=room,
                )
                for slot in members
            ]
            return [op for op in ops if op is not None], freed

        try:
            _, (ops, freed) = first_fit(candidates, attempt, staged.allocated)
        except NoPoolFits as exc:
            reason = (
                f"its family's experts fit no split over the pools (loaded as "
                f"{loaded.describe()}; a family moves as a whole): {exc}"
            )
            raise Unplaceable(Reason(members[0].name, reason)) from None
        for pool, n in freed.items():
            credit[pool] = credit.get(pool, 0) + n
        staged.ops.extend(ops)

    def _prepare(
        self,
        *,
        slot: Slot,
        content: Content,
        split: ExpertSplit,
        target: Target,
        staged: StagedPlan,
        credit: dict[Pool, int],
    ) -> StagedOp | None:
        if self._unchanged(slot, content, split, target):
            if content.record != slot.record:  # same bytes, now found elsewhere
                return StagedOp(slot, content, target, parts=slot.parts)
            return None
        op = StagedOp(
            slot,
            content,
            target,
            reattach=content.fingerprint == slot.original_fingerprint
            and content.record.ggml_type == slot.original_type,
            parts=slot.original_parts,
        )
        unit, dtype = (
            self.store.expert_unit(content.record),
            self.store.buffer_spec(content.record)[1],
        )
        if target is Target.ORIGINAL:
            if slot.held != (content.fingerprint, content.record.ggml_type):
                scratches = []
                for part in slot.original_parts:
                    n = (part.stop - part.start) * unit
                    scratch = scratch_buffer((n, dtype), part.pool.device)
                    self._fill_range(scratch, slot, content, part.start, part.stop)
                    scratches.append(scratch)
                op.part_copies = tuple(scratches)
            return op
        parts = []
        for pool, start, stop in split.ranges:  # PoolFull: the family's next placement
            buffer = allocate(pool, ((stop - start) * unit, dtype), staged, credit)
            self._fill_range(buffer.tensor, slot, content, start, stop)
            parts.append(Part(buffer, start, stop))
        op.parts = tuple(parts)
        return op

    def _fill_range(
        self, dest: torch.Tensor, slot: Slot, content: Content, start: int, stop: int
    ) -> None:
        """Experts ``[start, stop)`` of ``content`` into ``dest``: new bytes decoded on
        ``dest``'s device, or copied from the slot's current parts (nothing is re-read)."""
        if content.raw is None:
            copy_range(slot.parts, self.store.expert_unit(slot.record), start, stop, dest)
            return
        try:
            self.store.encode_range_into(content.raw, content.record, start, stop, dest)
        except (UnsupportedTypeError, ValueError) as exc:
            reason = Reason(slot.name, f"cannot decode {content.record.ggml_type.name}: {exc}")
            raise Unplaceable(reason) from None
