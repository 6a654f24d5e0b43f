"""``ggufswap install-systemd --prefix DIR`` writes units that ``systemd-analyze verify`` accepts,
naming this installation's executable, plus users, the socket directory and config skeletons
that connect (no systemd runs here: a scratch root stands for the host)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from processes import GGUFSWAP, run_ggufswap

from ggufswap.config import load_config

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(
        SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (package systemd)"
    ),
]
TIMEOUT_S = 60


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    result = run_ggufswap("install-systemd", "--prefix", root)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return root


def test_written_units_verify_and_run_this_installation(root: Path) -> None:
    """Both units (and an instance of the template) pass ``systemd-analyze verify`` with no
    output; ExecStart= is this venv's ggufswap, which exists; the docs they name are written."""
    units = root / "etc/systemd/system"
    for unit in ("ggufswap-agent.service", "ggufswap-runtime@gemma.service"):
        assert SYSTEMD_ANALYZE is not None
        result = tool(SYSTEMD_ANALYZE, "verify", "--man=no", str(units / unit))
        assert (result.returncode, result.stderr) == (0, ""), f"{unit}:\n{result.stderr}"
    for unit in ("ggufswap-agent.service", "ggufswap-runtime@.service"):
        text = (units / unit).read_text()
        (exec_start,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
        assert exec_start.split()[0] == f"ExecStart={GGUFSWAP}", exec_start
        assert os.access(GGUFSWAP, os.X_OK)
        docs = [line for line in text.splitlines() if line.startswith("Documentation=")]
        for doc in docs:
            name = doc.removeprefix("Documentation=file:///usr/share/doc/ggufswap/")
            assert (root / "usr/share/doc/ggufswap" / name).is_file(), doc


def test_sysusers_and_tmpfiles_make_the_socket_directory_the_docs_describe(root: Path) -> None:
    """The written sysusers and tmpfiles entries, applied to the scratch root, create the user and
    /run/ggufswap owned by it, mode 0750 (group members may enter, not write)."""
    sysusers, tmpfiles = shutil.which("systemd-sysusers"), shutil.which("systemd-tmpfiles")
    assert sysusers is not None
    assert tmpfiles is not None
    result = tool(sysusers, f"--root={root}", str(root / "etc/sysusers.d/ggufswap.conf"))
    assert result.returncode == 0, result.stderr
    passwd = (root / "etc/passwd").read_text()
    uid = int(
        next(line for line in passwd.splitlines() if line.startswith("ggufswap:")).split(":")[2]
    )
    result = tool(
        tmpfiles, f"--root={root}", "--create", str(root / "etc/tmpfiles.d/ggufswap.conf")
    )
    assert result.returncode == 0, result.stderr
    run_dir = (root / "run/ggufswap").stat()
    assert stat.S_IMODE(run_dir.st_mode) == 0o750
    assert run_dir.st_uid == uid


def test_config_skeletons_validate_and_connect(root: Path) -> None:
    """The agent skeleton's model dials the socket the runtime skeleton binds; a second run keeps
    edited configuration files."""
    etc = root / "etc/ggufswap"
    environ = {"RUNTIME_DIRECTORY": "/run/ggufswap"}
    agent = load_config(etc / "config.yaml", environ=environ)
    runtime = load_config(etc / "example.yaml", environ=environ).require_runtime()
    assert agent.model(runtime.name).runtime == runtime.control_endpoint
    assert runtime.serve.mode.value == "http"
    assert stat.S_IMODE((etc / "config.yaml").stat().st_mode) == 0o640
    (etc / "config.yaml").write_text("# edited\n")
    again = run_ggufswap("install-systemd", "--prefix", root)
    assert again.returncode == 0, again.stderr
    assert (etc / "config.yaml").read_text() == "# edited\n"
    assert "kept" in again.stdout


def test_a_missing_executable_is_one_clear_line(tmp_path: Path) -> None:
    """--executable naming nothing fails with one line that says what to pass."""
    result = run_ggufswap(
        "install-systemd", "--prefix", tmp_path, "--executable", tmp_path / "nothing"
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "--executable" in result.stderr


@pytest.mark.parametrize(
    ("where", "directive"),
    [
        ("/home/someone/venv/bin/ggufswap", "ProtectHome"),
        ("/tmp/venv/bin/ggufswap", "PrivateTmp"),
        ("/root/.venv/bin/ggufswap", "ProtectHome"),
        ("/opt/ggufswap/bin/ggufswap", None),
    ],
)
def test_an_executable_the_units_hide_is_named(where: str, directive: str | None) -> None:
    """An ExecStart= under /home, /root or /tmp (hidden by ProtectHome=/PrivateTmp=) is named
    with the directive; /opt is fine."""
    from ggufswap._cmd_install import hidden_by_units

    reason = hidden_by_units(Path(where))
    if directive is None:
        assert reason is None
    else:
        assert reason is not None
        assert directive in reason, reason


@pytest.mark.process
def test_a_venv_in_tmp_is_refused_on_the_host_and_warned_in_a_scratch_root(tmp_path: Path) -> None:
    """A ggufswap whose venv lives under /tmp: one line naming PrivateTmp and the /opt/ggufswap
    fix; a scratch --prefix still gets its files (for review), the host (--prefix /) nothing."""
    # The venv in /tmp itself: tmp_path may be elsewhere (tests/tmp_root.py puts it in /dev/shm).
    venv = Path(tempfile.mkdtemp(prefix="gs-venv-", dir="/tmp"))
    try:
        script = venv / "bin" / "ggufswap"
        script.parent.mkdir()
        script.write_text(f"#!{venv}/bin/python\n")
        script.chmod(0o755)
        prefix = tmp_path / "root"
        scratch = run_ggufswap("install-systemd", "--prefix", prefix, "--executable", script)
    finally:
        shutil.rmtree(venv)
    assert scratch.returncode == 0, scratch.stderr
    (line,) = scratch.stderr.strip().splitlines()
    assert "PrivateTmp=yes" in line, line
    assert "/opt/ggufswap" in line, line
    assert (tmp_path / "root/etc/systemd/system/ggufswap-agent.service").exists()
