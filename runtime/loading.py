"""Loading a model at disk speed: each tensor read once, in file order, into where it will live.

A tensor is a run of rows (``ne[0]`` elements each, a whole number of GGUF blocks), and its
destination is one or more :class:`Segment` s: row ranges, each held in a flat buffer of the
store's storage mode (one segment for a whole tensor, one per part for an expert split). The
tensor is read in chunks of whole rows by a reader thread, which hashes each chunk while it is
still in the cache (the content fingerprint costs no second pass over the data). The reader
thread only reads (``preadv`` releases the GIL); the caller's thread hashes each chunk, and
decodes it, while the reader reads the next one:

- **direct**: when the destination holds the file's bytes on the CPU (native storage), the chunk
  is read straight into it: no temporary, no copy.
- **mapped**: when the destination *is* the file's bytes (a view of its mapping,
  :mod:`.mapping`), nothing is read or decoded: a few threads each fault a whole tensor's pages
  in (``MADV_POPULATE_READ``: from the page cache, or the disk when cold) and hash them, before
  the other tensors go through the reader thread.
- **staged**: otherwise (dequantized storage, or an accelerator pool) the chunk is read into one
  of a few reused chunk buffers, which the caller's thread decodes into the destination.

Fresh memory: a direct chunk's destination pages are faulted in by one ``madvise``
(``MADV_POPULATE_WRITE``, :func:`populate`) before the read, rather than one fault per 4 KiB page
inside ``preadv``; each tensor's file is advised ``SEQUENTIAL`` and the next chunk ``WILLNEED``,
so that a cold disk reads ahead while the current chunk is copied (``PREFAULT``, ``READAHEAD``).

Memory: besides the destinations, loading holds at most ``RING`` chunk buffers (a few MiB);
nothing grows with the model. After the load, :func:`trim_heap` hands memory freed by the
allocator back to the system (glibc otherwise keeps it in its arenas).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

import torch
import xxhash

from ggufswap.logs import get_logger
from ggufswap.runtime._libc import MADV_POPULATE_READ, MADV_POPULATE_WRITE, Libc
from ggufswap.shards import TensorRecord, open_verified, read_range

log = get_logger(__name__)

CHUNK_BYTES: Final = 8 << 20  # per read: big enough for sequential I/O, small enough for cache
# Both on by default; bench/engine.py turns them off in one of its loads to compare, same run.
PREFAULT = True  # fault each direct chunk's pages in with one madvise call before reading
READAHEAD = True  # posix_fadvise: SEQUENTIAL per tensor, WILLNEED for the next chunk
RING: Final = 3  # staged chunk buffers: one being read, one being decoded, one spare


@dataclass
class LoadReport:
    """What a store's load did: tensors, bytes read, seconds, bytes placed per pool."""

    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0  # reading and decoding, placement excluded
    placed: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of a tensor, held from the first element of ``flat``; ``mapped``
    when ``flat`` is a view of the tensor's bytes in its file's mapping (nothing to read)."""

    start: int
    stop: int
    flat: torch.Tensor
    mapped: bool = False


@dataclass(frozen=True)
class LoadJob:
    """One tensor and where its rows go."""

    record: TensorRecord
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        bounds = [(s.start, s.stop) for s in self.segments]
        starts = [0, *(stop for _, stop in bounds)]
        covered = [a for a, _ in bounds] == starts[:-1] and starts[-1] == self.n_rows
        assert covered, f"{self.record.name}: segments {bounds} do not cover [0, {self.n_rows})"

    @property
    def n_rows(self) -> int:
        return self.record.n_elements // self.record.ne[0]

    @property
    def row_bytes(self) -> int:
        return self.record.nbytes // self.n_rows


# Decodes raw rows [lo, hi) of a record (uint8, CPU) into the flat destination slice for them.
DecodeRows = Callable[[torch.Tensor, TensorRecord, int, int, torch.Tensor], None]
# Where rows [lo, hi) of a record go in a segment's flat buffer (a slice of ``segment.flat``).
RowSlice = Callable[[TensorRecord, Segment, int, int], torch.Tensor]


@dataclass(frozen=True)
class _Chunk:
    job: LoadJob
    lo: int
    hi: int
    data: memoryview  # the bytes read: in the destination (direct) or in a ring buffer
    slot: int  # ring index to hand back once decoded (-1: direct, nothing to decode)


@dataclass(frozen=True)
class _Done:
    job: LoadJob


_END: Final = object()


class Loader:
    """Reads :class:`LoadJob` s in file order and yields ``(record, fingerprint)`` as each
    tensor is complete in its destination."""

    def __init__(
        self,
        *,
        decode: DecodeRows,
        row_slice: RowSlice,
        direct: Callable[[Segment], bool],
        chunk_bytes: int | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self._decode = decode
        self._row_slice = row_slice
        self._direct = direct
        self._chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self._on_bytes = on_bytes
        self.bytes_read = 0
        self.seconds = 0.0
        self._counting = threading.Lock()

    def run(self, jobs: Sequence[LoadJob]) -> Iterator[tuple[TensorRecord, str]]:
        ordered = sorted(jobs, key=lambda j: (j.record.path, j.record.offset))
        mapped = [j for j in ordered if all(s.mapped for s in j.segments)]
        if mapped:
            started = time.perf_counter()
            try:
                yield from self._hash_mapped(mapped)
            finally:
                self.seconds += time.perf_counter() - started
            ordered = [j for j in ordered if not all(s.mapped for s in j.segments)]
        if ordered:
            yield from self._run_pipeline(ordered)

    def _hash_mapped(self, jobs: Sequence[LoadJob]) -> Iterator[tuple[TensorRecord, str]]:
        """Tensors that are views of their files' mappings: nothing to read or decode, only to
        fault in and hash, a whole tensor per task on a few threads (both calls release the
        GIL), results in file order."""
        workers = max(2, torch.get_num_threads())
        with ThreadPoolExecutor(workers, thread_name_prefix="ggufswap-hash") as pool:
            try:
                yield from pool.map(self._hash_one, jobs)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    def _hash_one(self, job: LoadJob) -> tuple[TensorRecord, str]:
        record, row_bytes = job.record, job.row_bytes
        rows_per_chunk = max(1, self._chunk_bytes // row_bytes)
        hasher = xxhash.xxh3_128()
        with open_verified(record) as fd:
            if READAHEAD:  # a cold file: the disk reads ahead of the faults
                _advise(fd, record.offset, record.nbytes, "POSIX_FADV_WILLNEED")
            for lo, hi, segment in _chunks(job, rows_per_chunk):
                target = self._row_slice(record, segment, lo, hi)
                populate(target, write=False)
                hasher.update(target.numpy().data.cast("B"))
                self._count((hi - lo) * row_bytes)
        return record, hasher.hexdigest()

    def _run_pipeline(self, ordered: Sequence[LoadJob]) -> Iterator[tuple[TensorRecord, str]]:
        largest_row = max((j.row_bytes for j in ordered), default=1)
        ring_bytes = max(self._chunk_bytes, largest_row)
        ring = [torch.empty(ring_bytes, dtype=torch.uint8) for _ in range(RING)]
        free: queue.Queue[int] = queue.Queue()
        for i in range(RING):
            free.put(i)
        out: queue.Queue[object] = queue.Queue(maxsize=4 * RING)
        stop = threading.Event()
        reader = threading.Thread(
            target=self._read_all,
            args=(ordered, ring, free, out, stop),
            name="ggufswap-loader",
            daemon=True,
        )
        started = time.perf_counter()
        reader.start()
        hasher = xxhash.xxh3_128()
        try:
            while True:
                item = out.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Chunk):
                    hasher.update(item.data)
                    if item.slot >= 0:
                        self._scatter(item.job, item.lo, item.hi, ring[item.slot])
                        free.put(item.slot)
                    continue
                assert isinstance(item, _Done)
                yield item.job.record, hasher.hexdigest()
                hasher.reset()
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting for a ring buffer or queue room
                try:
                    free.put_nowait(0)
                    out.get_nowait()
                except (queue.Full, queue.Empty):
                    pass
                reader.join(0.01)
            self.seconds += time.perf_counter() - started

    # -- reader thread ---------------------------------------------------------------------

    def _read_all(
        self,
        jobs: Sequence[LoadJob],
        ring: list[torch.Tensor],
        free: queue.Queue[int],
        out: queue.Queue[object],
        stop: threading.Event,
    ) -> None:
        try:
            for job in jobs:
                if stop.is_set():
                    return
                if not self._read_one(job, ring, free, out, stop):
                    return
                out.put(_Done(job))
            out.put(_END)
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            out.put(exc)

    def _read_one(
        self,
        job: LoadJob,
        ring: list[torch.Tensor],
        free: queue.Queue[int],
        out: queue.Queue[object],
        stop: threading.Event,
    ) -> bool:
        """Read one tensor's chunks and queue them; False when the load was stopped."""
        record, row_bytes = job.record, job.row_bytes
        rows_per_chunk = max(1, self._chunk_bytes // row_bytes)
        with open_verified(record) as fd:
            if READAHEAD:
                _advise(fd, record.offset, record.nbytes, "POSIX_FADV_SEQUENTIAL")
            for lo, hi, segment in _chunks(job, rows_per_chunk):
                nbytes = (hi - lo) * row_bytes
                if READAHEAD:  # the next chunk: the disk reads it while this one is copied
                    ahead = record.offset + hi * row_bytes
                    _advise(
                        fd,
                        ahead,
                        min(nbytes, record.offset + record.nbytes - ahead),
                        "POSIX_FADV_WILLNEED",
                    )
                if self._direct(segment):
                    slot, target = -1, self._row_slice(record, segment, lo, hi)
                else:
                    slot = free.get()
                    target = ring[slot][:nbytes]
                if stop.is_set():
                    return False
                if slot < 0 and PREFAULT:
                    populate(target)
                view = target.numpy().data.cast("B")
                read_range(fd, record, lo * row_bytes, view)
                self._count(nbytes)
                out.put(_Chunk(job, lo, hi, view, slot))
        return True

    def _count(self, nbytes: int) -> None:
        with self._counting:  # mapped tensors are counted from several threads
            self.bytes_read += nbytes
            if self._on_bytes is not None:
                self._on_bytes(nbytes)

    # -- caller's thread ---------------------------------------------------------------------

    def _scatter(self, job: LoadJob, lo: int, hi: int, data: torch.Tensor) -> None:
        """Decode staged rows ``[lo, hi)`` (at the start of ``data``) into every segment they
        overlap."""
        row_bytes = job.row_bytes
        for segment in job.segments:
            a, b = max(lo, segment.start), min(hi, segment.stop)
            if a >= b:
                continue
            raw = data[(a - lo) * row_bytes : (b - lo) * row_bytes]
            self._decode(raw, job.record, a, b, self._row_slice(job.record, segment, a, b))


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    """``posix_fadvise`` where the platform has it (advice only: errors are ignored)."""
    code = getattr(os, advice, None)
    if code is None or length <= 0:
        return
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, offset, length, code)


