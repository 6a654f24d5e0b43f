"""Startup failures an operator meets end in one line that names the file, key and what to do,
with exit status 2 and no Python traceback, before any model load."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import PROBE_YAML, run_ggufswap

from ggufswap.shards import tiny_dense, write_model

pytestmark = pytest.mark.process

EXIT_CONFIG = 2
LOADED = ("model.loaded", "runtime.ready")  # log events of a load that should not happen


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tiny_dense(), tmp_path_factory.mktemp("startup") / "model")[0]


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gs-start-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_runtime(config: Path, run_dir: Path, *flags: str) -> tuple[int, str]:
    result = run_ggufswap(
        "runtime", "--config", config, *flags, env={"RUNTIME_DIRECTORY": str(run_dir)}
    )
    return result.returncode, result.stderr + result.stdout


def assert_one_clear_line(code: int, output: str, *needles: str) -> None:
    assert code == EXIT_CONFIG, output
    assert "Traceback" not in output, output
    assert not any(event in output for event in LOADED), f"failed after loading:\n{output}"
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_events_endpoint_in_use(tmp_path: Path, first: Path, run_dir: Path) -> None:
    """A live process on the events socket stops the runtime before it loads the model."""
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.bind(str(run_dir / "m.events.sock"))
    holder.listen()
    config = tmp_path / "m.yaml"
    config.write_text(f"runtime: {{model: {first}, serve: {PROBE_YAML}}}\n")
    try:
        code, output = start_runtime(config, run_dir)
    finally:
        holder.close()
    assert_one_clear_line(code, output, str(config), "runtime.events_endpoint", "in use")


def test_unwritable_ipc_path(tmp_path: Path, first: Path, run_dir: Path) -> None:
    """A socket directory that cannot be created stops the runtime, and check-config reports it."""
    config = tmp_path / "m.yaml"
    endpoint = "ipc:///proc/ggufswap-absent/m.sock"
    config.write_text(f"runtime: {{model: {first}, control_endpoint: '{endpoint}'}}\n")
    code, output = start_runtime(config, run_dir)
    assert_one_clear_line(code, output, str(config), "runtime.control_endpoint", "/proc")
    check = run_ggufswap("check-config", config)
    assert check.returncode == 1, check.stdout
    assert "runtime.control_endpoint" in check.stderr, check.stderr
    assert "Traceback" not in check.stderr


def test_missing_model_file(tmp_path: Path, run_dir: Path) -> None:
    """A model path that does not exist is named with its key."""
    config = tmp_path / "m.yaml"
    config.write_text(f"runtime: {{model: {tmp_path / 'absent.gguf'}}}\n")
    code, output = start_runtime(config, run_dir)
    assert_one_clear_line(code, output, str(config), "runtime.model", "absent.gguf")


def test_http_port_in_use(tmp_path: Path, first: Path, run_dir: Path) -> None:
    """An HTTP port another server holds stops the runtime before it loads the model."""
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    config = tmp_path / "m.yaml"
    config.write_text(f"runtime: {{model: {first}, serve: {{port: {port}}}}}\n")
    try:
        code, output = start_runtime(config, run_dir)
    finally:
        holder.close()
    assert_one_clear_line(code, output, str(config), "runtime.serve.port", str(port), "in use")


def test_the_http_port_is_not_checked_when_the_command_line_picks_another_mode(
    tmp_path: Path, first: Path, run_dir: Path
) -> None:
    """``--mode probe`` over a configuration in http mode: a taken HTTP port is none of the
    runtime's business (it binds none), so the one problem named is the events socket's."""
    port = free_port()
    held_port = socket.socket()
    held_port.bind(("127.0.0.1", port))
    held_port.listen()
    held_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held_socket.bind(str(run_dir / "m.events.sock"))
    held_socket.listen()
    config = tmp_path / "m.yaml"
    config.write_text(f"runtime: {{model: {first}, serve: {{port: {port}}}}}\n")
    try:
        code, output = start_runtime(config, run_dir, "--mode", "probe")
    finally:
        held_port.close()
        held_socket.close()
    assert_one_clear_line(code, output, str(config), "runtime.events_endpoint", "in use")


def test_torch_missing_names_the_extra(tmp_path: Path, first: Path, run_dir: Path) -> None:
    """Without torch (the runtime extra), ``ggufswap runtime`` says which extra to install."""
    shim = tmp_path / "no-torch"
    shim.mkdir()
    (shim / "torch.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    config = tmp_path / "m.yaml"
    config.write_text(f"runtime: {{model: {first}}}\n")
    result = run_ggufswap(
        "runtime",
        "--config",
        config,
        env={"RUNTIME_DIRECTORY": str(run_dir), "PYTHONPATH": str(shim)},
    )
    assert_one_clear_line(result.returncode, result.stderr, "ggufswap[runtime]", "torch")


def test_a_shard_that_cannot_be_mapped_under_map_shards_true(
    tmp_path: Path, first: Path, run_dir: Path
) -> None:
    """``map_shards: true`` and a shard another process holds open for writing: the load stops
    with one line naming the file and why, exit status 2, no traceback."""
    config = tmp_path / "m.yaml"
    config.write_text(
        f"runtime: {{model: {first}, storage: native, map_shards: true, serve: {PROBE_YAML}}}\n"
    )
    with open(first, "r+b"):
        code, output = start_runtime(config, run_dir)
    assert code == EXIT_CONFIG, output
    assert "Traceback" not in output, output
    last = output.strip().splitlines()[-1]
    assert str(first) in last, output
    assert "open for writing" in last, output
