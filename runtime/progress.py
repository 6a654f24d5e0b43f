"""Progress of long operations (a model load, a perplexity pass) where no terminal shows a bar.

On a terminal the caller shows a tqdm bar; elsewhere (journald, a file, a pipe) a
:class:`ProgressLog` logs one structured line every ``interval_s``: what is done of the total,
the rate and the time left, so an operator reading ``journalctl -f`` sees a 20 s load move. The
interval is ``$GGUFSWAP_PROGRESS_INTERVAL_S`` (default 5 s).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

from ggufswap.logs import get_logger

log = get_logger(__name__)

INTERVAL_ENV: Final = "GGUFSWAP_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S: Final = 5.0


def progress_interval_s() -> float:
    """Seconds between progress lines: ``$GGUFSWAP_PROGRESS_INTERVAL_S`` if a number > 0."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, ""))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


class ProgressLog:
    """Counts units of work and logs ``event`` with ``done``, ``total``, ``percent``, ``rate``
    and ``eta_s`` at most once per interval (call :meth:`update` as work completes)."""

    def __init__(
        self, event: str, *, total: int, unit: str, interval_s: float | None = None, **fields: Any
    ) -> None:
        self.event = event
        self.total = total
        self.unit = unit
        self.interval_s = progress_interval_s() if interval_s is None else interval_s
        self.fields = fields
        self.done = 0
        self._started = time.monotonic()
        self._last = self._started

    def update(self, amount: int) -> None:
        self.done += amount
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        elapsed = now - self._started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else None
        log.info(
            self.event,
            done=self.done,
            total=self.total,
            unit=self.unit,
            percent=round(100.0 * self.done / self.total, 1) if self.total else 100.0,
            rate=round(rate, 1),
            eta_s=None if left is None else round(left, 1),
            **self.fields,
        )


@contextmanager
def progress_bar(
    total: int, *, enabled: bool, also: Callable[[int, int], None] | None = None
) -> Iterator[Callable[[int], None] | None]:
    """A byte counter that shows GB/s and the time left (tqdm's rate and ETA) on a terminal, and
    logs ``load.progress`` lines (a :class:`ProgressLog`) when not on one; ``also(done, total)``
    is told every step too (a server's ``/health``)."""
    if not enabled:
        update: Callable[[int], None] = ProgressLog("load.progress", total=total, unit="B").update
        yield update if also is None else _tee(update, also, total)
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", leave=False) as bar:
        yield bar.update if also is None else _tee(bar.update, also, total)


def _tee(
    update: Callable[[int], None], also: Callable[[int, int], None], total: int
) -> Callable[[int], None]:
    """``update``, also telling ``also`` the running count and the total."""
    done = 0

    def both(amount: int) -> None:
        nonlocal done
        done += amount
        update(amount)
        also(done, total)

    return both


__all__ = [
    "DEFAULT_INTERVAL_S",
    "INTERVAL_ENV",
    "ProgressLog",
    "progress_bar",
    "progress_interval_s",
]
