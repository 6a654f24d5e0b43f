"""Staging a plan off the critical path, for a commit between two batches.

Staging (background worker) reads each job's bytes with identity checks, verifies the content
fingerprint, encodes the bytes for the storage mode, decides where every affected tensor will live
(its family included) and fills new buffers. Nothing the model reads is touched: the result, a
:class:`StagedPlan`, is applied by ``commit`` at a batch boundary.

Families split over pools by expert ranges are placed by ``split_staging``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ggufswap.ipc import Job, Plan, Reason
from ggufswap.runtime.errors import (
    NoPoolFits,
    PoolFull,
    StaleJob,
    Unplaceable,
    UnsupportedTypeError,
)
from ggufswap.runtime.pools import Pool, first_fit
from ggufswap.runtime.split_staging import SplitPlacer
from ggufswap.runtime.staged import (
    STATE_TARGET,
    Content,
    StagedOp,
    StagedPlan,
    Target,
    allocate,
    content_of,
    scratch_buffer,
)
from ggufswap.runtime.store import Slot, TensorStore
from ggufswap.shards import FileChangedError, ShardError, TensorRecord, fingerprint_bytes
from ggufswap.shards.data import read_tensor_bytes


def read_job(job: Job) -> Content:
    """Read a job's bytes (identity checked before and after) and verify its fingerprint."""
    record = job.source
    raw = torch.empty(record.nbytes, dtype=torch.uint8)
    try:
        read_tensor_bytes(record, raw.numpy().data)
    except (FileChangedError, ShardError) as exc:
        raise StaleJob(Reason(record.name, f"stale: {exc.detail}", stale=True)) from None
    digest = fingerprint_bytes(raw.numpy().data)
    if job.fingerprint is not None and digest != job.fingerprint:
        raise StaleJob(
            Reason(
                record.name,
                f"stale: content fingerprint {digest} differs from the plan's {job.fingerprint}",
                stale=True,
            )
        )
    return Content(record=record, fingerprint=digest, raw=raw)


