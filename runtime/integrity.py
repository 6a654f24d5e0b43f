"""Served weights whose bytes changed outside any commit: found, taken out of service, restored.

A tensor served from a mapped shard file (:mod:`.mapping`) shows the file's bytes. The read lease
keeps writers off while it is held, but the kernel gives a writer in after
``fs.lease-break-time`` whatever the runtime does (a stopped process, a move slower than that),
and ``open(O_RDONLY | O_TRUNC)`` truncates without breaking the lease at all. The lease watcher
reports such files (:class:`~ggufswap.runtime.mapping.Compromised`); :func:`check_mapped`, in
the inference thread before each batch, re-hashes every tensor served from a reported file's
range and takes out of service those whose bytes no longer hash to their fingerprint:

- the slot's ``fingerprint`` becomes :data:`LOST_FINGERPRINT`, which no content has: ``state``
  reports it, the agent finds the tensor differs from its file and plans it, and the stager
  reads the file's bytes again (nothing is taken as already loaded);
- what the slot's original buffer held (``held``) is forgotten, when that buffer lies in the
  range: returning to it re-reads the file;
- ``store.lost`` names it with the reason; the runtime refuses every batch
  (:class:`~ggufswap.runtime.errors.WeightsLost`) until commits have restored them all.

A tensor of a reported file whose bytes still hash to its fingerprint stays in service (the
writer changed other bytes, or none yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.ipc.bodies import LOST_FINGERPRINT
from ggufswap.logs import get_logger
from ggufswap.runtime.commit import distrust_original, take_out_of_service
from ggufswap.shards.fingerprint import fingerprint_bytes

if TYPE_CHECKING:
    from ggufswap.runtime.mapping import Compromised
    from ggufswap.runtime.pools import Buffer
    from ggufswap.runtime.store import TensorStore

log = get_logger(__name__)

__all__ = ["LOST_FINGERPRINT", "check_mapped"]


def check_mapped(store: TensorStore) -> dict[str, str]:
    """Before a batch (inference thread, commits excluded): run a watcher pass if a file
    shrank or the last pass is stale, take the tensors of reported files whose bytes changed
    out of service, drop the restored ones; returns the tensors out of service now (tensor ->
    why)."""
    maps = store.maps
    # A file truncated since the watcher's last pass (no lease break tells), or a pass too old
    # (the process was stopped, or the watcher is down): look now, before the batch.
    if maps.suspect() or maps.stale():
        maps.check_all()
    for report in maps.take_compromised():
        _take_out_of_service(store, report)
    if store.lost:
        restored = [n for n in store.lost if store.slots[n].fingerprint != LOST_FINGERPRINT]
        for name in restored:
            del store.lost[name]
        if restored:
            log.info("weights.restored", tensors=restored[:20], count=len(restored))
    return store.lost


def _inside(buffer: Buffer, report: Compromised) -> bool:
    address = buffer.tensor.data_ptr()
    return report.address <= address < report.address + report.length


def _take_out_of_service(store: TensorStore, report: Compromised) -> None:
    lost: list[str] = []
    for slot in store.slots.values():
        if slot.is_split:
            continue  # split families are never mapped (their parts are pool buffers)
        if _inside(slot.original, report):
            distrust_original(slot)
        if not _inside(slot.active, report) or slot.fingerprint == LOST_FINGERPRINT:
            continue
        served = slot.active.tensor[: slot.record.nbytes]
        if fingerprint_bytes(served.numpy().data) == slot.fingerprint:
            continue
        take_out_of_service(store, slot)
        store.lost[slot.name] = f"{report.path}: {report.why}"
        lost.append(slot.name)
    if not lost:
        log.warning("weights.intact", file=report.path, why=report.why)
        return
    store.decoded.clear()  # nothing decoded from changed bytes is served either
    store.views.clear()
    log.error(
        "weights.lost",
        file=report.path,
        tensors=lost[:20],
        count=len(lost),
        why=report.why,
        until="a commit restores them (the agent re-plans every tensor whose fingerprint "
        "reads 'lost')",
    )
