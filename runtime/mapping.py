"""Native weights served from the shard files' own pages: private mappings under read leases.

With ``runtime.map_shards``, a native-storage load does not copy a CPU tensor's bytes into memory
of its own: the tensor is a view of its shard file, mapped ``MAP_PRIVATE``. A warm load then
costs what hashing the page cache costs (no new memory is filled), and the model lives in memory
once, as page cache, at its GGUF size, as llama.cpp's ``mmap`` does.

A mapping shows whatever the file holds, so a writer that rewrites a shard in place would change
the weights being served under the runtime, outside any commit. That is what the read lease
prevents (:mod:`ggufswap.shards.leases`): the kernel grants it only while no one has the file open
for writing, and from then on an ``open`` for writing or a truncation blocks until the runtime
gives the lease up. When that happens (a ``SIGIO``, or the watcher thread's poll every
``POLL_S``) the runtime first moves the file's pages into anonymous memory at the same addresses
(a copy, then ``mremap`` over the mapping: the tensors' pointers and contents stay as they are,
and batches keep running meanwhile), then releases the lease; the writer proceeds, and the agent
plans its new bytes like any other change. A shard replaced by rename (the sweep, ``requant``)
needs none of this: the mapping keeps the old file's pages until no tensor uses them.

The copy must finish within ``/proc/sys/fs/lease-break-time`` (45 s by default), after which the
kernel lets the writer in regardless: a 2.13 GB shard moved in 2.4-2.8 s on the development VM
under load, so shards over ~30 GB need a larger sysctl there (docs/operations.md).

Where the lease cannot be taken (a file owned by another user without ``CAP_LEASE``, a file
system without leases such as NFS or FUSE, a writer holding the file open at load, a process
whose ``SIGIO`` cannot be handled), ``auto`` copies that file as before and says why, and ``true``
refuses to load.

What the lease cannot stop, the watcher detects (issue 28): a lease the kernel broke before the
move ended (the process stopped, or a move slower than ``fs.lease-break-time``), and a file
truncated under its mapping by an ``open(O_RDONLY | O_TRUNC)``, which breaks no read lease (every
access past the new end would raise ``SIGBUS``: the C guard ``ggufswap.runtime._sigbus`` maps
zero pages there instead, and without it nothing is mapped). Such a file is reported
(:meth:`ShardMaps.take_compromised`); at the next batch boundary the store re-hashes the tensors
it serves and takes those whose bytes changed out of service (``runtime/integrity.py``).
A pass of the watcher older than ``fs.lease-break-time`` (the process was stopped) is re-run
by the inference thread before its next batch, and a batch that ran meanwhile is dropped
(``HotSwapRuntime.batch_intact``). ``docs/reliability.md`` says what this guarantees.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

import torch

from ggufswap.config import MapShards
from ggufswap.ipc.supervisor import Supervised
from ggufswap.logs import get_logger
from ggufswap.runtime._libc import MAP_FAILED, Libc
from ggufswap.runtime._pages import (
    NO_GUARD,
    guard_faults,
    guard_range,
    guard_suspects,
    move_to_anonymous,
    raise_descriptor_limit,
    reinstall_guard,
    sigbus_guard,
    unguard,
)
from ggufswap.runtime.errors import MapRefused
from ggufswap.shards import FileIdentity, TensorRecord, leases

log = get_logger(__name__)

POLL_S: Final = 0.1  # how often held leases are looked at
# A lease can be broken by the kernel only after a writer waited fs.lease-break-time without a
# pass of the watcher: a pass older than that, less this margin, may have missed one.
STALE_MARGIN_S: Final = 0.5


@dataclass(eq=False)
class _Mapped:
    """One shard file's mapping, and the descriptor that holds its lease."""

    path: str
    fd: int
    region: weakref.ref[ctypes.Array[ctypes.c_char]]  # the bytes; tensors view (and hold) it
    address: int
    length: int
    lock: threading.RLock = field(default_factory=threading.RLock)  # the finalizer may re-enter
    closed: bool = False  # the lease is given up (moved to anonymous memory, or unmapped)
    move_failed: bool = False  # a move failed (no memory); it is retried each poll
    guard_entry: int = -1  # its range in the SIGBUS guard (-1: none)


@dataclass(frozen=True)
class Compromised:
    """A mapped file whose bytes may have changed outside any commit: where it was mapped
    (its tensors' buffers lie in ``[address, address + length)``) and why."""

    path: str
    address: int
    length: int
    why: str


