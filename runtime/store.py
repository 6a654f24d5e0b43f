"""The tensor store: every tensor of a model in a slot, placed on pools, read by the model.

Storage modes:

- ``DEQUANTIZED``: each slot holds its tensor in the compute dtype. A quant-type change keeps the
  logical shape and so the storage size; the commit is an in-place copy (``stable_pointers``) or a
  swap to a staged buffer of the same size.
- ``NATIVE``: each slot holds the raw GGUF blocks and their type; the model dequantizes on use. A
  type change changes the byte size: the tensor moves to a private buffer (``DETACHED``) in its
  home pool, or to the fallback pool (``FALLBACK_CPU``) with its whole family when the home pool is
  full. The buffer it was loaded into stays reserved, so returning to the original content always
  fits and frees the private buffer (memory back to the baseline).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from ggufswap.config import DEFAULT_DECODED_CACHE, MapShards, Storage
from ggufswap.ipc import SlotState
from ggufswap.logs import get_logger
from ggufswap.runtime.families import DerivedTensor, family_of
from ggufswap.runtime.kernels import QuantizedMatrix, decode_rows, dequantize
from ggufswap.runtime.loading import Loader, LoadJob, LoadReport, Segment, trim_heap
from ggufswap.runtime.mapping import ShardMaps
from ggufswap.runtime.placement import Placement, placement_units, plan_placement
from ggufswap.runtime.pools import Buffer, Pool, PoolSet, first_fit
from ggufswap.runtime.progress import progress_bar
from ggufswap.runtime.resident import DecodedCache, ForwardViews
from ggufswap.runtime.split import (
    ExpertSplit,
    Part,
    SplitTensor,
    encode_range,
    expert_numel,
)
from ggufswap.shards import GGMLType, ShardSet, TensorRecord

log = get_logger(__name__)

# GGML types whose bytes are already a torch dtype: read as a view when that is the compute dtype.
_PLAIN_DTYPES = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}


@dataclass(eq=False)
class Slot:
    """One tensor: its source, content fingerprint, buffers and state.

    The store's load creates slots; after that only :mod:`ggufswap.runtime.commit` changes
    them, moving ``state`` through its guarded transition. ``state`` is one of
    ``ON_ORIGINAL`` (in the buffer it was loaded into), ``DETACHED`` (a private buffer in its
    home pool: its byte size changed) or ``FALLBACK_CPU`` (a private buffer in the fallback
    pool, its home being full).

    A split slot (an MoE family split over pools at load) holds its experts in ``parts``;
    ``original_parts`` are the parts it was loaded into, reserved for its life (updated in place)
    as ``original`` is for a whole slot. Its ``original`` and ``active`` name its first original
    part, and only the split code paths read its buffers.
    """

    name: str
    ne: tuple[int, ...]
    family: str | None
    home: Pool
    original: Buffer
    original_type: GGMLType
    original_fingerprint: str
    record: TensorRecord
    fingerprint: str
    active: Buffer
    state: SlotState = SlotState.ON_ORIGINAL
    # (fingerprint, type) of the content in the original buffer: a detached tensor's original
    # buffer keeps the content it had, so returning to it needs no copy.
    held: tuple[str, GGMLType] = ("", GGMLType.F32)
    original_parts: tuple[Part, ...] = ()
    parts: tuple[Part, ...] = ()
    # Stamped by the commit that last changed the slot: the weight version it moves to (or would
    # move to, when no weight changed); 0 since the load. A state read at weight version v misses
    # at most the slots with ``changed_at > v`` (the ``state`` delta, ``control.py``).
    changed_at: int = 0

    @property
    def is_split(self) -> bool:
        return bool(self.original_parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def ggml_type(self) -> GGMLType:
        return self.record.ggml_type

    def is_original_content(self) -> bool:
        return (
            self.fingerprint == self.original_fingerprint
            and self.record.ggml_type == self.original_type
        )


class TensorStore:
    """A model's tensors in slots; implements the model's ``WeightProvider``."""

    def __init__(
        self,
        *,
        pools: PoolSet,
        storage: Storage,
        compute_dtype: torch.dtype,
        strict: bool,
        decoded_cache: int = DEFAULT_DECODED_CACHE,
        map_shards: MapShards = MapShards.OFF,
    ) -> None:
        if storage is Storage.AUTO:
            raise ValueError("storage 'auto' is resolved before the store (choose_storage)")
        self.pools = pools
        self.storage = storage
        self.compute_dtype = compute_dtype
        self.strict = strict
        self.slots: dict[str, Slot] = {}
        self.families: dict[str, tuple[str, ...]] = {}
        self.derived: dict[str, DerivedTensor] = {}
        self.derived_values: dict[str, torch.Tensor] = {}
        self.weight_version = 0
        # Native storage: dense tensors decoded on use, kept while they fit (see .resident).
        self.decoded = DecodedCache(decoded_cache if storage is Storage.NATIVE else 0)
        self._dense_cached = True  # set by load(): every dense quantized matrix fits the cache
        # Native storage: CPU tensors served from their files' pages, under read leases.
        self.maps = ShardMaps(map_shards if storage is Storage.NATIVE else MapShards.OFF)
        # Tensors out of service (their mapped bytes changed outside a commit) -> why; see
        # runtime/integrity.py. No batch runs while it is not empty.
        self.lost: dict[str, str] = {}
        # Native storage: slots' blocks, stacks and float views, made once per commit.
        self.views = ForwardViews()

    # -- the model's view ------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.slots or name in self.derived

    def weight(self, name: str) -> torch.Tensor:
        if isinstance(view := self.views.find("weight", name), torch.Tensor):
            return view  # a float view made below, until the next commit
        if name in self.derived_values:
            return self.derived_values[name]
        slot = self.slots[name]
        if slot.is_split:  # a copy on the host: per-expert readers use experts()
            return self.split_view(slot).full(self.pools.fallback.device)
        if self.storage is Storage.DEQUANTIZED:
            return slot.active.tensor.view(slot.record.shape)
        if self._is_view(slot.record):  # already compute-dtype values: nothing to keep
            view = partial(self.materialize_flat, slot.active.tensor, slot.record)
            return self.views.get("weight", name, torch.Tensor, view)
        key = (name, slot.fingerprint, int(slot.record.ggml_type))
        return self.decoded.get(key, lambda: self.materialize_flat(slot.active.tensor, slot.record))

    def experts(self, name: str) -> torch.Tensor | SplitTensor:
        """A stacked expert tensor, indexable per expert (``[e]``) wherever its parts live.

        In native storage ``[e]`` decodes only expert ``e``'s bytes (into reused scratch, see
        :mod:`.resident`): a token costs the experts it is routed to, not the experts present.
        """
        slot = self.slots.get(name)
        if slot is not None and slot.is_split:
            return self.split_view(slot)
        if slot is not None and self.storage is Storage.NATIVE and len(slot.ne) == 3:
            whole = (Part(slot.active, 0, slot.ne[-1]),)
            stack = partial(
                SplitTensor, whole, slot.record, native=True, compute_dtype=self.compute_dtype
            )
            return self.views.get("experts", name, SplitTensor, stack)
        return self.weight(name)

    def matrix(self, name: str) -> torch.Tensor | QuantizedMatrix:
        """A dense weight for ``linear``. In native storage, where a compiled kernel runs, the
        matrix's blocks (:class:`QuantizedMatrix`): a few activation rows multiply from them,
        many rows use the decoded cache's copy when every dense matrix fits the cache (decoded
        once), else a scratch decode per use. Elsewhere, the decoded tensor."""
        if isinstance(found := self.views.find("matrix", name), QuantizedMatrix):
            return found  # blocks a compiled kernel multiplies (below), until the next commit
        matrix = self.blocks(name)  # None but for a native 2-D slot
        if matrix is None or self._is_view(self.slots[name].record):
            return self.weight(name)
        if matrix.compiled:  # multiplied from its blocks whatever the numerics
            self.views.keep("matrix", name, matrix)
        return matrix if matrix.multiplies_blocks else self.weight(name)

    def blocks(self, name: str) -> QuantizedMatrix | None:
        """A 2-D tensor's GGUF blocks in native storage, whatever its type and the kernels (what
        ggml's numerics need: the type, and the bytes); None elsewhere (dequantized storage, a
        split or derived tensor)."""
        slot = self.slots.get(name)
        if slot is None or self.storage is not Storage.NATIVE or slot.is_split:
            return None
        record = slot.record
        if len(record.ne) != 2:
            return None
        raw = slot.active.tensor[: record.nbytes]
        cached = (lambda: self.weight(name)) if self._dense_cached else None
        shape = (record.ne[1], record.ne[0])
        blocks = partial(QuantizedMatrix, raw, record.ggml_type, shape, name, cached)
        return self.views.get("blocks", name, QuantizedMatrix, blocks)

    def _is_view(self, record: TensorRecord) -> bool:
        """Whether native bytes of ``record`` already are compute-dtype values (read as a view)."""
        return _PLAIN_DTYPES.get(record.ggml_type) == self.compute_dtype

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor (an embedding lookup), ``[*ids.shape, ne[0]]``. Native
        storage decodes only the rows asked for (each row is a run of whole blocks)."""
        source = self.row_blocks(name)
        if source is None:
            w = self.weight(name)
            return torch.nn.functional.embedding(ids.to(w.device), w)
        blocks, ggml_type, cols = source
        return decode_rows(blocks, ids, ggml_type, cols, dtype=self.compute_dtype)

    def row_blocks(self, name: str) -> tuple[torch.Tensor, int, int] | None:
        """``(blocks [rows, row bytes], ggml type, cols)``: where :meth:`rows` decodes a 2-D
        tensor's rows from its blocks (native storage, one piece, not a view), the blocks it
        reads them from (until the next commit: a swap changes them); None elsewhere."""
        slot = self.slots.get(name)
        if slot is None or self.storage is not Storage.NATIVE or slot.is_split:
            return None
        if len(slot.ne) != 2 or self._is_view(slot.record):
            return None
        record = slot.record
        blocks = slot.active.tensor[: record.nbytes].view(record.ne[1], -1)
        return blocks, record.ggml_type, record.ne[0]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's logical shape, from its record (nothing is read or decoded)."""
        if name in self.derived_values:
            return tuple(self.derived_values[name].shape)
        return self.slots[name].shape

    def split_view(self, slot: Slot) -> SplitTensor:
        native = self.storage is Storage.NATIVE
        return SplitTensor(slot.parts, slot.record, native=native, compute_dtype=self.compute_dtype)

    def materialize_flat(self, flat: torch.Tensor, record: TensorRecord) -> torch.Tensor:
        """The compute-dtype tensor that flat buffer contents holding ``record`` stand for (a
        view where the bytes already are that dtype, else a new decoded tensor)."""
        if self.storage is Storage.DEQUANTIZED:
            return flat.view(record.shape)
        if self._is_view(record):
            return flat[: record.nbytes].view(self.compute_dtype).view(record.shape)
        return dequantize(
            flat[: record.nbytes],
            record.ggml_type,
            record.ne,
            dtype=self.compute_dtype,
            strict=False,
        )

    # -- buffers ---------------------------------------------------------------------------

    def buffer_spec(self, record: TensorRecord) -> tuple[int, torch.dtype]:
        """``(numel, dtype)`` of the buffer that holds ``record`` in this storage mode."""
        if self.storage is Storage.DEQUANTIZED:
            return record.n_elements, self.compute_dtype
        return record.nbytes, torch.uint8

    def buffer_nbytes(self, record: TensorRecord) -> int:
        numel, dtype = self.buffer_spec(record)
        return numel * dtype.itemsize

    def encode_into(self, raw: torch.Tensor, record: TensorRecord, dest: torch.Tensor) -> None:
        """Write raw GGUF bytes (uint8, CPU) into ``dest``, a flat buffer of this storage mode.

        The bytes travel to ``dest``'s device as they are (a quarter of the float32 size or
        less) and are dequantized there, straight into ``dest``: no temporary, no second copy.
        """
        self._encode(raw, record.ggml_type, record.ne, dest)

    def _encode(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLType,
        ne: tuple[int, ...],
        dest: torch.Tensor,
    ) -> None:
        """Raw bytes of a tensor (or rows of one) of ggml shape ``ne`` into the flat ``dest``."""
        if self.storage is Storage.NATIVE:
            dest.copy_(raw)
            return
        on_device = raw.to(dest.device, non_blocking=True)
        out = dest.view(tuple(reversed(ne)))
        dequantize(on_device, ggml_type, ne, dtype=self.compute_dtype, strict=self.strict, out=out)

    def encode_range_into(
        self, raw: torch.Tensor, record: TensorRecord, start: int, stop: int, dest: torch.Tensor
    ) -> None:
        """Like :meth:`encode_into`, for experts ``[start, stop)`` of ``record`` only."""
        dtype = None if self.storage is Storage.NATIVE else self.compute_dtype
        encode_range(raw, record, start, stop, dest, dtype=dtype, strict=self.strict)

    def expert_unit(self, record: TensorRecord) -> int:
        """Buffer elements per expert of ``record`` in this storage mode."""
        return expert_numel(self.buffer_spec(record), record.ne[-1])

    def encode(self, raw: torch.Tensor, record: TensorRecord) -> torch.Tensor:
        """Raw GGUF bytes (uint8, CPU) → new flat contents of a buffer in this storage mode."""
        numel, dtype = self.buffer_spec(record)
        flat = torch.empty(numel, dtype=dtype)
        self.encode_into(raw, record, flat)
        return flat

    # -- loading ---------------------------------------------------------------------------

    def plan_placement(
        self, records: Iterable[TensorRecord], placement: Placement, n_blocks: int
    ) -> dict[str, Pool | ExpertSplit]:
        """Choose a home pool for every tensor (:func:`~ggufswap.runtime.placement.plan_placement`
        with this store's pools and buffer sizes)."""
        return plan_placement(
            records, placement, n_blocks, pools=self.pools, nbytes=self.buffer_nbytes
        )

    def load(
        self,
        shards: ShardSet,
        *,
        placement: Placement,
        n_blocks: int,
        progress: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> LoadReport:
        """Read every tensor of ``shards`` into its home pool (or its expert split).

        Each tensor is read once, in file order, straight into its buffer when that holds the
        file's bytes on the CPU, and fingerprinted in the same pass (:mod:`.loading`).
        ``on_progress(done, total)`` is told the bytes read so far (a server's ``/health``).
        """
        records = list(shards.tensors.values())
        homes = self.plan_placement(records, placement, n_blocks)
        held: dict[str, tuple[Buffer, tuple[Part, ...]]] = {}
        taken: list[Buffer] = []
        try:
            for members in placement_units(records).values():
                held.update(self._allocate_unit(members, homes[members[0].name], taken))
            jobs = [LoadJob(r, self._segments(r, *held[r.name])) for r in records]
            total = sum(r.nbytes for r in records)
            with progress_bar(total, enabled=progress, also=on_progress) as bar:
                loader = Loader(
                    decode=self._decode_rows,
                    row_slice=self._row_slice,
                    direct=self._reads_directly,
                    on_bytes=bar,
                )
                digests = {r.name: d for r, d in loader.run(jobs)}
        except BaseException:  # a failed load gives its pools back everything it took
            for buffer in taken:
                buffer.release()
            self.maps.close()
            raise
        trim_heap()
        self.maps.report()
        report = self._fill_slots(records, held, digests)
        report.seconds = loader.seconds
        dense = [r for r in records if len(r.ne) == 2 and not self._is_view(r)]
        decoded_bytes = sum(r.n_elements for r in dense) * self.compute_dtype.itemsize
        self._dense_cached = decoded_bytes <= self.decoded.budget
        self.families = {}
        for slot in self.slots.values():
            if slot.family is not None:
                self.families[slot.family] = (*self.families.get(slot.family, ()), slot.name)
        return report

    def _fill_slots(
        self,
        records: list[TensorRecord],
        held: Mapping[str, tuple[Buffer, tuple[Part, ...]]],
        digests: Mapping[str, str],
    ) -> LoadReport:
        """A slot for every loaded tensor, in its buffer (or parts) with its fingerprint; what
        was loaded where, counted."""
        report = LoadReport()
        for record in records:
            buffer, parts = held[record.name]
            digest = digests[record.name]
            self.slots[record.name] = Slot(
                name=record.name,
                ne=record.ne,
                family=family_of(record.name),
                home=buffer.pool,
                original=buffer,
                original_type=record.ggml_type,
                original_fingerprint=digest,
                record=record,
                fingerprint=digest,
                active=buffer,
                held=(digest, record.ggml_type),
                original_parts=parts,
                parts=parts,
            )
            report.tensors += 1
            report.bytes_read += record.nbytes
            for kept in [p.buffer for p in parts] or [buffer]:
                name = kept.pool.name
                report.placed[name] = report.placed.get(name, 0) + kept.nbytes
        return report

    def _allocate_unit(
        self, members: list[TensorRecord], home: Pool | ExpertSplit, taken: list[Buffer]
    ) -> dict[str, tuple[Buffer, tuple[Part, ...]]]:
        """The buffers (or expert-range parts) a family or lone tensor is loaded into: in its
        home, or, when an allocation there is refused (the budget, or the device's allocator),
        all of it in the fallback pool (:func:`first_fit`, as staging places a plan's units)."""
        fallback = self.pools.fallback
        candidates: list[Pool | ExpertSplit] = [home] if home is fallback else [home, fallback]

        def attempt(where: Pool | ExpertSplit) -> dict[str, tuple[Buffer, tuple[Part, ...]]]:
            return {r.name: self._allocate_at(r, where, taken) for r in members}

        _, placed = first_fit(candidates, attempt, taken)
        return placed

    def _allocate_at(
        self, record: TensorRecord, where: Pool | ExpertSplit, taken: list[Buffer]
    ) -> tuple[Buffer, tuple[Part, ...]]:
        """``record``'s buffer in ``where`` (appended to ``taken``), or PoolFull."""
        numel, dtype = self.buffer_spec(record)
        if isinstance(where, ExpertSplit):
            unit = self.expert_unit(record)
            parts = []
            for pool, start, stop in where.ranges:
                taken.append(pool.allocate((stop - start) * unit, dtype))
                parts.append(Part(taken[-1], start, stop))
            return parts[0].buffer, tuple(parts)
        view = self.maps.view(record) if where.device.type == "cpu" else None
        # native storage: the file's own bytes where it is mapped, else memory of our own
        taken.append(where.adopt(view) if view is not None else where.allocate(numel, dtype))
        return taken[-1], ()

    def _segments(
        self, record: TensorRecord, buffer: Buffer, parts: tuple[Part, ...]
    ) -> tuple[Segment, ...]:
        """The row ranges of ``record`` and the flat buffers that hold them."""
        n_rows = record.n_elements // record.ne[0]
        if not parts:
            return (Segment(0, n_rows, buffer.tensor, mapped=buffer.mapped),)
        rows_per_expert = n_rows // record.ne[-1]
        return tuple(
            Segment(p.start * rows_per_expert, p.stop * rows_per_expert, p.buffer.tensor)
            for p in parts
        )

    def _row_slice(self, record: TensorRecord, segment: Segment, lo: int, hi: int) -> torch.Tensor:
        """Where rows ``[lo, hi)`` of ``record`` live in ``segment``'s buffer."""
        n_rows = record.n_elements // record.ne[0]
        unit = record.nbytes // n_rows if self.storage is Storage.NATIVE else record.ne[0]
        return segment.flat[(lo - segment.start) * unit : (hi - segment.start) * unit]

    def _reads_directly(self, segment: Segment) -> bool:
        return self.storage is Storage.NATIVE and segment.flat.device.type == "cpu"

    def _decode_rows(
        self, raw: torch.Tensor, record: TensorRecord, lo: int, hi: int, dest: torch.Tensor
    ) -> None:
        """Rows ``[lo, hi)`` of raw GGUF bytes (uint8, CPU) into their slice of a buffer."""
        self._encode(raw, record.ggml_type, (record.ne[0], hi - lo), dest)

    # -- derived tensors -------------------------------------------------------------------

    def register_derived(self, derived: DerivedTensor, value: torch.Tensor | None = None) -> None:
        """Register a tensor computed from sources at load; built now unless ``value`` is given."""
        missing = [s for s in derived.sources if s not in self.slots]
        if missing:
            raise KeyError(f"derived tensor {derived.name}: unknown sources {missing}")
        if value is None:
            if derived.rebuild is None:
                raise ValueError(f"derived tensor {derived.name}: give a value or a rebuild")
            value = derived.rebuild({s: self.weight(s) for s in derived.sources})
        self.derived[derived.name] = derived
        self.derived_values[derived.name] = value

    def derived_of(self, names: Iterable[str]) -> list[DerivedTensor]:
        touched = set(names)
        return [d for d in self.derived.values() if touched.intersection(d.sources)]

    # -- reporting -------------------------------------------------------------------------

    def state_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in SlotState}
        for slot in self.slots.values():
            counts[slot.state.value] += 1
        return counts

    def loaded_table(self) -> Mapping[str, Slot]:
        return self.slots
