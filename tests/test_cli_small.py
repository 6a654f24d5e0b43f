"""Smaller command-line fixes an operator asked for: --log-level anywhere, plan without
--dry-run, status with no argument, readable status values, and no silent --ctx clamping."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_fakes import write_per_tensor_model
from processes import run_ggufswap

from ggufswap._cmd_status import default_endpoints, render
from ggufswap.shards import tiny_dense, write_model


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gs-cli-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def agent_config(tmp_path: Path, sockets: Path) -> Path:
    paths = write_per_tensor_model(tmp_path / "m", 2)
    path = tmp_path / "agent.yaml"
    path.write_text(
        f"agent: {{status_endpoint: 'ipc://{sockets}/agent.sock'}}\n"
        f"models:\n  - name: m\n    runtime: ipc://{sockets}/rt.sock\n"
        f"    watch: [{{path: {paths[0].parent}}}]\n"
    )
    return path


@pytest.mark.process
def test_log_level_is_accepted_after_the_command(tmp_path: Path, short_dir: Path) -> None:
    """``--log-level`` works after the subcommand as well as before it."""
    cfg = agent_config(tmp_path, short_dir)
    after = run_ggufswap("check-config", cfg, "--log-level", "debug")
    assert after.returncode == 0, after.stderr
    before = run_ggufswap("--log-level", "debug", "check-config", cfg)
    assert before.returncode == 0, before.stderr


@pytest.mark.process
def test_plan_prints_without_dry_run(tmp_path: Path, short_dir: Path) -> None:
    """``plan`` only ever prints, so it needs no ``--dry-run`` (still accepted)."""
    cfg = agent_config(tmp_path, short_dir)
    for flags in ((), ("--dry-run",)):
        result = run_ggufswap("plan", *flags, "--config", cfg, "--timeout", "0.3")
        assert result.returncode == 0, result.stderr
        assert "2 job(s)" in result.stdout


@pytest.mark.process
def test_plan_prints_shapes_in_the_order_inspect_does(tmp_path: Path, short_dir: Path) -> None:
    """A planned tensor's shape reads as ``ggufswap inspect`` prints it (torch order)."""
    first = write_model(tiny_dense(), tmp_path / "dense")[0]
    cfg = tmp_path / "dense.yaml"
    cfg.write_text(
        f"agent: {{status_endpoint: 'ipc://{short_dir}/agent.sock'}}\n"
        f"models:\n  - name: d\n    runtime: ipc://{short_dir}/rt.sock\n"
        f"    watch: [{{path: {first.parent}}}]\n"
    )
    plan = run_ggufswap("plan", "--config", cfg, "--timeout", "0.3").stdout
    inspect = run_ggufswap("inspect", first).stdout
    name = "blk.0.ffn_up.weight"
    (row,) = [line.split() for line in inspect.splitlines() if line.startswith(name)]
    (job,) = [line.split() for line in plan.splitlines() if line.strip().startswith(name)]
    assert job[job.index("shape") + 1] == row[2], (job, row)


@pytest.mark.process
def test_status_without_arguments_asks_the_default_socket_directory(short_dir: Path) -> None:
    """With no ENDPOINT and no --config, status asks every status socket of the default socket
    directory, and says where it looked when there is none."""
    empty = run_ggufswap("status", env={"RUNTIME_DIRECTORY": str(short_dir)})
    assert empty.returncode == 2
    assert str(short_dir) in empty.stderr
    assert "Traceback" not in empty.stderr
    for name in ("agent.sock", "m.sock", "m.status.sock", "m.events.sock"):
        (short_dir / name).touch()
    assert default_endpoints(directory=short_dir) == [
        f"ipc://{short_dir}/agent.sock",
        f"ipc://{short_dir}/m.status.sock",
    ]


def test_status_text_shows_times_and_flags_as_words() -> None:
    """Times are UTC ISO dates, booleans yes/no, nothing '-', never Python's None/True."""
    lines = render(
        "ipc:///run/ggufswap/agent.sock",
        {
            "process": "agent",
            "status": {"last_scan_at": 1795250144.25, "connected": True, "last_error": None},
        },
    )
    text = "\n".join(lines)
    assert "last_scan_at: 2026-11-21T08:35:44Z" in text
    assert "connected: yes" in text
    assert "last_error: -" in text
    assert "None" not in text
    assert "True" not in text


@pytest.mark.process
def test_perplexity_says_when_it_shortens_ctx(tmp_path: Path) -> None:
    """A --ctx longer than the model's context is shortened with a note, not silently."""
    first = write_model(tiny_dense(), tmp_path / "model")[0]
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. " * 400)
    result = run_ggufswap(
        "perplexity", "--model", first, "--text", text, "--ctx", "100000", "--json",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--ctx 100000 is longer than the model's context" in result.stderr
