"""Writers that rewrite a shard in place, through real agent and runtime processes.

A writer that keeps its descriptor open and pauses mid-write (here on a preallocated file, the
worst case: the unwritten part reads as zeros) must never get a mixed version planned: the agent
holds the shard while anyone has it open for writing and plans it once the writer is done.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile import MODEL, TENSOR, Live, live_processes
from processes import wait_for
from runtime_helpers import Q

from ggufswap.agent.reconcile import reconcile
from ggufswap.agent.scrub import Scrubber
from ggufswap.agent.writers import writer_of
from ggufswap.config import VerifyMode
from ggufswap.ipc import Fields, SlotState, TensorEntry
from ggufswap.shards import (
    Fingerprinter,
    Layout,
    TensorRecord,
    fingerprint,
    open_shard_set,
    requantize,
    tiny_moe,
    write_model,
)

WAIT_S = 60.0


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    with live_processes(tmp_path) as processes:
        yield processes


def writing(live: Live) -> list[dict[str, Any]]:
    model = live.status(live.agent_status).get("models", {}).get(MODEL, {})
    return list(model.get("writing_shards", []))


def test_the_lease_probe_sees_descriptors_and_shared_mappings(tmp_path: Path) -> None:
    """``writer_of`` names a file open for writing, or mapped shared and writable after its
    descriptor closed; a file only open for reading, or no longer open, has no writer."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 4096)
    assert writer_of(str(path)) is None
    with open(path, "rb"):
        assert writer_of(str(path)) is None
    with open(path, "r+b") as f:
        assert writer_of(str(path)) is not None
        mapping = mmap.mmap(f.fileno(), 4096)
    assert writer_of(str(path)) is not None  # the mapping keeps the file open for writing
    mapping.close()
    assert writer_of(str(path)) is None


@pytest.mark.process
@pytest.mark.reliability(
    "faults",
    "in-place writer: preallocates the shard, writes half, pauses with the descriptor open",
    tries=1,
    outcome="held while open for writing (never planned torn or zero-filled); the complete "
    "version committed once after close; runtime fingerprint = the final file's",
)
def test_an_in_place_writer_pausing_mid_write_is_never_planned(live: Live) -> None:
    """While a writer holds the shard open mid-rewrite the agent reports it as being written and
    plans nothing; after the writer closes it, the complete new version is committed once."""
    shard = Path(open_shard_set(live.first).tensors[TENSOR].path)
    new = shard.parent.parent / "new.gguf"
    requantize(shard, TENSOR, Q.Q4_0, out=new)
    data = new.read_bytes()
    half = len(data) // 2
    assert live.weight_version() == 0
    with open(shard, "r+b") as f:
        f.truncate(0)
        f.truncate(len(data))  # preallocated: the rest reads as zeros until written
        f.write(data[:half])
        f.flush()
        os.fsync(f.fileno())
        wait_for(
            lambda: writing(live) or live.weight_version() != 0,
            timeout=WAIT_S,
            what="the shard held as being written, or a plan from it",
        )
        assert live.weight_version() == 0, "a plan was made from a file being written"
        held = writing(live)
        assert held[0]["path"] == str(shard), held
        assert "open for writing" in held[0]["reason"], held
        # Scans while it is open keep holding it (each settle window looks again).
        scans = live.status(live.agent_status)["scans"]["count"]
        wait_for(
            lambda: live.status(live.agent_status)["scans"]["count"] >= scans + 3,
            timeout=WAIT_S,
            what="three more scans",
        )
        assert writing(live), "still held while the writer has it open"
        assert live.weight_version() == 0, "nothing is planned from a file being written"
        f.write(data[half:])
    wait_for(lambda: live.weight_version() == 1, timeout=WAIT_S, what="the commit")
    wait_for(lambda: not writing(live), timeout=WAIT_S, what="the hold released")
    entry = live.tensor_entry()
    final = open_shard_set(live.first).tensors[TENSOR]
    assert entry[Fields.Tensor.FINGERPRINT] == Fingerprinter()(final)
    assert live.weight_version() == 1, "committed exactly once"
    live.alive()


def reconciled(live: Live) -> bool:
    """The link has planned from the latest scan and has nothing in flight."""
    model = live.status(live.agent_status).get("models", {}).get(MODEL, {})
    link = model.get("link")
    return bool(
        link
        and link["reconciled_generation"] == model["generation"]
        and link["pending_plan"] is None
    )


def rows_reversed(data: bytes, rows: int) -> bytes:
    """The tensor's rows in reverse order: other bytes, every row still a valid encoding."""
    size = len(data) // rows
    return b"".join(data[i * size : (i + 1) * size] for i in reversed(range(rows)))


