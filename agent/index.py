"""The shard index: per model, what the watched directories hold now, validated.

A scan lists the watched directories (glob and ignore patterns applied), resolves every candidate
to its real path (symlinked model directories, Hugging Face ``snapshots/`` links into ``blobs/``)
and reads its header through a shared :class:`~ggufswap.shards.HeaderCache`, so only files whose
identity changed are parsed again. Shards are grouped into sets (gguf-split naming, judged on the
name as seen in the watched directory, since a blob's name is its hash) and each set is validated.

What a scan cannot trust is *held*: tensors of a shard that fails to parse (truncated, garbage),
of a shard still settling, of an inconsistent set, or named by two sets. Held tensors are never
planned; the runtime keeps what it has (the last good state) until a valid file appears.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ggufswap.agent.stability import StabilityWindow
from ggufswap.agent.writers import writer_of
from ggufswap.config import ModelConfig, WatchConfig
from ggufswap.logs import get_logger
from ggufswap.shards import HeaderCache, ShardError, ShardHeader, ShardSet, TensorRecord
from ggufswap.shards.shardset import split_prefix

log = get_logger(__name__)


class Health(str, enum.Enum):
    """The state of one shard file as the last scan found it."""

    VALID = "valid"
    INVALID = "invalid"  # does not parse, breaks its set, or cannot be stat'ed
    SETTLING = "settling"  # changed within its settle window, or open for writing: not read yet


@dataclass(frozen=True, slots=True)
class ShardStatus:
    path: str  # as seen in the watched directory
    real_path: str
    health: Health
    reason: str | None = None
    tensors: int = 0
    held_by_last_good: bool = False  # invalid now; its last good header names what is held


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """One scan of one model. ``desired`` is what may be planned now (filtered, nothing held)."""

    model: str
    generation: int
    desired: Mapping[str, TensorRecord] = field(repr=False)
    held: frozenset[str]
    shards: tuple[ShardStatus, ...]
    problems: tuple[str, ...]
    scanned_at: float  # time.time()
    scan_s: float

    @property
    def invalid(self) -> tuple[ShardStatus, ...]:
        return tuple(s for s in self.shards if s.health is Health.INVALID)


@dataclass(frozen=True, slots=True)
class WatchRoot:
    """A directory to watch for a model: a configured root or the real directory of links."""

    directory: str  # real path
    recursive: bool
    config: WatchConfig
    is_link_target: bool = False


def is_ignored(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _inside(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


@dataclass
class _Found:
    seen: str
    real: str
    header: ShardHeader | None
    held: bool


def _one_per_file(found: list[_Found]) -> list[_Found]:
    """One item per file: names that reach the same file (a ``current.gguf`` symlink to a
    sibling, a hard link; equal device and inode) are one shard, not two shard sets holding each
    other's tensors. The name that is the file itself wins over a symlink, then the first."""
    kept: dict[tuple[int, int], _Found] = {}
    for item in sorted(found, key=lambda i: (i.seen != i.real, i.seen)):
        assert item.header is not None, "only items with a header are assembled"
        kept.setdefault((item.header.identity.dev, item.header.identity.ino), item)
    return sorted(kept.values(), key=lambda i: i.seen)


