"""A start that talks: the phases of a runtime's start, their times and progress, for the log and
for ``/health`` (503 ``loading`` until the last phase is done).

The daemon opens the HTTP port first, then walks the phases: ``load`` (the shards' bytes into
the pools, with a byte fraction), ``model`` (the decoder over the loaded tensors), ``tokenizer``
(from the GGUF's vocabulary, or the cache), ``warmup`` (one short generation, so the first
client does not pay for first-call allocations). Each phase logs ``startup.phase`` with its
seconds when it ends, and ``runtime.ready`` follows.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Any

from ggufswap.logs import get_logger

log = get_logger(__name__)


class Phase(str, enum.Enum):
    STARTING = "starting"
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
