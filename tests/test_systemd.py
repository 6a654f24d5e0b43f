"""The unit files pass the installed ``systemd-analyze`` (no running systemd needed).

Each unit is copied into ``tmp_path`` with its ``ExecStart=`` executable rewritten to one that
exists here (``verify`` checks that it is executable). ``verify`` does not resolve ``User=``;
instead the sysusers file is applied with ``systemd-sysusers --root`` to a scratch root, and the
units' ``User=``/``Group=`` must be what it creates. Exposure thresholds are in docs/operations.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SYSTEMD_DIR = Path(__file__).resolve().parent.parent / "systemd"
AGENT_UNIT = "ggufswap-agent.service"
RUNTIME_TEMPLATE = "ggufswap-runtime@.service"
RUNTIME_INSTANCE = "ggufswap-runtime@demo-moe.service"
SYSUSERS_FILE = "ggufswap.sysusers.conf"
SHIPPED_BINARY = "/usr/local/bin/ggufswap"

# `systemd-analyze security` exposure (0 safest .. 10), documented in docs/operations.md.
# Measured with systemd 252: agent 0.9, runtime 1.4.
EXPOSURE_THRESHOLD = {AGENT_UNIT: 1.5, RUNTIME_INSTANCE: 2.0}

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (package systemd)"
)
OVERALL = re.compile(r"Overall exposure level for (\S+): (\d+\.\d+)")
TIMEOUT_S = 60


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Section → key → every value (unit files repeat keys such as DeviceAllow=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = defaultdict(list)
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), defaultdict(list))
            continue
        key, _, value = line.partition("=")
        current[key.strip()].append(value.strip())
    return sections


def local_executable() -> str:
    """An executable that exists here: the venv's ``ggufswap`` script, else the interpreter."""
    script = Path(sys.executable).parent / "ggufswap"
    return str(script) if script.is_file() else sys.executable


