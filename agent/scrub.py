"""The background scrub: re-hash the loaded tensors at a bounded rate, to find changes that no
event and no file identity reveal.

A write through a ``MAP_SHARED`` mapping reaches the file without an inotify event, and a second
write into pages still dirty changes neither the mtime nor the ctime: the file's identity stays
equal, so the agent, which hashes a tensor only when its record changed, would never look. With
``verify: checksum`` and ``scrub_rate`` above 0, a thread per model walks the tensors that are in
sync (the desired record equals the runtime's) round-robin, hashes each one's bytes afresh and
compares with the fingerprint the runtime reports:

- equal: nothing to do;
- different: the bytes changed under the same identity; the link is told
  (:meth:`RuntimeLink.content_changed`), which plans the tensor by fingerprint;
- the file's identity no longer matches the record (a change no event reported): the model is
  re-scanned (``on_stale``).

After hashing ``n`` bytes the thread waits ``n / rate`` seconds, so the scrub never reads faster
than ``scrub_rate`` on average; a full pass over a model of ``S`` bytes takes about ``S / rate``,
which bounds the detection latency.

One scrub per model, however many runtimes serve it (``replicas``): the files are the same, so
each tensor is hashed once and the hash compared with what every runtime reports (the view
gives one actual state per runtime; ``on_changed`` names the runtime by its index there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ggufswap.ipc import TensorEntry
from ggufswap.ipc.supervisor import Supervised
from ggufswap.logs import get_logger
from ggufswap.shards import ShardError, TensorRecord
from ggufswap.shards.fingerprint import fingerprint

log = get_logger(__name__)

IDLE_S = 1.0  # wait between looks when nothing is in sync yet


# (desired, the actual state of each runtime of the model)
View = Callable[[], tuple[Mapping[str, TensorRecord], Sequence[Mapping[str, TensorEntry]]]]
Changed = Callable[[int, TensorRecord, str], None]  # (runtime index, record, digest now)


def _same_source(loaded: TensorRecord, record: TensorRecord) -> bool:
    return (
        loaded.identity == record.identity
        and loaded.offset == record.offset
        and loaded.nbytes == record.nbytes
        and loaded.ggml_type == record.ggml_type
    )


class Scrubber:
    """Re-hashes in-sync tensors of one model at ``rate`` bytes per second, on its own thread."""

    def __init__(
        self,
        *,
        model: str,
        rate: int,
        view: View,
        on_changed: Changed,
        on_stale: Callable[[], None],
    ) -> None:
        self.model = model
        self.rate = rate
        self._view = view
        self._on_changed = on_changed
        self._on_stale = on_stale
        self._stop = threading.Event()
        self._thread: Supervised | None = None
        self._cursor = ""  # the last name hashed: the walk resumes after it
        self.hashed_bytes = 0
        self.passes = 0
        self.found = 0

    def start(self) -> Scrubber:
        # Not essential: the model stays in sync without it (restarted forever, never giving
        # up, and never holding the watchdog back).
        self._thread = Supervised(
            f"ggufswap-scrub-{self.model}",
            self._run,
            stop=self._stop,
            essential=False,
            context={"model": self.model},
        ).start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None

    def status(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "hashed_bytes": self.hashed_bytes,
            "passes": self.passes,
            "found": self.found,
            "thread": self._thread.status() if self._thread is not None else None,
        }

    def _run(self) -> None:
        """The scrub thread's body (supervised: a bug is logged and the body restarted)."""
        while not self._stop.is_set():
            self._stop.wait(self.step())

    def step(self) -> float:
        """Hash the next in-sync tensor; return how long to wait before the next one."""
        desired, actuals = self._view()

        def loaded(name: str, actual: Mapping[str, TensorEntry]) -> TensorEntry | None:
            entry = actual.get(name)
            return (
                entry if entry is not None and _same_source(entry.record, desired[name]) else None
            )

        in_sync = sorted(
            name for name in desired if any(loaded(name, actual) for actual in actuals)
        )
        if not in_sync:
            return IDLE_S
        name = next((n for n in in_sync if n > self._cursor), None)
        if name is None:
            self.passes += 1
            name = in_sync[0]
        self._cursor = name
        record = desired[name]
        try:
            digest = fingerprint(record)
        except (ShardError, OSError) as exc:
            # Routine: a writer replaced or truncated the file since the last scan; the re-scan
            # finds what it is now.
            log.info("scrub.file_changed", model=self.model, tensor=name, why=str(exc))
            self._on_stale()
            return IDLE_S
        self.hashed_bytes += record.nbytes
        differs = [
            (i, entry.fingerprint)
            for i, actual in enumerate(actuals)
            if (entry := loaded(name, actual)) is not None
            and entry.fingerprint is not None
            and entry.fingerprint != digest
        ]
        if differs:
            self.found += 1
        for i, expected in differs:
            log.warning(
                "scrub.content_changed",
                model=self.model,
                tensor=name,
                path=record.path,
                runtime=i,
                expected=expected,
                found=digest,
            )
            self._on_changed(i, record, digest)
        return record.nbytes / self.rate