class ShardMaps:
    """The mapped shard files of one store, and the thread that keeps writers off them.

    A file stays mapped, and leased, while any tensor views it: its region is unmapped and its
    lease given up when the last one is gone (a swap released the buffer, the store was
    dropped). One descriptor per mapped file holds the lease.
    """

    def __init__(self, policy: MapShards) -> None:
        self.policy = policy
        self.refused: dict[str, str] = {}  # path -> why it is copied instead (policy auto)
        self.moved = 0  # files moved to anonymous memory because a writer came
        self.compromised: dict[str, str] = {}  # path -> why its bytes may have changed
        self.reported = 0  # files reported compromised, ever (a batch compares it)
        self._reports: list[Compromised] = []  # not yet taken by the store
        # When the last complete pass began: every lease was intact at or after this time (a
        # pass stopped after it checked a file, and resumed, vouches for nothing later).
        self.last_pass = time.monotonic()
        self._break_time_s = leases.lease_break_time()
        self._break_time_at = time.monotonic()
        self._files: dict[str, _Mapped] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Supervised | None = None
        _ALL_MAPS.add(self)

    @property
    def mapped_files(self) -> int:
        """Files whose tensors are served from their pages now (not moved, not unmapped)."""
        with self._lock:
            return sum(not f.closed for f in self._files.values())

    def view(self, record: TensorRecord) -> torch.Tensor | None:
        """``record``'s bytes as a uint8 view of its file's mapping; None where its file is
        copied instead (the policy is ``false``, or ``auto`` and the file cannot be mapped)."""
        if self.policy is MapShards.OFF or record.path in self.refused:
            return None
        with self._lock:
            mapped = self._files.get(record.path)
        region = mapped.region() if mapped is not None and not mapped.closed else None
        if region is None:
            region = self._map(record)
            if region is None:
                return None
        return torch.frombuffer(
            region, dtype=torch.uint8, count=record.nbytes, offset=record.offset
        )

    @contextlib.contextmanager
    def writing(self, tensor: torch.Tensor) -> Iterator[None]:
        """Around a write into a buffer that may be a view of a mapping (a commit copying or
        decoding into an original in place): a move of that file cannot run meanwhile, so the
        write lands either before the move's copy (and is copied) or in the moved memory."""
        address = tensor.data_ptr()
        with self._lock:
            mapped = next(
                (f for f in self._files.values() if f.address <= address < f.address + f.length),
                None,
            )
        if mapped is None:
            yield
            return
        with mapped.lock:
            yield

    def snapshot(self) -> dict[str, object]:
        """For status: the policy, files served from mappings now, files copied at load (with
        one reason), files moved out because a writer came."""
        return {
            "policy": self.policy.value,
            "mapped": self.mapped_files,
            "copied": len(self.refused),
            "copied_why": next(iter(self.refused.values()), None),
            "moved": self.moved,
            "compromised": len(self.compromised),
            "compromised_why": dict(list(self.compromised.items())[:10]),
            "watcher": self._thread.status() if self._thread is not None else None,
        }

    def report(self) -> None:
        """One log line for a load: how many files are mapped, how many copied and why."""
        if self.policy is MapShards.OFF:
            return
        reasons = sorted(set(self.refused.values()))
        emit = log.warning if self.refused else log.info
        emit(
            "load.mapped",
            mapped=self.mapped_files,
            copied=len(self.refused),
            why=reasons[:3] or None,
            example=next(iter(self.refused), None),
        )

    def close(self) -> None:
        """The runtime is closing. Files whose tensors are still held (a host keeping the
        runtime or its model) stay mapped and leased, so the watcher keeps moving them for
        writers until the last one is unmapped or moved; then it ends."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and not self.mapped_files:
            self._thread.join(timeout=10 * POLL_S)

    # -- mapping ---------------------------------------------------------------------------

    def _map(self, record: TensorRecord) -> ctypes.Array[ctypes.c_char] | None:
        """Map ``record``'s file under a lease; None (policy ``auto``) where it cannot be."""
        if not self._files and not self.refused:
            raise_descriptor_limit()
        why = NO_GUARD if sigbus_guard() is None else leases.guard_sigio()
        region = None
        if why is None:
            region, why = self._map_file(record)
        if region is not None:
            self._start()
            return region
        if self.policy is MapShards.ON:
            raise MapRefused(f"{record.path}: cannot serve its tensors from a mapping: {why}")
        self.refused[record.path] = why or "?"
        return None

    def _map_file(
        self, record: TensorRecord
    ) -> tuple[ctypes.Array[ctypes.c_char] | None, str | None]:
        try:
            fd = os.open(record.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            return None, f"it cannot be opened ({exc.strerror})"
        try:
            why = leases.take_read_lease(fd)
            leased = why is None
            if leased and FileIdentity.of_fd(fd) != record.identity:
                why = "it changed since its header was read"
            if why is None:
                length = record.identity.size
                prot = mmap.PROT_READ | mmap.PROT_WRITE  # private: a write would copy the page
                address = Libc.get().mmap(None, length, prot, mmap.MAP_PRIVATE, fd, 0)
                if address in (None, MAP_FAILED):
                    why = f"mmap failed ({os.strerror(ctypes.get_errno())})"
                else:
                    region = (ctypes.c_char * length).from_address(address)
                    mapped = _Mapped(record.path, fd, weakref.ref(region), address, length)
                    mapped.guard_entry = _guard(mapped)
                    # Not at exit: threads may still read the tensors; the kernel unmaps last.
                    weakref.finalize(region, self._unmap, mapped).atexit = False
                    with self._lock:
                        self._files[record.path] = mapped
                    return region, None
            if leased:
                leases.release(fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None, why

    def _unmap(self, mapped: _Mapped) -> None:
        """The last tensor of a mapped file is gone: unmap it, and give its lease up."""
        with mapped.lock:
            _unguard(mapped)
            Libc.get().munmap(mapped.address, mapped.length)
            if not mapped.closed:
                _give_up(mapped)
        self._wake.set()  # after close(), the watcher ends with the last leased file

    def _after_fork_in_child(self) -> None:
        """In a forked child: the mappings are inherited, but the leases are the parent's (its
        open file descriptions) and the watcher thread is gone, so the parent's move would let
        a writer in under the child's tensors (new bytes; SIGBUS after a truncation). Take
        leases of the child's own on the same files, and a watcher; a file that cannot be
        leased now is moved to anonymous memory at once."""
        self._lock = threading.Lock()  # the parent's threads may have held these at the fork
        self._wake = threading.Event()
        self._thread = None
        for mapped in self._files.values():
            mapped.lock = threading.RLock()
            if mapped.closed:
                continue
            _unguard(mapped)  # the parent's descriptor: guarded again with the child's own
            inherited, mapped.fd = mapped.fd, -1
            why: str | None = "it cannot be reopened"
            with contextlib.suppress(OSError):  # the same file, even when renamed over
                flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
                mapped.fd = os.open(f"/proc/self/fd/{inherited}", flags)
                why = leases.take_read_lease(mapped.fd)
            os.close(inherited)  # the parent's lease stays: it is on the parent's description
            if why is None:
                mapped.guard_entry = _guard(mapped)
                continue
            if mapped.fd >= 0:
                os.close(mapped.fd)
            mapped.closed = True
            if mapped.region() is not None:
                move_to_anonymous(mapped.address, mapped.length)
            self.moved += 1
        if any(not f.closed for f in self._files.values()):
            self._start()

    # -- the watcher -------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = Supervised(
                    "ggufswap-leases", self._watch, stop=self._stop, on_exit=self._wake.clear
                ).start()

    @property
    def open_files(self) -> bool:
        """Whether any file is served from a mapping (one attribute: read before each batch)."""
        return bool(self._files)

    def _watch(self) -> None:
        """The watcher thread's body (supervised: restarted with backoff when it raises; a file
        whose check raises is given up, the others stay watched)."""
        while True:
            with self._lock:
                files = [f for f in self._files.values() if not f.closed]
            if self._stop.is_set() and not files:
                return
            self.check_all(files)
            self._wake.wait(POLL_S)
            self._wake.clear()

    def suspect(self) -> bool:
        """Whether a guarded file shrank under its mapping or an access faulted past its end
        (one ``fstat`` per mapped file, in C): the caller runs a pass before its next batch."""
        return bool(self._files) and guard_suspects()

    def stale(self) -> bool:
        """Whether the watcher's last pass is so old that the kernel may have broken a lease
        meanwhile (older than ``fs.lease-break-time`` less a margin: the process was stopped,
        the watcher is down, or a move is slower), while files are mapped; the caller runs a
        pass itself (or drops the batch that ran meanwhile)."""
        now = time.monotonic()
        if now - self._break_time_at > 1.0:  # the sysctl, read at most once a second
            self._break_time_at, self._break_time_s = now, leases.lease_break_time()
        limit = max(STALE_MARGIN_S, self._break_time_s - STALE_MARGIN_S)
        return now - self.last_pass > limit and self.mapped_files > 0

    def check_all(self, files: list[_Mapped] | None = None) -> None:
        """One pass: every leased file is checked (:meth:`_check`), each on its own; its start
        becomes :attr:`last_pass` (:meth:`stale` measures from it)."""
        started = time.monotonic()
        if files is None:
            with self._lock:
                files = [f for f in self._files.values() if not f.closed]
        for mapped in files:
            with mapped.lock:
                if mapped.closed:
                    continue
                try:
                    self._check(mapped)
                except Exception as exc:  # this file is given up; the others are watched on
                    log.exception("mapping.check_failed", file=mapped.path)
                    self._given_up(mapped, f"its check failed: {type(exc).__name__}: {exc}")
        self.last_pass = max(self.last_pass, started)  # the watcher's and a boundary's may overlap

    def _check(self, mapped: _Mapped) -> None:
        """A writer waits, the kernel broke the lease, or the file shrank: move the file's
        pages to anonymous memory, let the writer in, and report what may have changed."""
        tampered = _tampered(mapped)
        if tampered is None and not leases.breaking(mapped.fd):
            return
        if not self._move(mapped):
            return  # no memory: retried at the next pass
        self.moved += 1  # counted before the writer is let in (it may be waited on)
        if not _give_up(mapped) and tampered is None:
            tampered = (
                "the kernel broke its read lease before the runtime let the writer in "
                "(fs.lease-break-time passed: the process was stopped, or the move was slower); "
                "the writer may have changed its bytes"
            )
        if tampered is not None:
            self._report(mapped, tampered)

    def _given_up(self, mapped: _Mapped, why: str) -> None:
        """A file whose check failed: moved out if it can be, its lease released, reported."""
        with contextlib.suppress(Exception):
            self._move(mapped)
        if not mapped.closed:
            with contextlib.suppress(OSError):
                _give_up(mapped)
        self._report(mapped, why)

    def _report(self, mapped: _Mapped, why: str) -> None:
        log.error(
            "mapping.compromised",
            file=mapped.path,
            why=why,
            action="its tensors are re-hashed before the next batch; those whose bytes changed "
            "are out of service until a commit restores them",
        )
        with self._lock:
            self.compromised[mapped.path] = why
            self.reported += 1
            self._reports.append(Compromised(mapped.path, mapped.address, mapped.length, why))

    def take_compromised(self) -> list[Compromised]:
        """The files reported since the last call (the store checks their tensors)."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports

    def _move(self, mapped: _Mapped) -> bool:
        """Move the file's pages to anonymous memory (a writer waits); False if it failed."""
        region = mapped.region()  # held: the pages cannot be unmapped meanwhile
        started = time.perf_counter()
        try:
            if region is not None:
                reinstall_guard()  # first in line again: the copy may read past a new end
                move_to_anonymous(mapped.address, mapped.length)
        except OSError as exc:  # tried again each poll; the lease-break time bounds the wait
            if not mapped.move_failed:  # said once, not every poll
                log.error("mapping.move_failed", file=mapped.path, error=str(exc))
            mapped.move_failed = True
            return False
        _unguard(mapped)  # anonymous memory now: no access can fault
        log.info(
            "mapping.moved",
            file=mapped.path,
            bytes=mapped.length,
            seconds=round(time.perf_counter() - started, 3),
            why="a writer opened the file",
        )
        del region
        return True


_ALL_MAPS: Final[weakref.WeakSet[ShardMaps]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for maps in list(_ALL_MAPS):
        maps._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _give_up(mapped: _Mapped) -> bool:
    """Release the lease and close its descriptor; False when there was no lease left to
    release (the kernel broke it: the lease-break time passed)."""
    mapped.closed = True
    _unguard(mapped)
    try:
        leases.release(mapped.fd)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.ENOLCK, errno.EINVAL):
            raise
        return False
    finally:
        os.close(mapped.fd)
    return True


def _tampered(mapped: _Mapped) -> str | None:
    """Why the file's bytes under the mapping may have changed without a lease break: it shrank
    (``open(O_RDONLY | O_TRUNC)`` breaks no read lease), or an access faulted past its end."""
    faults = guard_faults(mapped.guard_entry)
    size = os.fstat(mapped.fd).st_size
    if size >= mapped.length and not faults:
        return None
    return (
        f"it was truncated under its mapping ({size} bytes now, {mapped.length} mapped; "
        f"{faults} access(es) past its end read zeros instead of raising SIGBUS): an open with "
        "O_TRUNC and without write access breaks no read lease"
    )


def _guard(mapped: _Mapped) -> int:
    """Guard ``mapped``'s range against SIGBUS (the handler first in line); its entry."""
    return guard_range(mapped.address, mapped.length, mapped.fd)


def _unguard(mapped: _Mapped) -> None:
    unguard(mapped.guard_entry)
    mapped.guard_entry = -1
