"""Writers the read lease cannot stop, against a runtime serving mapped shards (issue 28, breaks 2
and 4): an ``open(O_RDONLY | O_TRUNC)``, which truncates a file without breaking a read lease,
and a writer the kernel lets in after ``fs.lease-break-time`` while the runtime is stopped.

Neither may change the served weights silently: the runtime must stay alive (no ``SIGBUS``),
take the tensors whose bytes changed out of service and refuse batches (every weight version
keeps one probe digest), say so in its status and log, keep its lease watcher alive, and serve
again once the agent's plan restores them; then a batch equals a fresh load of the files.

Each test runs a real runtime (a zygote's child, probe mode, ``map_shards: true``) and a real
agent on the per-tensor tiny model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_helpers import WAIT_S, Rig
from processes import wait_for
from runtime_helpers import one_thread

pytestmark = [
    pytest.mark.process,
    pytest.mark.rig(map_shards=True),
    pytest.mark.usefixtures(one_thread.__name__),  # fresh loads as the runtime computes
]

TENSOR = "blk.1.ffn_down_exps.weight"
SHORT_BREAK_S = 2  # fs.lease-break-time for the forced-break test, when the sysctl is writable


def _versions_served_one_digest(rig: Rig) -> dict[str, Any]:
    """Every weight version the runtime served batches on gave one probe digest."""
    results = rig.runtime_status()["serve"]["results"]
    mixed = {v: r for v, r in results.items() if r.get("distinct_digests", 1) != 1}
    assert not mixed, f"weight versions with more than one output: {mixed}"
    return dict(results)


def _lost(rig: Rig) -> int:
    return int(rig.runtime_status().get("weights_lost", {}).get("count", 0))


def _refused(rig: Rig) -> int:
    return int(rig.runtime_status()["serve"].get("refused_batches", 0))


def _log(rig: Rig) -> str:
    return rig.runtime.log() if rig.runtime is not None else ""


def _restored_and_fresh(rig: Rig, before: int) -> None:
    """The runtime converges to the files (the agent's plan restored what was lost), serves
    again, and a batch on the new version equals a fresh load of the files."""
    rig.wait_converged("the lost tensor restored from its file")
    version = rig.wait_version_above(before)
    assert rig.probe_digest(version) == rig.fresh_digest()
    _versions_served_one_digest(rig)
    wait_for(lambda: _lost(rig) == 0, timeout=WAIT_S, what="no tensor out of service")


@pytest.mark.reliability(
    "faults",
    "open(O_RDONLY|O_TRUNC) of a shard served from a mapping (truncates without a lease break)",
    tries=1,
    outcome="no SIGBUS (the guard reads zeros past the end); the tensor taken out of service "
    "and batches refused (one digest per version); restored by the agent's plan once the file "
    "is whole, then served = fresh load",
)
def test_a_truncation_without_a_lease_break_takes_the_tensor_out_of_service(rig: Rig) -> None:
    """A shard truncated by ``open(O_RDONLY | O_TRUNC)`` neither kills the mapped runtime nor
    changes what it serves: its tensor is out of service (status, log, refused batches) until
    the file is whole again and the agent's plan restores it."""
    rig.start_runtime()
    rig.start_agent()
    version = rig.runtime_status()["weight_version"]
    assert rig.probe_digest(version) == rig.fresh_digest()
    path = rig.model.shard_of(TENSOR)
    whole = path.read_bytes()
    refused = _refused(rig)
    os.close(os.open(path, os.O_RDONLY | os.O_TRUNC))  # no lease break: the file is 0 bytes
    assert path.stat().st_size == 0
    wait_for(
        lambda: not rig.runtime_alive() or _lost(rig) == 1,
        timeout=WAIT_S,
        what="the tensor out of service (or the runtime dead)",
    )
    assert rig.runtime_alive(), f"the runtime died:\n{_log(rig)[-3000:]}"
    wait_for(lambda: _refused(rig) > refused, timeout=WAIT_S, what="batches refused")
    _versions_served_one_digest(rig)
    status = rig.runtime_status()
    assert list(status["weights_lost"]["tensors"]) == [TENSOR], status["weights_lost"]
    assert "truncated under its mapping" in status["weights_lost"]["tensors"][TENSOR]
    path.write_bytes(whole)  # the lease was given up: this writer does not wait
    _restored_and_fresh(rig, version)
    log = _log(rig)
    for line in ("mapping.compromised", "weights.lost", "weights.restored"):
        assert line in log, f"no {line} in the runtime's log"
    assert "thread.crashed" not in log


@contextlib.contextmanager
def _lease_break_time(seconds: int) -> Iterator[float]:
    """``fs.lease-break-time`` set to ``seconds`` where this process may write it (root), and
    restored after; else left as it is. Yields the value in force."""
    path = Path("/proc/sys/fs/lease-break-time")
    before = path.read_text().strip()
    try:
        path.write_text(str(seconds))
    except OSError:
        yield float(before)
        return
    try:
        yield float(seconds)
    finally:
        path.write_text(before)


_WRITER = """
import os, sys, time
path, offset = sys.argv[1], int(sys.argv[2])
started = time.monotonic()
fd = os.open(path, os.O_RDWR)  # waits for the lease holder, which is stopped
waited = time.monotonic() - started
os.pwrite(fd, b"\\xa5\\xa5\\xa5\\xa5", offset)
os.close(fd)
print(round(waited, 3))
"""


@pytest.mark.reliability(
    "faults",
    "kill -STOP the mapped runtime; a writer opens a shard O_RDWR, waits out "
    "fs.lease-break-time and pwrites 4 bytes of a tensor; kill -CONT",
    tries=1,
    outcome="the forced break found at the next batch boundary (the watcher's pass is older than "
    "the break time; releasing the lost lease raises nothing); the changed tensor out of "
    "service, the batch that ran across the stop dropped: one digest per version; the watcher "
    "lives; the writer's bytes committed by the agent's plan, served = fresh load",
)
def test_a_lease_the_kernel_broke_while_stopped_never_changes_served_weights(rig: Rig) -> None:
    """A writer let in by the kernel while the runtime was stopped changes a tensor's bytes
    under its mapping: after ``SIGCONT`` the runtime takes that tensor out of service before
    any batch can serve it (no weight version gives two outputs), its lease watcher survives
    the lost lease, and the agent's plan brings the writer's bytes in by a commit. Uses a
    2-second ``fs.lease-break-time`` where the sysctl is writable (restored after), else waits
    out the kernel's own (45 s by default)."""
    rig.start_runtime()
    rig.start_agent()
    assert rig.runtime is not None
    version = rig.runtime_status()["weight_version"]
    assert rig.probe_digest(version) == rig.fresh_digest()
    record = rig.model.record(TENSOR)
    with _lease_break_time(SHORT_BREAK_S) as break_s:
        os.kill(rig.runtime.pid, signal.SIGSTOP)
        try:
            writer = subprocess.run(
                [sys.executable, "-c", _WRITER, record.path, str(record.offset)],
                capture_output=True,
                text=True,
                timeout=break_s + WAIT_S,
                check=True,
            )
            time.sleep(0.2)  # the stopped runtime stays stopped a moment after the write
        finally:
            os.kill(rig.runtime.pid, signal.SIGCONT)
    assert float(writer.stdout) >= break_s - 0.5, f"the writer waited {writer.stdout} s"
    _restored_and_fresh(rig, version)
    assert rig.runtime_alive(), f"the runtime died:\n{_log(rig)[-3000:]}"
    log = _log(rig)
    assert "thread.crashed" not in log, log[-3000:]
    assert "kernel broke its read lease" in log
    status = rig.runtime_status()
    assert status["mapped_shards"]["compromised"] >= 1, status["mapped_shards"]
    assert status["threads"]["ggufswap-leases"]["restarts"] == 0, status["threads"]
