"""Process signals, handled in one place that only sets flags (uvicorn's capture_signals).

SIGTERM and SIGINT ask for a clean shutdown; a second SIGINT forces an immediate exit (130);
SIGHUP asks for a configuration reload. Daemon loops wait on these events with timeouts. SIGIO,
which a read lease's break sends (the agent's writer probe, the runtime's mapped shards), gets
the handler of :mod:`ggufswap.shards.leases` instead of its default action, termination.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from ggufswap.shards import leases

EXIT_FORCED = 130


class HandlerSafeEvent(threading.Event):
    """A :class:`threading.Event` that a signal handler may set.

    A handler runs in the main thread between two bytecodes, possibly while that thread holds
    the event's lock inside ``Event.wait`` (a daemon loop's ``stop.wait(timeout)``). A plain
    Event's lock is not reentrant, so ``set()`` from that handler waited forever for a lock its
    own thread held: SIGTERM now and then left a runtime hanging, nothing logged. This event's
    condition is built on an ``RLock``, which the handler re-enters.
    """

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(threading.RLock())


class ProcessSignals:
    def __init__(self) -> None:
        self.stop: threading.Event = HandlerSafeEvent()
        self.reload: threading.Event = HandlerSafeEvent()
        self._interrupts = 0

    def install(self) -> ProcessSignals:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_interrupt)
        signal.signal(signal.SIGHUP, self._on_reload)
        leases.guard_sigio()
        return self

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop.set()

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self._interrupts += 1
        if self._interrupts > 1:  # the operator insists: leave without the bounded shutdown
            os._exit(EXIT_FORCED)
        self.stop.set()

    def _on_reload(self, signum: int, frame: FrameType | None) -> None:
        self.reload.set()
