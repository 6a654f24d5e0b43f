"""Naming the rank a coordinated group lost, when one of the group's collectives fails.

A collective fails on the ranks that talk to the lost one directly (gloo's ring: its two
neighbours) with the transport's words ("Connection reset by peer [10.0.0.7]:23963"), and the
other ranks stay blocked until those fail in turn or exit. Neither says which rank is gone. So
each rank of a :class:`~ggufswap.runtime.coordinated.Coordinator` leaves its host and pid in the
group's store when it joins (:func:`register`), and a rank whose collective failed holds a short
roll call in the store (:func:`roll_call`): it answers for itself and names the ranks that did
not: dead (its pid is gone, on this host; named at once), or, when none is, after waiting a few
seconds for their answers: alive but silent (blocked in the collective or hung, on this host),
or silent on another host (dead or hung). A rank that fails later in the same collective (a rank
blocked until the first ones exit) finds their answers and names only the rank that never
answered.

The store is the one ``init_process_group`` made (torchrun's TCPStore, a FileStore), reached
through ``torch.distributed``'s private ``_get_default_store``; without one the error says only
what the transport said.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ggufswap.logs import get_logger

log = get_logger(__name__)

ROLL_CALL_S: Final = 3.0  # how long a failed rank waits for the others' answers (at most)
_KEY: Final = "ggufswap.coordinated"


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a rank runs, as it registered itself."""

    host: str
    pid: int


def _store() -> dist.Store | None:
    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def register(prefix: str, rank: int) -> None:
    """Leave this rank's host and pid in the group's store (once, when the rank joins)."""
    store = _store()
    if store is not None:
        place = {"host": socket.gethostname(), "pid": os.getpid()}
        store.set(f"{_KEY}/{prefix}/rank/{rank}", json.dumps(place))


def _place(store: dist.Store, prefix: str, rank: int) -> RankPlace | None:
    key = f"{_KEY}/{prefix}/rank/{rank}"
    if not store.check([key]):
        return None
    place = json.loads(store.get(key))
    return RankPlace(str(place["host"]), int(place["pid"]))


def _pid_alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended


def _describe(rank: int, place: RankPlace | None, grace_s: float) -> str:
    if place is None:
        return f"rank {rank} (never registered) did not answer"
    where = f"pid {place.pid} on {place.host}"
    if place.host != socket.gethostname():
        return f"rank {rank} ({where}) did not answer within {grace_s:g} s: dead or hung"
    if not _pid_alive(place.pid):
        return f"rank {rank} ({where}) is dead"
    return f"rank {rank} ({where}) is alive but did not answer (blocked in the collective, or hung)"


def roll_call(
    prefix: str, *, rank: int, world_size: int, collective: int, grace_s: float = ROLL_CALL_S
) -> list[str]:
    """Answer the roll call after the failed collective number ``collective``; one line per rank
    that did not answer (empty without a store, or when every rank answered).

    A rank that answered failed in a collective too (this one, or one before it that it reached
    first) and is not the cause. Among the others,
    those on this host whose pid is gone are named at once (torchrun stops the survivors 0.1 s
    after a death); when there are none, the others' answers are awaited up to ``grace_s``
    (ranks blocked in the collective answer once it fails for them too).
    """
    store = _store()
    if store is None:
        return []
    # One answer per rank, whichever collective failed for it: a group ends at its first lost
    # rank, and a rank that failed in an earlier collective and exited (the leader, a step
    # ahead) is not the cause.
    base = f"{_KEY}/{prefix}/failed"
    store.set(f"{base}/{rank}", str(collective))

    def missing() -> list[int]:
        return [r for r in range(world_size) if r != rank and not store.check([f"{base}/{r}"])]

    places = {r: _place(store, prefix, r) for r in missing()}
    here = socket.gethostname()
    dead = [
        r for r, p in places.items() if p is not None and p.host == here and not _pid_alive(p.pid)
    ]
    if dead:
        lines = [_describe(r, places[r], grace_s) for r in dead]
    else:
        with contextlib.suppress(dist.DistStoreError, RuntimeError):  # who did not: named below
            store.wait([f"{base}/{r}" for r in places], datetime.timedelta(seconds=grace_s))
        lines = [_describe(r, places[r], grace_s) for r in missing()]
    log.error("coordinated.roll_call", rank=rank, collective=collective, lost=lines)
    return lines