class Stager:
    """Turns a validated plan into a :class:`StagedPlan` for one store."""

    def __init__(self, store: TensorStore, *, stable_pointers: Callable[[Pool], bool]) -> None:
        self.store = store
        self.stable_pointers = stable_pointers
        self._split = SplitPlacer(store)

    def stage(self, plan: Plan) -> StagedPlan:
        store = self.store
        staged = StagedPlan(plan=plan, ops=[])
        contents: dict[str, Content] = {}
        for job in plan.jobs:
            slot = store.slots[job.name]
            if job.fingerprint is not None and self._same_content(
                slot, job.source, job.fingerprint
            ):
                contents[job.name] = Content(job.source, job.fingerprint, None)
                continue
            content = read_job(job)
            staged.bytes_read += job.source.nbytes
            if self._same_content(slot, content.record, content.fingerprint):
                contents[job.name] = Content(content.record, content.fingerprint, None)
            else:
                contents[job.name] = content
        try:
            self._place(staged, contents)
            self._rebuild_derived(staged, contents)
        except BaseException:
            staged.discard()
            raise
        return staged

    @staticmethod
    def _same_content(slot: Slot, record: TensorRecord, digest: str) -> bool:
        return digest == slot.fingerprint and record.ggml_type == slot.record.ggml_type

    # -- placement -------------------------------------------------------------------------

    def _units(self, names: list[str]) -> list[tuple[str, ...]]:
        """Placement units touched by the plan: whole families, or single tensors."""
        units: dict[str, tuple[str, ...]] = {}
        for name in names:
            family = self.store.slots[name].family
            if family is None:
                units[name] = (name,)
            else:
                units[family] = self.store.families[family]
        return list(units.values())

    def _targets(
        self, members: list[Slot], contents: dict[str, Content], fallback: bool
    ) -> dict[str, Target]:
        targets: dict[str, Target] = {}
        for slot in members:
            content = content_of(slot, contents)
            if fallback and slot.home is not self.store.pools.fallback:
                targets[slot.name] = Target.PRIVATE_FALLBACK
            elif self.store.buffer_nbytes(content.record) <= slot.original.nbytes:
                # Content that fits the buffer it was loaded into stays there (a smaller type
                # in native storage too): no allocation, and the buffer keeps its size.
                targets[slot.name] = Target.ORIGINAL
            else:
                targets[slot.name] = Target.PRIVATE_HOME
        return targets

    def _needs(
        self, members: list[Slot], contents: dict[str, Content], targets: dict[str, Target]
    ) -> tuple[dict[Pool, int], dict[Pool, int]]:
        """Bytes each pool must allocate, and bytes the commit will release there."""
        need: dict[Pool, int] = {}
        credit: dict[Pool, int] = {}
        for slot in members:
            target = targets[slot.name]
            current = STATE_TARGET[slot.state]
            changed = slot.name in contents and contents[slot.name].raw is not None
            if target is current and not changed:
                continue
            if current is not Target.ORIGINAL:
                credit[slot.active.pool] = credit.get(slot.active.pool, 0) + slot.active.nbytes
            if target is not Target.ORIGINAL:
                pool = self._pool_for(slot, target)
                nbytes = self.store.buffer_nbytes(content_of(slot, contents).record)
                need[pool] = need.get(pool, 0) + nbytes
        return need, credit

    def _pool_for(self, slot: Slot, target: Target) -> Pool:
        return self.store.pools.fallback if target is Target.PRIVATE_FALLBACK else slot.home

    def _place(self, staged: StagedPlan, contents: dict[str, Content]) -> None:
        units = self._units(list(contents))
        plans: list[tuple[list[Slot], dict[str, Target]]] = []
        for names in units:
            members = [self.store.slots[n] for n in names]
            if members[0].is_split:
                targets = self._split.targets(members, contents)
            else:
                targets = self._targets(members, contents, fallback=False)
            plans.append((members, targets))
        # Units whose members all return to their original buffers go first: the memory they
        # free is credit for the allocations of the others.
        plans.sort(key=lambda mt: not all(t is Target.ORIGINAL for t in mt[1].values()))
        credit: dict[Pool, int] = {}
        for members, home_targets in plans:
            if members[0].is_split:
                self._split.place(members, contents, home_targets, staged, credit)
            else:
                self._place_unit(members, contents, home_targets, staged, credit)
        staged.ops.sort(key=lambda op: not op.reattach)

    def _place_unit(
        self,
        members: list[Slot],
        contents: dict[str, Content],
        home_targets: dict[str, Target],
        staged: StagedPlan,
        credit: dict[Pool, int],
    ) -> None:
        """Stage a family (or lone tensor) where it lives, or, when its home refuses an
        allocation (the budget, or the device's allocator: CUDA out of memory), all of it in the
        fallback pool: :func:`first_fit`, the mechanism the load places units with."""
        candidates = [home_targets]
        if any(slot.home is not self.store.pools.fallback for slot in members):
            candidates.append(self._targets(members, contents, fallback=True))

        def attempt(targets: dict[str, Target]) -> tuple[list[StagedOp], dict[Pool, int]]:
            need, freed = self._needs(members, contents, targets)
            room = {p: credit.get(p, 0) + freed.get(p, 0) for p in {*credit, *freed}}
            for pool, n in need.items():  # the budgets first: nothing is read or decoded
                if not pool.fits(n, credit=room.get(pool, 0)):
                    raise PoolFull(pool.name, n, (pool.free or 0) + room.get(pool, 0))
            ops = [
                self._prepare(slot, content_of(slot, contents), targets[slot.name], staged, room)
                for slot in members
            ]
            return [op for op in ops if op is not None], freed

        try:
            _, (ops, freed) = first_fit(candidates, attempt, staged.allocated)
        except NoPoolFits as exc:
            reason = f"{exc} (a family falls back as a whole)"
            raise Unplaceable(Reason(members[0].name, reason)) from None
        for pool, n in freed.items():
            credit[pool] = credit.get(pool, 0) + n
        staged.ops.extend(ops)

    def _prepare(
        self,
        slot: Slot,
        content: Content,
        target: Target,
        staged: StagedPlan,
        credit: dict[Pool, int],
    ) -> StagedOp | None:
        current = STATE_TARGET[slot.state]
        changed = content.raw is not None
        spec = self.store.buffer_spec(content.record)
        if target is current and not changed:
            if content.record != slot.record:  # same bytes, now found elsewhere
                return StagedOp(slot, content, target)
            return None
        op = StagedOp(
            slot,
            content,
            target,
            reattach=content.fingerprint == slot.original_fingerprint
            and content.record.ggml_type == slot.original_type,
        )
        if target is Target.ORIGINAL:
            if slot.held == (content.fingerprint, content.record.ggml_type):
                return op  # the original buffer still holds this content: a pointer move
            if self.stable_pointers(slot.home):
                op.copy_into_original = self._scratch(slot, content, spec)
            else:
                try:
                    # The swapped-in buffer keeps the original's size: returning to the original
                    # content must always fit, and memory stays at its baseline. It is staged
                    # beside the original only where the pool holds both until the commit
                    # (no credit: the original is released only then).
                    original = slot.original.tensor
                    op.new_buffer = allocate(
                        slot.home, (original.numel(), original.dtype), staged, {}
                    )
                    self._fill(op.new_buffer.tensor[: spec[0]], slot, content)
                except PoolFull:
                    # Pool pressure: no second copy. The commit decodes the bytes read straight
                    # into the original buffer, whose original content is given up: a return
                    # to it re-reads the file (``held`` no longer matches).
                    op.decode_into_original = self._decoder(slot, content, spec)
            return op
        # PoolFull from here: the unit's next candidate (``_place_unit``)
        op.new_buffer = allocate(self._pool_for(slot, target), spec, staged, credit)
        self._fill(op.new_buffer.tensor, slot, content)
        return op

    def _fill(self, dest: torch.Tensor, slot: Slot, content: Content) -> None:
        """Write ``content`` into ``dest``: new bytes decoded in place on ``dest``'s device, or
        the slot's current contents (a placement change re-reads nothing)."""
        if content.raw is None:
            # A buffer may be larger than the content it holds (a smaller native type that
            # stayed in its original buffer): copy the content's part.
            dest.copy_(slot.active.tensor[: dest.numel()])
            return
        try:
            self.store.encode_into(content.raw, content.record, dest)
        except (UnsupportedTypeError, ValueError) as exc:
            reason = Reason(slot.name, f"cannot decode {content.record.ggml_type.name}: {exc}")
            raise Unplaceable(reason) from None

    def _decoder(
        self, slot: Slot, content: Content, spec: tuple[int, torch.dtype]
    ) -> Callable[[torch.Tensor], None]:
        """What the commit runs to decode ``content`` into the slot's original buffer. The type
        was checked decodable by validation; the bytes are kept by ``content`` until then."""
        assert content.raw is not None, f"{slot.name}: only new bytes are decoded at commit"

        def decode(dest: torch.Tensor) -> None:
            self._fill(dest[: spec[0]], slot, content)

        return decode

    def _scratch(self, slot: Slot, content: Content, spec: tuple[int, torch.dtype]) -> torch.Tensor:
        """Staged contents on the home device, copied into the original buffer at commit (in
        host memory when the device has no room for them: the commit copies across)."""
        scratch = scratch_buffer(spec, slot.home.device)
        self._fill(scratch, slot, content)
        return scratch

    # -- derived tensors -------------------------------------------------------------------

    def _rebuild_derived(self, staged: StagedPlan, contents: dict[str, Content]) -> None:
        # Only sources whose bytes change: a job that finds the content it already has (a file
        # re-written identically, or moved) leaves its derived tensors as they are.
        changed = [name for name, content in contents.items() if content.raw is not None]
        for derived in self.store.derived_of(changed):
            assert derived.rebuild is not None, "validation refuses unrebuildable derived tensors"
            inputs: dict[str, torch.Tensor] = {}
            for source in derived.sources:
                content = contents.get(source)
                if content is not None and content.raw is not None:
                    flat = self.store.encode(content.raw, content.record)
                    inputs[source] = self.store.materialize_flat(flat, content.record)
                else:
                    inputs[source] = self.store.weight(source)
            staged.derived[derived.name] = derived.rebuild(inputs)
