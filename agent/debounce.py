"""Per-path settle windows: a path is due only after it has been quiet for its settle time.

Every report about a path pushes its deadline to ``now + settle_s``; a shard copied in slow
chunks therefore stays pending until the copy has stopped for ``settle_ms``. The clock is passed
in, so the logic is deterministic and the daemon decides what "now" is.
"""

from __future__ import annotations


class Debouncer:
    """Pending paths with deadlines. Not thread-safe: the daemon's main loop owns it."""

    def __init__(self) -> None:
        self._deadline: dict[str, float] = {}
        self._since: dict[str, float] = {}

    def touch(self, key: str, now: float, settle_s: float) -> None:
        """``key`` changed at ``now``: due at ``now + settle_s`` unless touched again."""
        self._deadline[key] = now + settle_s
        self._since.setdefault(key, now)

    def due(self, now: float) -> list[str]:
        """Remove and return every key whose window has passed."""
        ready = [key for key, deadline in self._deadline.items() if deadline <= now]
        for key in ready:
            del self._deadline[key]
            del self._since[key]
        return ready

    def pending(self) -> frozenset[str]:
        return frozenset(self._deadline)

    def next_deadline(self) -> float | None:
        return min(self._deadline.values(), default=None)

    def oldest_since(self) -> float | None:
        """When the longest-waiting pending key was first touched (for the coalescing bound)."""
        return min(self._since.values(), default=None)

    def __len__(self) -> int:
        return len(self._deadline)
