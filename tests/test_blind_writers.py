"""Writers the agent cannot see, through real agent and runtime processes.

The open-for-writing probe (``agent/writers.py``) sees a writer through a read lease or /proc.
It is blind to a writer in another PID namespace (another container) when it cannot take a
lease (the shard belongs to another user and the agent lacks ``CAP_LEASE``), and to a writer on
another host. Here the agent runs like that (``unshare --pid --mount-proc``, ``setpriv`` without
``CAP_LEASE``; the shards belong to uid 65534) and the test process writes through a
``MAP_SHARED`` mapping, which sends no inotify event. What still holds:

- a shard is read only once its identity has been stable for ``settle_ms`` (``agent/stability.py``),
  so a writer that rewrites it page by page is never planned half way;
- a second write into pages still dirty changes neither the identity nor sends an event; the
  scrub's fresh hash finds it (``agent/scrub.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile import MODEL, TENSOR, Live, live_processes
from processes import Proc, status_of, wait_for
from runtime_helpers import fresh_digest

from ggufswap.ipc import Fields
from ggufswap.shards import TensorRecord, fingerprint, open_shard_set

pytestmark = pytest.mark.process

WAIT_S = 60.0
STOP_S = 60.0  # a loaded host takes seconds to stop a process (bounded all the same)
OTHER_UID = 65534
PAGE = mmap.PAGESIZE
# The agent in a PID namespace of its own (it cannot see the test's process in /proc) and
# without CAP_LEASE (it cannot take a lease on another user's file).
BLIND = (
    "unshare",
    "--pid",
    "--fork",
    "--mount-proc",
    "--kill-child=SIGTERM",
    "setpriv",
    "--bounding-set",
    "-lease",
    "--inh-caps",
    "-lease",
)


def _blind_agent_possible() -> str | None:
    """Why the blind agent cannot run here, or None."""
    if os.geteuid() != 0:
        return "chown to another user and unshare need root"
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return "needs unshare and setpriv (util-linux)"
    done = subprocess.run([*BLIND, "true"], capture_output=True, timeout=30, check=False)
    if done.returncode != 0:
        return f"unshare/setpriv refused here: {done.stderr.decode(errors='replace').strip()}"
    return None


_WHY_NOT = _blind_agent_possible()
needs_blind_agent = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")


@contextlib.contextmanager
def blind_processes(
    tmp: Path, *, settle_ms: int, rescan_s: float, scrub_rate: str | None = None
) -> Iterator[Live]:
    """A runtime and a blind agent (see the module docstring) on a fresh tiny model whose
    shards belong to another user."""

    def prepare(model_dir: Path, config: Path) -> None:
        for shard in model_dir.iterdir():
            os.chown(shard, OTHER_UID, OTHER_UID)
        text = config.read_text()
        text = text.replace("rescan_interval_s: 300", f"rescan_interval_s: {rescan_s}")
        scrub = f"\n    scrub_rate: {scrub_rate}" if scrub_rate is not None else ""
        text = text.replace("settle_ms: 100", f"settle_ms: {settle_ms}{scrub}")
        config.write_text(text)

    with live_processes(
        tmp,
        prepare=prepare,
        agent_wrapper=BLIND,
        agent_ready=in_sync,
        stop_agent=stop_blind,
        stop_timeout_s=STOP_S,
    ) as live:
        yield live


def stop_blind(agent: Proc) -> None:
    """SIGTERM to the agent itself: ``unshare --fork`` ignores SIGTERM while it waits for its
    child, and exits with it."""
    pid = agent.popen.pid
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            os.kill(int(child), signal.SIGTERM)
    agent.stop(timeout=STOP_S)


def in_sync(live: Live) -> bool:
    status = status_of(live.agent_status)
    model = (status or {}).get("models", {}).get(MODEL, {})
    link = model.get("link")
    return bool(
        link
        and link["state"] == "idle"
        and link["reconciled_generation"] == model["generation"]
        and link["pending_plan"] is None
    )


def files_fingerprint(live: Live) -> str:
    """The fingerprint of the tensor's bytes in the file now (read afresh)."""
    return fingerprint(open_shard_set(live.first).tensors[TENSOR])


def runtime_has(live: Live, digest: str) -> bool:
    return bool(live.tensor_entry()[Fields.Tensor.FINGERPRINT] == digest)


