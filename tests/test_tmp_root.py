"""The tests' ``tmp_path`` root (tests/tmp_root.py): in memory where it has room, one per
session, and the directories of killed sessions removed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import tmp_root


def test_a_session_gets_its_own_directory_named_for_its_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room in the parent, each call makes a fresh directory named with this pid."""
    monkeypatch.setenv(tmp_root.ENV, str(tmp_path))
    monkeypatch.setattr(tmp_root, "MIN_FREE_BYTES", 1)
    first, second = tmp_root.session_root(), tmp_root.session_root()
    assert first is not None
    assert second is not None
    assert first != second
    assert first.parent == tmp_path
    assert first.name.startswith(f"{tmp_root.PREFIX}{os.getpid()}-")


@pytest.mark.parametrize("named", ["", "missing", "small"])
def test_no_room_or_no_parent_keeps_pytests_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, named: str
) -> None:
    """An empty setting, a missing parent, or one with less free space than the suite writes
    give None (pytest's own default), and nothing is created."""
    parent = {"": "", "missing": str(tmp_path / "nowhere"), "small": str(tmp_path)}[named]
    monkeypatch.setenv(tmp_root.ENV, parent)
    monkeypatch.setattr(tmp_root, "MIN_FREE_BYTES", 1 << 62)
    assert tmp_root.session_root() is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_a_killed_sessions_directory_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    """A directory named for a process that has ended is removed; one of a live process (this
    one) and a name that is not a session's stay."""
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = tmp_path / f"{tmp_root.PREFIX}{int(ended.stdout)}-abc"
    live = tmp_path / f"{tmp_root.PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{tmp_root.PREFIX}x-ghi"
    for d in (dead, live, other):
        (d / "sub").mkdir(parents=True)
    tmp_root.remove_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def test_a_failed_tests_directory_is_copied_out_without_its_sockets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keep_failed`` copies a test's directory (its logs) where it outlives the session,
    leaving out what cannot be copied (a Unix socket), and names the copy after the test;
    ``in_memory`` tells a session directory's paths from others."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "system-tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    (tmp_path / "system-tmp").mkdir()
    test_dir = tmp_path / f"{tmp_root.PREFIX}1-x" / "popen-gw0" / "test_a0"
    (test_dir / "run").mkdir(parents=True)
    (test_dir / "run" / "runtime.log").write_text("evidence")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(test_dir / "run" / "rt.sock"))
    assert tmp_root.in_memory(test_dir)
    assert not tmp_root.in_memory(Path("/tmp/pytest-of-root/pytest-1/test_a0"))
    kept = tmp_root.keep_failed(test_dir, "tests/test_x.py::test_a[p/1]")
    assert kept.parent == tmp_path / "system-tmp" / f"ggufswap-failed-{os.getuid()}"
    assert kept.name == "tests_test_x.py_test_a_p_1_"
    assert (kept / "run" / "runtime.log").read_text() == "evidence"
    assert not (kept / "run" / "rt.sock").exists()
