"""A start that talks: the phases of a runtime's start, their times and progress, for the log and
for ``/health`` (503 ``loading`` until the last phase is done).

The command line opens the HTTP port first (``starting``: the command's own imports and the
HTTP server's), then walks the phases: ``tokenizer`` (from the GGUF's vocabulary, or the cache;
built while torch's library loads, prestart.py), ``import`` (the rest of torch's import),
``load`` (the shards' bytes into the pools, with a byte fraction), ``model`` (the decoder over
the loaded tensors), ``warmup`` (one short generation, so the first client does not pay for
first-call allocations). Where the tokenizer could not be built first (a split set named by a
later shard, a file replaced meanwhile), its phase comes after ``model``. Each phase logs
``startup.phase`` with its seconds when it ends, and ``runtime.ready`` follows.
"""

from __future__ import annotations

import enum
import gc
import threading
import time
from typing import Any

from ggufswap.logs import get_logger

log = get_logger(__name__)


class Phase(str, enum.Enum):
    STARTING = "starting"
    IMPORT = "import"
    LOAD = "load"
    MODEL = "model"
    TOKENIZER = "tokenizer"
    WARMUP = "warmup"
    READY = "ready"
    FAILED = "failed"


class Startup:
    """The current phase, its progress and the finished phases' seconds (thread-safe)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = time.monotonic()
        self.phase = Phase.STARTING
        self.seconds: dict[str, float] = {}
        self.error: str | None = None
        self._phase_started = self.started
        self._done = 0
        self._total = 0
        self._lock = threading.Lock()

    def enter(self, phase: Phase) -> None:
        """End the current phase (logging its time) and start ``phase``."""
        now = time.monotonic()
        with self._lock:
            previous, elapsed = self.phase, now - self._phase_started
            self.seconds[previous.value] = round(elapsed, 3)
            self.phase, self._phase_started = phase, now
            self._done = self._total = 0
        log.info("startup.phase", model=self.model, phase=previous.value, seconds=round(elapsed, 3))
        if phase is Phase.READY:
            log.info(
                "startup.ready",
                model=self.model,
                seconds=round(now - self.started, 3),
                phases=dict(self.seconds),
            )

    def progress(self, done: int, total: int) -> None:
        """Work of the current phase done so far (the load's bytes)."""
        with self._lock:
            self._done, self._total = done, total

    def fail(self, error: str) -> None:
        with self._lock:
            self.phase, self.error = Phase.FAILED, error

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def snapshot(self) -> dict[str, Any]:
        """What ``/health`` shows before the runtime is ready."""
        with self._lock:
            progress = round(self._done / self._total, 4) if self._total else None
            body: dict[str, Any] = {
                "status": "error" if self.phase is Phase.FAILED else "loading",
                "model": self.model,
                "phase": self.phase.value,
                "progress": progress,
                "elapsed_s": round(time.monotonic() - self.started, 3),
                "phases_s": dict(self.seconds),
            }
            if self.error is not None:
                body["error"] = self.error
            return body


def collect_from_now() -> None:
    """End the start's pause of garbage collection (``ggufswap.main`` pauses it: a start makes
    millions of objects and no garbage worth a collection, and torch's import alone runs
    ~15% faster without one). What the start made (torch's modules, the model, the tokenizer:
    long-lived) moves to the permanent generation (``gc.freeze``), so later collections do not
    walk it, and collection resumes. Nothing when collection was not paused."""
    if gc.isenabled():
        return
    gc.freeze()
    gc.enable()