class ModelIndex:
    """The shard index of one model. Not thread-safe: the daemon's main loop owns it."""

    def __init__(self, model: ModelConfig, *, cache: HeaderCache | None = None) -> None:
        self.model = model
        self._cache = cache if cache is not None else HeaderCache()
        self._last_good: dict[str, ShardHeader] = {}
        self._stability = StabilityWindow(settle_s=model.settle_ms / 1000)
        self._target_dirs: dict[str, WatchConfig] = {}
        self._roots = self._resolve_roots()
        self.snapshot: ModelSnapshot | None = None
        self.generation = 0

    # -- what to watch -----------------------------------------------------------------------

    def _resolve_roots(self) -> list[WatchRoot]:
        return [WatchRoot(os.path.realpath(w.path), w.recursive, w) for w in self.model.watch]

    def watch_roots(self) -> list[WatchRoot]:
        """Configured roots (real paths) and the real directories of symlink targets."""
        self._roots = self._resolve_roots()
        extra = [
            WatchRoot(d, False, cfg, is_link_target=True)
            for d, cfg in sorted(self._target_dirs.items())
            if not self._covered(d)
        ]
        return [*self._roots, *extra]

    def _covered(self, directory: str) -> bool:
        """Whether a configured root already watches ``directory``."""
        return any(
            directory == r.directory or (r.recursive and _inside(directory, r.directory))
            for r in self._roots
        )

    def _root_of(self, seen: str) -> WatchRoot:
        for root in self._roots:
            if os.path.dirname(seen) == root.directory or _inside(seen, root.directory):
                return root
        return self._roots[0]

    def concerns(self, path: str) -> bool:
        """Whether a change report about ``path`` may change this model's scan."""
        name = os.path.basename(path)
        ignored = is_ignored(name, self.model.ignore)
        for root in self._roots:
            if path == root.directory:
                return True
            parent = os.path.dirname(path)
            if parent == root.directory or (root.recursive and _inside(path, root.directory)):
                if ignored:
                    return False
                if root.recursive or fnmatch.fnmatchcase(name, root.config.glob):
                    return True
        return not ignored and os.path.dirname(path) in self._target_dirs

    # -- scanning ----------------------------------------------------------------------------

    def _candidates(self, problems: list[str]) -> list[tuple[str, str]]:
        """(path as seen, real path) of every file a root's glob matches. The roots are real
        paths and subdirectories are entered only when they are not links, so a file that is no
        symlink is its own real path: ``realpath`` (an lstat per path component) runs only for
        links, which matters at thousands of shards per scan."""
        found: list[tuple[str, str]] = []
        for root in self._roots:
            if not os.path.isdir(root.directory):
                problems.append(f"watched directory {root.config.path} does not exist")
                continue
            pending = [root.directory]
            while pending:
                current = pending.pop()
                try:
                    entries = sorted(os.scandir(current), key=lambda e: e.name)
                except OSError as exc:
                    problems.append(f"cannot list {current}: {exc.strerror}")
                    continue
                for entry in entries:
                    if is_ignored(entry.name, self.model.ignore):
                        continue
                    if root.recursive and entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif fnmatch.fnmatchcase(entry.name, root.config.glob):
                        link = entry.is_symlink()
                        found.append(
                            (entry.path, os.path.realpath(entry.path) if link else entry.path)
                        )
        return found

    def _read(
        self, seen: str, real: str, skip: frozenset[str]
    ) -> tuple[_Found | None, ShardStatus]:
        previous = self._last_good.get(seen)
        if seen in skip or real in skip:
            held = previous if previous is not None and previous.path == real else None
            return _Found(seen, real, held, True), ShardStatus(seen, real, Health.SETTLING)
        if os.path.isdir(real):
            return None, ShardStatus(seen, real, Health.INVALID, "a directory, not a shard")
        writer = writer_of(real)
        if writer is None:
            # Changed within the settle window although no event said so (a writer the probe
            # cannot see, writing through a mapping): read once its identity is stable.
            writer = self._stability.unstable(real)
        if writer is not None:  # being rewritten in place: reading it now could mix versions
            held = previous if previous is not None and previous.path == real else None
            return _Found(seen, real, held, True), ShardStatus(
                seen, real, Health.SETTLING, writer, held_by_last_good=held is not None
            )
        try:
            header = self._cache.get(real, resolved=True)
        except ShardError as exc:
            if not os.path.lexists(seen):
                return None, ShardStatus(seen, real, Health.INVALID, "vanished during the scan")
            reason = exc.detail if exc.path == real else str(exc)
            if os.path.islink(seen) and not os.path.exists(seen):
                reason = f"symlink target {real} does not exist"
            held = previous if previous is not None and previous.path == real else None
            status = ShardStatus(
                seen, real, Health.INVALID, reason, held_by_last_good=held is not None
            )
            return _Found(seen, real, held, True), status
        self._last_good[seen] = header
        return _Found(seen, real, header, False), ShardStatus(
            seen, real, Health.VALID, tensors=len(header.tensors)
        )

    def scan(self, *, skip: frozenset[str] = frozenset()) -> ModelSnapshot:
        """Scan now; paths in ``skip`` (still settling) are not read and their tensors held.

        Bumps ``generation`` only when what may be planned changed.
        """
        started, wall = time.perf_counter(), time.time()
        self._roots = self._resolve_roots()
        problems: list[str] = []
        statuses: dict[str, ShardStatus] = {}
        found: list[_Found] = []
        targets: dict[str, WatchConfig] = {}
        for seen, real in self._candidates(problems):
            item, status = self._read(seen, real, skip)
            statuses[seen] = status
            if item is None:
                continue
            real_dir = os.path.dirname(item.real)
            if not self._covered(real_dir):
                targets.setdefault(real_dir, self._root_of(seen).config)
            if item.header is not None:
                found.append(item)
        self._target_dirs = targets
        present = set(statuses)
        for gone in [p for p in self._last_good if p not in present]:
            del self._last_good[gone]
        self._stability.keep({s.real_path for s in statuses.values()})
        desired, held = self._assemble(found, statuses, problems)
        admits = self.model.tensors.admits
        desired = {n: r for n, r in desired.items() if admits(n)}
        held_now = frozenset(n for n in held if admits(n))
        previous = self.snapshot
        if previous is None or previous.desired != desired or previous.held != held_now:
            self.generation += 1
        self.snapshot = ModelSnapshot(
            model=self.model.name,
            generation=self.generation,
            desired=MappingProxyType(desired),
            held=held_now,
            shards=tuple(statuses[p] for p in sorted(statuses)),
            problems=tuple(problems),
            scanned_at=wall,
            scan_s=time.perf_counter() - started,
        )
        return self.snapshot

    def _assemble(
        self, found: list[_Found], statuses: dict[str, ShardStatus], problems: list[str]
    ) -> tuple[dict[str, TensorRecord], set[str]]:
        groups: dict[tuple[str, int], list[_Found]] = {}
        for item in _one_per_file(found):
            assert item.header is not None, "only items with a header are assembled"
            if item.header.split_count <= 1:
                groups[(item.seen, 1)] = [item]
                continue
            try:
                # The naming convention is judged on the name in the watched directory.
                prefix = split_prefix(dataclasses.replace(item.header, path=item.seen))
            except ShardError as exc:
                statuses[item.seen] = ShardStatus(item.seen, item.real, Health.INVALID, exc.detail)
                continue
            groups.setdefault((prefix, item.header.split_count), []).append(item)
        desired: dict[str, TensorRecord] = {}
        held: set[str] = set()
        owner: dict[str, str] = {}
        for (key, _count), items in sorted(groups.items()):
            headers = [i.header for i in items if i.header is not None]
            names = {t.name for h in headers for t in h.tensors}
            try:
                shard_set = ShardSet.from_headers(headers)
            except ShardError as exc:
                problems.append(str(exc))
                held |= names
                for i in items:
                    if statuses[i.seen].health is Health.VALID:
                        statuses[i.seen] = dataclasses.replace(
                            statuses[i.seen], health=Health.INVALID, reason=f"set: {exc.detail}"
                        )
                continue
            held_paths = {i.real for i in items if i.held}
            for name, record in shard_set.tensors.items():
                if name in owner:
                    problems.append(
                        f"tensor {name!r} is in two shard sets: {owner[name]} and {key}; "
                        "neither is planned until one is removed"
                    )
                    held.add(name)
                    desired.pop(name, None)
                    continue
                owner[name] = key
                if record.path in held_paths:
                    held.add(name)
                else:
                    desired[name] = record
        for name in held:
            desired.pop(name, None)
        return desired, held