def identity(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def rows(data: bytes, n: int, *, shift: int) -> bytes:
    """The tensor's ``n`` rows rotated by ``shift`` (reversed for ``shift`` 0): other bytes,
    every row still a valid encoding."""
    size = len(data) // n
    chunks = [data[i * size : (i + 1) * size] for i in range(n)]
    order = list(reversed(chunks)) if shift == 0 else chunks[shift:] + chunks[:shift]
    return b"".join(order)


def mapped(record: TensorRecord) -> tuple[mmap.mmap, bytes]:
    """A shared writable mapping of the shard (its descriptor closed, so no event is sent
    until munmap), and the tensor's bytes now."""
    with open(record.path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    return mapping, bytes(mapping[record.offset : record.offset + record.nbytes])


@needs_blind_agent
@pytest.mark.reliability(
    "faults",
    "a writer the agent cannot see (another PID namespace, no CAP_LEASE) rewrites a tensor "
    "page by page through a shared mapping, pausing less than settle_ms",
    tries=1,
    outcome="held while its identity keeps changing within settle_ms (no event, no writer "
    "seen); only the complete version committed, once; runtime fingerprint = the file's",
)
def test_a_shard_is_read_only_once_its_identity_is_stable(tmp_path: Path) -> None:
    """A writer the probe cannot see rewrites a tensor through a shared mapping one page at a
    time, pausing 0.3 s between pages, while the agent rescans every 0.2 s: the agent holds the
    shard as long as its identity changed within the last settle window (3 s) and plans it
    once, when complete."""
    with blind_processes(tmp_path, settle_ms=3000, rescan_s=0.2) as live:
        record = open_shard_set(live.first).tensors[TENSOR]
        mapping, original = mapped(record)
        new = rows(original, record.ne[-1], shift=0)
        start, end = record.offset, record.offset + record.nbytes
        bounds = [start, *range((start // PAGE + 1) * PAGE, end, PAGE), end]
        assert len(bounds) > 3, "the tensor spans several pages"
        versions = []
        try:
            for a, b in itertools.pairwise(bounds):
                mapping[a:b] = new[a - start : b - start]  # a new page: a new mtime, no event
                time.sleep(0.3)  # the writer's pause, shorter than settle_ms
                versions.append(live.weight_version())
        finally:
            mapping.close()
        assert versions == [0] * len(versions), f"planned while being written: {versions}"
        final = files_fingerprint(live)
        wait_for(lambda: runtime_has(live, final), timeout=WAIT_S, what="the complete version")
        assert live.weight_version() == 1, "committed once: never a torn version"
        live.alive()


@needs_blind_agent
@pytest.mark.reliability(
    "faults",
    "a second write through a MAP_SHARED mapping into pages still dirty (identity unchanged), "
    "by a writer the agent cannot see",
    tries=1,
    outcome="the first write planned once stable; the second (no event, equal identity) found "
    "by the scrub's fresh hash and committed; runtime fingerprint = the file's; served = a "
    "fresh load",
)
def test_a_second_write_into_dirty_mapped_pages_is_found_by_the_scrub(tmp_path: Path) -> None:
    """Issue 16's finding 2: a writer the probe cannot see writes a tensor through a shared
    mapping (the page fault moves mtime: the rescan plans it), then writes other bytes into the
    same, still dirty pages and unmaps: the identity stays equal, so no rescan or event can see
    the change; the scrub's fresh hash does, and the new bytes are committed."""
    with blind_processes(tmp_path, settle_ms=100, rescan_s=1.0) as live:
        record = open_shard_set(live.first).tensors[TENSOR]
        mapping, original = mapped(record)
        start, end = record.offset, record.offset + record.nbytes
        try:
            mapping[start:end] = rows(original, record.ne[-1], shift=0)
            first = identity(record.path)
            written = files_fingerprint(live)
            wait_for(lambda: runtime_has(live, written), timeout=WAIT_S, what="the first write")
            assert live.weight_version() == 1
            mapping[start:end] = rows(original, record.ne[-1], shift=1)  # pages still dirty
        finally:
            mapping.close()  # the close-write event: a scan finds the identity unchanged
        assert identity(record.path) == first, "the premise: the second write left no trace"
        second = files_fingerprint(live)
        assert second != written
        wait_for(lambda: runtime_has(live, second), timeout=WAIT_S, what="the second write")
        assert live.weight_version() == 2
        scrub = live.status(live.agent_status)["models"][MODEL]["link"]["scrub"]
        assert scrub["found"] >= 1, scrub
        assert live.digest() == fresh_digest(live.first), "served = a fresh load of the files"
        live.alive()
