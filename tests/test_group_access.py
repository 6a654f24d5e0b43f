"""Members of the socket directory's group can run ``ggufswap status``, as docs/operations.md
says: in a 0750 directory (systemd's /run/ggufswap) the status sockets are 0660, the control and
events sockets stay 0600, and the default socket directory is found without write access."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import GGUFSWAP, PROBE_YAML, Proc, status_of, wait_for

from ggufswap.config import endpoints
from ggufswap.shards import tiny_dense, write_model

OTHER_UID = 1  # daemon: a user that is neither the socket's owner nor root
GROUP_GID = 65534  # nogroup: the socket directory's group, given to that user alone
SETPRIV = shutil.which("setpriv")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A socket directory as systemd makes /run/ggufswap: mode 0750, group GROUP_GID. Under the
    units the daemons' own group is ggufswap, so their sockets get it; here the setgid bit gives
    the sockets the directory's group instead."""
    path = Path(tempfile.mkdtemp(prefix="gs-group-"))
    os.chown(path, -1, GROUP_GID)
    path.chmod(0o2750)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_group_member(*args: str) -> subprocess.CompletedProcess[str]:
    assert SETPRIV is not None
    return subprocess.run(
        [SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", f"--groups={GROUP_GID}",
         GGUFSWAP, *args],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "HOME": "/tmp"},
    )  # fmt: skip


@pytest.mark.reliability(
    "security",
    "ggufswap status by a group member on the 0600 control socket (permission denied)",
    tries=1,
    outcome="refused at once as 'permission denied' naming the socket's mode and owner, not "
    "reported as 'no reply' after the timeout",
)
@pytest.mark.process
def test_status_sockets_admit_the_group_and_control_does_not(
    tmp_path: Path, shared_dir: Path
) -> None:
    """A runtime in a 0750 directory makes its status socket 0660 and its control and events
    sockets 0600; another user in the directory's group gets the status, and is told
    "permission denied" by the control socket."""
    first = write_model(tiny_dense(), tmp_path / "model")[0]
    config = tmp_path / "m.yaml"
    config.write_text(f"runtime: {{model: {first}, serve: {PROBE_YAML}}}\n")
    proc = Proc(
        ["runtime", "--config", str(config)],
        log=tmp_path / "runtime.log",
        env={"RUNTIME_DIRECTORY": str(shared_dir)},
    )
    try:
        wait_for(lambda: status_of(f"ipc://{shared_dir}/m.sock"), timeout=60, what="the runtime")
        modes = {
            name: stat.S_IMODE((shared_dir / name).stat().st_mode)
            for name in ("m.sock", "m.status.sock", "m.events.sock")
        }
        assert modes == {"m.sock": 0o600, "m.status.sock": 0o660, "m.events.sock": 0o600}
        if os.geteuid() != 0 or SETPRIV is None:
            pytest.skip("switching to another user needs root and setpriv")
        member = as_group_member("status", f"ipc://{shared_dir}/m.status.sock", "--json")
        assert member.returncode == 0, member.stderr
        assert '"weight_version": 0' in member.stdout
        control = as_group_member("status", f"ipc://{shared_dir}/m.sock", "--timeout", "1")
        assert control.returncode != 0
        # Said as it is (libzmq would retry the refused connect silently: "no reply").
        assert "permission denied" in control.stdout + control.stderr, control
        assert "no reply" not in control.stdout + control.stderr, control
    finally:
        assert proc.stop() == 0, proc.log()


def test_default_socket_dir_needs_no_write_access(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/run/ggufswap is the default socket directory for a user who may only enter it."""
    run = tmp_path / "run-ggufswap"
    run.mkdir(mode=0o750)
    monkeypatch.setattr(endpoints, "DEFAULT_RUNTIME_DIR", run)
    calls: list[int] = []

    def access(path: object, mode: int) -> bool:
        calls.append(mode)
        return not mode & os.W_OK  # searchable, not writable: a group member's view

    monkeypatch.setattr(endpoints.os, "access", access)
    assert endpoints.default_runtime_dir(environ={"XDG_RUNTIME_DIR": "/xdg"}) == run
    assert calls, "the directory's access was checked"