def install_units(directory: Path, *, extra_service_line: str | None = None) -> Path:
    """Copy the shipped units into ``directory`` with ExecStart= pointing at a local executable."""
    for name in (AGENT_UNIT, RUNTIME_TEMPLATE):
        text = (SYSTEMD_DIR / name).read_text()
        assert f"ExecStart={SHIPPED_BINARY} " in text, f"{name}: ExecStart= is not {SHIPPED_BINARY}"
        text = text.replace(f"ExecStart={SHIPPED_BINARY} ", f"ExecStart={local_executable()} ")
        if extra_service_line is not None:
            text = text.replace("[Service]\n", f"[Service]\n{extra_service_line}\n")
        (directory / name).write_text(text)
    return directory


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run(
        [SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


@pytest.mark.process
@pytest.mark.parametrize("unit", [AGENT_UNIT, RUNTIME_TEMPLATE, RUNTIME_INSTANCE])
def test_verify_is_clean(tmp_path: Path, unit: str) -> None:
    """``systemd-analyze verify`` accepts each unit and prints no warning at all."""
    install_units(tmp_path)
    # An instance name loads the template from the same directory.
    result = analyze("verify", "--man=no", str(tmp_path / unit))
    assert result.stderr == "", f"{unit}: systemd-analyze verify printed:\n{result.stderr}"
    assert result.returncode == 0, f"{unit}: exit {result.returncode}"


@pytest.mark.process
def test_verify_catches_a_bad_setting(tmp_path: Path) -> None:
    """The verify check can fail: an invalid value in the runtime template is reported."""
    install_units(tmp_path, extra_service_line="ProtectSystem=bogus")
    result = analyze("verify", "--man=no", str(tmp_path / RUNTIME_INSTANCE))
    assert f"{RUNTIME_TEMPLATE}:" in result.stderr
    assert "bogus" in result.stderr


@pytest.mark.process
@pytest.mark.parametrize("unit", sorted(EXPOSURE_THRESHOLD))
def test_security_exposure_below_threshold(tmp_path: Path, unit: str) -> None:
    """``systemd-analyze security --offline`` rates each unit below its documented threshold."""
    install_units(tmp_path)
    threshold = EXPOSURE_THRESHOLD[unit]
    # --threshold is in tenths: exit status non-zero when exposure * 10 exceeds it.
    result = analyze(
        "security", "--offline=true", f"--threshold={round(threshold * 10)}", str(tmp_path / unit)
    )
    match = OVERALL.search(result.stdout)
    assert match is not None, f"no overall exposure line in:\n{result.stdout}\n{result.stderr}"
    exposure = float(match.group(2))
    failing = [line for line in result.stdout.splitlines() if line.startswith("✗")]
    assert exposure < threshold, f"{unit}: exposure {exposure} >= {threshold}:\n" + "\n".join(
        failing
    )
    assert result.returncode == 0, f"{unit}: --threshold exit {result.returncode}"


@pytest.mark.process
def test_security_check_can_fail(tmp_path: Path) -> None:
    """An unhardened unit scores far above the thresholds, so the exposure check is meaningful."""
    unit = tmp_path / "plain.service"
    unit.write_text(f"[Service]\nType=notify\nExecStart={local_executable()} agent\n")
    result = analyze("security", "--offline=true", "--threshold=20", str(unit))
    match = OVERALL.search(result.stdout)
    assert match is not None
    assert float(match.group(2)) > max(EXPOSURE_THRESHOLD.values())
    assert result.returncode != 0


def test_units_share_user_group_and_runtime_directory() -> None:
    """Agent and runtime run as the same user and declare the same preserved /run/ggufswap."""
    shared = (
        "User",
        "Group",
        "RuntimeDirectory",
        "RuntimeDirectoryMode",
        "RuntimeDirectoryPreserve",
        "UMask",
    )
    agent = parse_unit((SYSTEMD_DIR / AGENT_UNIT).read_text())["Service"]
    runtime = parse_unit((SYSTEMD_DIR / RUNTIME_TEMPLATE).read_text())["Service"]
    for key in shared:
        assert agent[key] == runtime[key], f"{key}: agent {agent[key]} != runtime {runtime[key]}"
    assert agent["RuntimeDirectory"] == ["ggufswap"]
    assert agent["RuntimeDirectoryPreserve"] == ["yes"]


def test_notify_contract_settings() -> None:
    """Both units are Type=notify with a main-PID-only notify socket, a watchdog and the CLI."""
    expected_exec = {
        AGENT_UNIT: f"{SHIPPED_BINARY} agent --config /etc/ggufswap/config.yaml",
        RUNTIME_TEMPLATE: f"{SHIPPED_BINARY} runtime --config /etc/ggufswap/%i.yaml",
    }
    for name, exec_start in expected_exec.items():
        service = parse_unit((SYSTEMD_DIR / name).read_text())["Service"]
        assert service["Type"] == ["notify"], name
        assert service["NotifyAccess"] == ["main"], name
        assert len(service["WatchdogSec"]) == 1, name
        assert service["ExecStart"] == [exec_start], name
    agent = parse_unit((SYSTEMD_DIR / AGENT_UNIT).read_text())["Service"]
    assert agent["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


@pytest.mark.process
@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers missing")
def test_sysusers_creates_the_units_user_and_group(tmp_path: Path) -> None:
    """Applying the sysusers file to a scratch root creates the User=/Group= both units name."""
    (tmp_path / "etc").mkdir()
    sysusers = shutil.which("systemd-sysusers")
    assert sysusers is not None
    result = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(SYSTEMD_DIR / SYSUSERS_FILE)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    for name in (AGENT_UNIT, RUNTIME_TEMPLATE):
        service = parse_unit((SYSTEMD_DIR / name).read_text())["Service"]
        (user,) = service["User"]
        (group,) = service["Group"]
        assert user in passwd, f"{name}: User={user} is not created by {SYSUSERS_FILE}"
        assert group in groups, f"{name}: Group={group} is not created by {SYSUSERS_FILE}"
        assert passwd[user][3] == groups[group][2], f"{user}'s primary group is not {group}"
        assert passwd[user][6] == "/usr/sbin/nologin"


AGENT_UNDER_MDWE = """
import ctypes, mmap, sys, tempfile
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
    sys.exit(77)  # kernel older than 6.3
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
except PermissionError:
    pass
else:
    sys.exit("a writable+executable mapping was allowed: MDWE is not in force")
import msgpack, structlog, xxhash, yaml, zmq
from watchdog.events import FileSystemEventHandler
from watchdog.observers.inotify import InotifyObserver
import ggufswap.agent, ggufswap.ipc.sdnotify, ggufswap.shards
directory = tempfile.mkdtemp()
observer = InotifyObserver()
observer.schedule(FileSystemEventHandler(), directory)
observer.start()
observer.stop()
observer.join(10)
context = zmq.Context()
router = context.socket(zmq.ROUTER)
router.bind(f"ipc://{directory}/agent.sock")
router.close(linger=0)
context.term()
"""


@pytest.mark.process
def test_agent_stack_runs_with_memory_deny_write_execute(tmp_path: Path) -> None:
    """The agent's libraries (inotify observer, ZeroMQ, codecs) work with W^X memory enforced.

    ``MemoryDenyWriteExecute=yes`` in the agent unit relies on this. The kernel's
    ``PR_SET_MDWE`` is the same rule that systemd enforces with seccomp.
    """
    script = tmp_path / "agent_mdwe.py"
    script.write_text(AGENT_UNDER_MDWE)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if result.returncode == 77:
        pytest.skip("kernel has no PR_SET_MDWE (Linux < 6.3)")
    assert result.returncode == 0, result.stderr