def _chunks(job: LoadJob, rows_per_chunk: int) -> Iterator[tuple[int, int, Segment]]:
    """Row ranges of at most ``rows_per_chunk`` rows, cut at segment boundaries, each with the
    one segment that holds it."""
    for segment in job.segments:
        for lo in range(segment.start, segment.stop, rows_per_chunk):
            yield lo, min(lo + rows_per_chunk, segment.stop), segment


_PAGE: Final = 4096


class _Populate:
    supported = True  # until the kernel says it has no such advice


def populate(t: torch.Tensor, *, write: bool = True) -> bool:
    """Fault in the pages of CPU tensor ``t``'s memory, writable (or, with ``write=False``,
    readable: a file mapping's pages are read from the page cache or the disk, not copied), with
    one ``madvise`` call (``MADV_POPULATE_WRITE``/``_READ``) instead of one page fault per 4 KiB
    page as the data is touched.

    The pages' contents are unchanged. False (and nothing done) where the kernel or C library
    has no such call, or ``t`` is small or not on the CPU. ctypes releases the GIL meanwhile.
    """
    nbytes = t.numel() * t.element_size()
    if not _Populate.supported or t.device.type != "cpu" or nbytes < 16 * _PAGE:
        return False
    try:
        libc = Libc.get()
    except OSError:
        _Populate.supported = False
        return False
    start = (t.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)  # whole pages inside the tensor
    length = (t.data_ptr() + nbytes - start) & ~(_PAGE - 1)
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    if libc.madvise(start, length, advice) != 0:
        if ctypes.get_errno() == errno.EINVAL:  # an older kernel: no such advice
            _Populate.supported = False
        return False
    return True


def trim_heap() -> bool:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``); False where
    the C library has no such call."""
    try:
        trim = Libc.get().malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
