"""Content stability across the settle window: a shard is read only once its identity has held
still for ``settle_ms``.

The debouncer waits ``settle_ms`` after the last *event* about a path, but some writers change a
file without events: writes through a ``MAP_SHARED`` mapping send none, and a writer the
open-for-writing probe cannot see (another PID namespace or host, an agent without
``CAP_LEASE``) is not held either. A scan that happens meanwhile (the periodic rescan, the
scrub's re-scan, another shard's event) would read a mix of two versions. So a shard is planned
only when its identity (device, inode, size, mtime, ctime) has not changed for ``settle_ms``:

- its ``ctime`` is at least ``settle_ms`` old: every write, truncation, rename into place or
  attribute change sets ctime to the kernel's clock, and nothing can set it back; or
- this index has seen the same identity for ``settle_ms`` (for a ctime from another clock, such
  as an NFS server's running ahead).

A change seen restarts the window: the shard is held (``Health.SETTLING``, with the reason in
the agent's status) and looked at again after ``settle_ms`` (the daemon re-routes held shards).
A file written through events settles in the debouncer already, so its ctime is old enough when
it is scanned and this adds no delay. Bytes changed *without* an identity change (a second write
into pages still dirty) are outside what a stat can see: the scrub finds them
(``agent/scrub.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

Identity = tuple[int, int, int, int, int]


class StabilityWindow:
    """Per real path: the identity last seen and since when. Not thread-safe (the main loop)."""

    def __init__(self, *, settle_s: float) -> None:
        self.settle_s = settle_s
        self._seen: dict[str, tuple[Identity, float]] = {}

    def unstable(self, path: str) -> str | None:
        """Why ``path`` must not be read yet (its identity changed within the window), or None.
        A file that cannot be stat'ed is left to the header read to report."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        now = time.monotonic()
        seen = self._seen.get(path)
        if seen is None or seen[0] != identity:
            self._seen[path] = seen = (identity, now)
        ctime_age_s = (time.time_ns() - st.st_ctime_ns) / 1e9
        held_s = now - seen[1]
        if ctime_age_s >= self.settle_s or held_s >= self.settle_s:
            return None
        return (
            f"changed {max(0.0, ctime_age_s) * 1000:.0f} ms ago without a settled event: read "
            f"once unchanged for settle_ms ({self.settle_s * 1000:.0f} ms)"
        )

    def keep(self, paths: Iterable[str]) -> None:
        """Forget every path not in ``paths`` (files gone from the scan)."""
        keep = set(paths)
        for gone in [p for p in self._seen if p not in keep]:
            del self._seen[gone]