def runtime_has_the_files_bytes(live: Live) -> bool:
    record = open_shard_set(live.first).tensors[TENSOR]
    return bool(live.tensor_entry()[Fields.Tensor.FINGERPRINT] == fingerprint(record))


def rewrite_in_place(path: str) -> None:
    """Write a file's own bytes back through a descriptor: events (modify, close-write) and a
    new identity, the same content."""
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(data)


@pytest.mark.process
@pytest.mark.reliability(
    "faults",
    "writes through a MAP_SHARED mapping made after the descriptor closed (no inotify event)",
    tries=1,
    outcome="held while mapped writable, even by scans that other files' events cause; the new "
    "bytes committed once after munmap; runtime fingerprint = the file's bytes",
)
def test_writes_through_a_shared_mapping_are_loaded_after_munmap(live: Live) -> None:
    """A process maps the shard shared and writable, closes its descriptor and writes through
    the mapping: no event (the mapping keeps the file open: its close-write comes at munmap),
    but the page fault moved the shard's mtime. Another shard's event makes the agent scan
    while the mapping exists: it holds the mapped shard instead of loading it half written, and
    loads the new bytes once, after munmap.

    (Without the hold this test's earlier form passed as well: nothing made the agent scan
    while the file was mapped, and munmap's close-write planned the final bytes.)"""
    shards = open_shard_set(live.first).tensors
    record = shards[TENSOR]
    other = next(r for name, r in sorted(shards.items()) if r.path != record.path)
    rows = record.nbytes // (record.nbytes // max(1, record.ne[-1]))
    wait_for(lambda: reconciled(live), timeout=WAIT_S, what="the agent in sync")
    assert live.weight_version() == 0
    start, end = record.offset, record.offset + record.nbytes
    with open(record.path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    try:
        original = bytes(mapping[start:end])
        mapping[start:end] = rows_reversed(original, rows)
        scans = live.status(live.agent_status)["scans"]["count"]
        rewrite_in_place(other.path)  # events about another shard: the model is scanned
        wait_for(
            lambda: live.status(live.agent_status)["scans"]["count"] > scans and reconciled(live),
            timeout=WAIT_S,
            what="a scan while the shard is mapped, and the link's plan from it",
        )
        # The other shard may be held too for a while: a scan its events started can find its
        # writer still at work (its close-write brings the scan that releases it).
        paths = wait_for(
            lambda: (p := [h["path"] for h in writing(live)]) == [record.path] and p,
            timeout=WAIT_S,
            what="the mapped shard alone held as open for writing",
        )
        assert paths == [record.path]
        assert live.weight_version() == 0, "planned from a file mapped writable"
    finally:
        mapping.close()  # no msync: the pages are still dirty
    wait_for(lambda: runtime_has_the_files_bytes(live), timeout=WAIT_S, what="the new bytes")
    assert live.weight_version() == 1
    live.alive()


@pytest.mark.reliability(
    "faults",
    "bytes changed under an equal file identity (a second write into dirty mapped pages)",
    tries=1,
    outcome="the scrub's fresh hash differs from the runtime's: reported, planned by "
    "fingerprint; equal bytes not reported",
)
def test_the_scrub_finds_bytes_changed_under_an_equal_identity(tmp_path: Path) -> None:
    """When the runtime's fingerprint of a tensor differs from its bytes on disk although the
    record (file identity included) is equal, the scrub reports it (what a second write into
    dirty mapped pages leaves: new bytes, the same mtime and ctime); equal bytes are not
    reported."""
    first = Path(write_model(tiny_moe(), tmp_path, layout=Layout.PER_TENSOR)[0])
    record = open_shard_set(first).tensors[TENSOR]
    entry = TensorEntry(record=record, fingerprint=fingerprint(record), slot=SlotState.ON_ORIGINAL)
    found: list[tuple[int, TensorRecord, str]] = []
    stale: list[bool] = []

    def scrubber(*loaded: TensorEntry) -> Scrubber:
        return Scrubber(
            model=MODEL,
            rate=1 << 30,
            view=lambda: ({TENSOR: record}, [{TENSOR: e} for e in loaded]),
            on_changed=lambda i, r, d: found.append((i, r, d)),
            on_stale=lambda: stale.append(True),
        )

    scrubber(entry).step()
    assert (found, stale) == ([], [])
    changed = dataclasses.replace(entry, fingerprint="0" * 32)  # the runtime loaded other bytes
    scrubber(changed).step()
    assert found == [(0, record, fingerprint(record))]
    assert stale == []
    plan = reconcile(
        {TENSOR: record},
        {TENSOR: changed},
        model=MODEL,
        base_version=0,
        verify=VerifyMode.CHECKSUM,
        fingerprint=fingerprint,
        suspect=frozenset({TENSOR}),
    ).plan
    assert plan is not None
    assert plan.names() == (TENSOR,)


def test_a_file_changed_under_the_scrub_is_routine_and_logged_at_info(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A shard rewritten since the scan (its identity no longer the record's) makes the scrub
    ask for a re-scan and log ``scrub.file_changed`` at info level, saying why, without an
    ``error`` field: an in-place change is routine, not a failure."""
    first = Path(write_model(tiny_moe(), tmp_path, layout=Layout.PER_TENSOR)[0])
    record = open_shard_set(first).tensors[TENSOR]
    entry = TensorEntry(record=record, fingerprint=fingerprint(record), slot=SlotState.ON_ORIGINAL)
    stale: list[bool] = []
    scrubber = Scrubber(
        model=MODEL,
        rate=1 << 30,
        view=lambda: ({TENSOR: record}, [{TENSOR: entry}]),
        on_changed=lambda i, r, d: None,
        on_stale=lambda: stale.append(True),
    )
    with open(record.path, "r+b") as f:
        f.truncate(record.offset)  # a writer rewriting it in place
    scrubber.step()
    assert stale == [True]
    out = capfd.readouterr()
    lines = (out.out + out.err).splitlines()
    [line] = [ln for ln in lines if "scrub.file_changed" in ln]
    # structlog's console line ("[info ] ... why=...") or a configured JSON line.
    assert "[info" in line or '"level": "info"' in line, line
    assert "why" in line, line
    assert "error=" not in line, line
    assert '"error"' not in line, line


@pytest.mark.reliability(
    "faults",
    "bytes changed under an equal identity, on a model served by 3 runtimes (replicas)",
    tries=1,
    outcome="one scrub per model: each tensor hashed once per pass (not once per runtime) and "
    "compared with every runtime's fingerprint; only the runtime holding other bytes is told",
)
def test_one_scrub_per_model_compares_every_runtime(tmp_path: Path) -> None:
    """With several runtimes of one model, the scrub hashes each tensor once and tells only the
    runtimes whose fingerprint differs from the file's bytes."""
    first = Path(write_model(tiny_moe(), tmp_path, layout=Layout.PER_TENSOR)[0])
    record = open_shard_set(first).tensors[TENSOR]
    same = TensorEntry(record=record, fingerprint=fingerprint(record), slot=SlotState.ON_ORIGINAL)
    other = dataclasses.replace(same, fingerprint="0" * 32)
    found: list[int] = []
    scrubber = Scrubber(
        model=MODEL,
        rate=1 << 30,
        view=lambda: ({TENSOR: record}, [{TENSOR: same}, {TENSOR: other}, {TENSOR: same}]),
        on_changed=lambda i, r, d: found.append(i),
        on_stale=lambda: None,
    )
    scrubber.step()
    assert found == [1]
    assert scrubber.hashed_bytes == record.nbytes, "hashed once for the three runtimes"
    assert scrubber.found == 1


# A writer opens the file in the moment the probe holds its lease (the fcntl call that takes it
# is made to wait for that writer): the break signals the probing process. Run as a script with
# the path; prints what writer_of said.
_RACE = """
import fcntl, subprocess, sys, time
from ggufswap._signals import ProcessSignals
from ggufswap.agent import writers
from ggufswap.shards import leases

path = sys.argv[1]
if sys.argv[2] == "agent":
    ProcessSignals().install()  # what `ggufswap agent` does at start
real = fcntl.fcntl

def racing(fd, cmd, arg=0):
    out = real(fd, cmd, arg)
    if cmd == fcntl.F_SETLEASE and arg == fcntl.F_RDLCK:
        writer = subprocess.Popen([sys.executable, "-c", f"open({path!r}, 'r+b').close()"])
        deadline = time.monotonic() + 30
        while not leases.breaking(fd) and time.monotonic() < deadline:
            time.sleep(0.01)  # the lease is broken: SIGIO has been sent to this process
        time.sleep(0.1)
        writers.racing_writer = writer
    return out

fcntl.fcntl = racing
print("writer_of:", writers.writer_of(path), flush=True)
writers.racing_writer.wait(timeout=30)
"""


@pytest.mark.process
@pytest.mark.parametrize("process", ["agent", "library"])
def test_a_writer_racing_the_lease_probe_does_not_kill_the_prober(
    tmp_path: Path, process: str
) -> None:
    """The break of the probe's lease sends ``SIGIO``, whose default action is to terminate:
    the agent (and a library caller of writer_of from the main thread) handles it, and says
    no one was writing (the writer opened only after the probe began)."""
    path = tmp_path / "shard.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    done = subprocess.run(
        [sys.executable, "-c", _RACE, str(path), process],
        check=False,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, f"prober died ({done.returncode}): {done.stderr[-2000:]}"
    assert "writer_of: None" in done.stdout
