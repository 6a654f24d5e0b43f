"""File-system faults under a live agent and runtime: a real inotify queue overflow, the watched
directory deleted and recreated, a shard flipped by symlink, and a full disk while writing."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_helpers import WAIT_S, CommitLog, Rig
from processes import wait_for
from reliability import record
from runtime_helpers import Q, one_thread
from zygote import Zygote

from ggufswap.shards import atomic_copy

pytestmark = [pytest.mark.process, pytest.mark.usefixtures(one_thread.__name__)]

QUEUE_LIMIT = Path("/proc/sys/fs/inotify/max_queued_events")
DOWN1 = "blk.1.ffn_down_exps.weight"
ATTN_Q2 = "blk.2.attn_q.weight"


def check_version(rig: Rig, commits: CommitLog, version: int, changed: list[str]) -> None:
    """The runtime is at ``version``, its last commit changed exactly ``changed``, and a batch
    on that version equals a fresh load of the files."""
    rig.wait_converged(f"convergence at version {version}")
    assert rig.runtime_status()["weight_version"] == version
    commits.drain(timeout_s=WAIT_S)
    assert len(commits.events) == version, commits.events
    assert commits.events[-1]["changed"] == changed
    assert rig.probe_digest(version) == rig.fresh_digest()


def test_inotify_queue_overflow_while_stopped_rescans_and_converges(rig: Rig) -> None:
    """The agent SIGSTOPped, more events than fs.inotify.max_queued_events, then a shard
    replaced (its events lost) and SIGCONT: the agent sees the overflow, rescans, and the
    runtime gets the update once."""
    limit = int(QUEUE_LIMIT.read_text())
    rig.start_runtime()
    rig.start_agent()
    commits = CommitLog(rig.events)
    try:
        os.kill(rig.agent_pid(), signal.SIGSTOP)
        for i in range(limit):  # each file is IN_CREATE + IN_CLOSE_WRITE: 2 x limit events
            (rig.model.root / f"flood-{i}.tmp").write_bytes(b"")
        rig.model.put(DOWN1, rig.model.variant(DOWN1, Q.Q4_0, rig.tmp / "variants"))
        os.kill(rig.agent_pid(), signal.SIGCONT)
        check_version(rig, commits, 1, [DOWN1])
        # Other rescans (a stale plan, the root check) may be counted before the backend
        # reaches the overflow marker at the end of the flooded queue: wait for that one.
        wait_for(
            lambda: (
                (rig.agent_status_body() or {})
                .get("scans", {})
                .get("rescans", {})
                .get("overflow", 0)
                >= 1
            ),
            timeout=WAIT_S,
            what="a rescan counted for the overflow",
        )
        backends = (rig.agent_status_body() or {})["backends"]
        assert sum(b["overflows"] for b in backends.values()) >= 1, backends
    finally:
        commits.close()
        os.kill(rig.agent_pid(), signal.SIGCONT)  # never leave a stopped agent behind
    record(
        "faults",
        f"inotify queue overflow for real (agent SIGSTOPped, {2 * limit} events, limit {limit})",
        tries=1,
        outcome="overflow seen, full rescan, the lost update applied once; output = fresh load",
        test="test_faults_fs::test_inotify_queue_overflow_while_stopped",
    )


def test_watched_directory_deleted_and_recreated_is_watched_again(rig: Rig) -> None:
    """The model directory removed and recreated (copied back, or renamed into place) with one
    shard changed: only that tensor is re-planned, and later changes are still seen."""
    rig.start_runtime()
    rig.start_agent()
    commits = CommitLog(rig.events)
    backup = rig.tmp / "backup"
    shutil.copytree(rig.model.root, backup)
    variants = rig.tmp / "variants"
    rounds = (
        ("copied back", Q.Q4_0, Q.F16),
        ("renamed into place", Q.Q5_1, Q.Q4_1),
        ("copied back", Q.Q8_0, Q.Q5_0),
    )
    version = 0
    try:
        for how, recreated_type, later_type in rounds:
            changed = rig.model.variant(ATTN_Q2, recreated_type, variants)
            shutil.rmtree(rig.model.root)
            if how == "copied back":
                shutil.copytree(backup, rig.model.root)
                shutil.copyfile(changed, rig.model.shard_of(ATTN_Q2))
            else:
                staging = rig.tmp / "incoming"
                shutil.copytree(backup, staging)
                shutil.copyfile(changed, staging / rig.model.shard_of(ATTN_Q2).name)
                os.rename(staging, rig.model.root)
            version += 1
            check_version(rig, commits, version, [ATTN_Q2])
            rig.model.put(DOWN1, rig.model.variant(DOWN1, later_type, variants))
            version += 1
            check_version(rig, commits, version, [DOWN1])
            shutil.copyfile(rig.model.shard_of(DOWN1), backup / rig.model.shard_of(DOWN1).name)
    finally:
        commits.close()
    record(
        "faults",
        "watched directory deleted and recreated (copied back, renamed into place)",
        tries=len(rounds),
        outcome="re-watched; only the changed tensor re-planned; later changes seen",
        test="test_faults_fs::test_watched_directory_deleted_and_recreated",
    )


def test_shard_replaced_by_a_symlink_flip(tmp_path: Path, zygote: Zygote) -> None:
    """A shard that is a symlink into a versions directory, flipped atomically between versions:
    every flip is one commit of that tensor and the output equals a fresh load."""
    versions = tmp_path / "versions"
    rig = Rig.create(tmp_path, zygote, settle_ms=30, allowed_roots=[tmp_path])
    try:
        shard = rig.model.shard_of(ATTN_Q2)
        targets = {"orig": versions / "orig" / shard.name}
        targets["orig"].parent.mkdir(parents=True)
        shutil.copyfile(shard, targets["orig"])
        for kind in (Q.Q4_0, Q.F16):
            path = versions / kind.name / shard.name
            path.parent.mkdir()
            shutil.copyfile(rig.model.variant(ATTN_Q2, kind, tmp_path / "variants"), path)
            targets[kind.name] = path
        link = shard.with_name(f".{shard.name}.link")
        link.symlink_to(targets["orig"])
        os.replace(link, shard)  # the shard is now a link to identical bytes
        rig.start_runtime()
        rig.start_agent()
        commits = CommitLog(rig.events)
        flips = ["Q4_0", "F16", "orig", "F16", "Q4_0", "orig"]
        try:
            for version, name in enumerate(flips, start=1):
                link.symlink_to(targets[name])
                os.replace(link, shard)
                check_version(rig, commits, version, [ATTN_Q2])
        finally:
            commits.close()
    finally:
        rig.stop()
    record(
        "faults",
        "shard replaced by an atomic symlink flip",
        tries=len(flips),
        outcome="each flip one commit of that tensor; output = fresh load",
        test="test_faults_fs::test_shard_replaced_by_a_symlink_flip",
    )


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root only); skipped where mounting is not permitted."""
    mount = tmp_path / "model"
    mount.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
            check=True,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or str(exc)
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {detail!r}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_forever(fd: int, chunk: bytes) -> None:
    while True:
        os.write(fd, chunk)


def fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte (an ignored hidden file)."""
    filler = directory / ".filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in (65536, 1):
            with pytest.raises(OSError) as full:
                write_forever(fd, b"\0" * chunk)
            assert full.value.errno == errno.ENOSPC, full.value
    finally:
        os.close(fd)
    return filler


def test_disk_full_while_writing_a_replacement_keeps_the_old_shard_serving(
    tmp_path: Path, zygote: Zygote, small_fs: Path
) -> None:
    """On a full file system, a crash-safe replacement fails and leaves the shard as it was, and
    an in-place rewrite leaves a truncated shard that is held: the old weights keep serving,
    unchanged; once space is freed the replacement lands once."""
    rig = Rig.create(tmp_path, zygote, model_dir=small_fs, settle_ms=30)
    variants = tmp_path / "variants"
    big = rig.model.variant(ATTN_Q2, Q.F32, variants)  # 4x the Q8_0 shard's data
    try:
        rig.start_runtime()
        rig.start_agent()
        before = rig.fresh_digest()
        loaded = rig.loaded()
        filler = fill(small_fs)
        shard = rig.model.shard_of(ATTN_Q2)
        with pytest.raises(OSError) as crash_safe:
            atomic_copy(big, shard)
        assert crash_safe.value.errno == errno.ENOSPC
        assert [p.name for p in small_fs.glob(".*.tmp-*")] == [], "temp file left behind"
        fd = os.open(shard, os.O_WRONLY | os.O_TRUNC)
        try:
            with pytest.raises(OSError) as in_place:
                write_all(fd, big.read_bytes())
        finally:
            os.close(fd)
        assert in_place.value.errno == errno.ENOSPC
        assert shard.stat().st_size < big.stat().st_size, "the rewrite was cut short"
        wait_for(
            lambda: (m := rig.agent_model()) is not None and m["shards"]["invalid"] == 1,
            timeout=WAIT_S,
            what="the cut-short shard to be held as invalid",
        )
        wait_for(rig.agent_synced, timeout=WAIT_S, what="the agent to settle")
        status = rig.runtime_status()
        assert status["weight_version"] == 0, status["recent_plans"]
        assert rig.loaded() == loaded
        batches = status["serve"]["batches"]
        wait_for(
            lambda: rig.runtime_status()["serve"]["batches"] > batches + 2,
            timeout=WAIT_S,
            what="more batches",
        )
        assert rig.probe_digest(0) == before, "the old weights keep serving"
        filler.unlink()
        atomic_copy(big, shard)
        rig.wait_converged("the replacement after space was freed")
        assert rig.runtime_status()["weight_version"] == 1
        assert rig.probe_digest(1) == rig.fresh_digest()
    finally:
        rig.stop()
    record(
        "faults",
        "file system full while writing a replacement (crash-safe copy, in-place rewrite)",
        tries=2,
        outcome="old shard keeps serving unchanged (truncated one held); lands once space frees",
        test="test_faults_fs::test_disk_full_while_writing_a_replacement",
    )
