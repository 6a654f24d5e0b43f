"""``ggufswap demo`` end to end, reduced: real processes, real files, real sockets."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ggufswap.demo import (
    DemoReport,
    Planner,
    Step,
    StepKind,
    SwapResult,
    exactness_failures,
    sweep_steps,
)

pytestmark = pytest.mark.timeout(180)


def _result(index: int, kind: StepKind, perplexity: float) -> SwapResult:
    return SwapResult(
        index=index,
        step=Step(kind, 0),
        ggml_type="Q8_0",
        weight_version=index,
        perplexity=perplexity,
        delta=perplexity - 10.0,
        latency_ms=1.0,
        stall_ms=0.1,
    )


def test_sweep_quantizes_and_restores_each_layer_with_one_sanity_slot() -> None:
    """The sweep quantizes then restores every layer, and runs the sanity slot exactly once."""
    steps = sweep_steps(3)
    assert [s.kind for s in steps].count(StepKind.SANITY) == 1
    for layer in range(3):
        kinds = [s.kind for s in steps if s.layer == layer and s.kind is not StepKind.SANITY]
        assert kinds == [StepKind.QUANT, StepKind.RESTORE]
    assert steps.index(Step(StepKind.SANITY, 0)) == steps.index(Step(StepKind.RESTORE, 0)) + 1


def test_exactness_check_flags_a_restore_off_the_baseline() -> None:
    """A restore whose perplexity differs from the baseline by any amount is a failure."""
    report = DemoReport(model="m", planner=Planner.DIRECT, baseline=10.0)
    report.swaps = [
        _result(1, StepKind.QUANT, 11.0),
        _result(2, StepKind.RESTORE, 10.0),
        _result(3, StepKind.SANITY, 10.0),
    ]
    assert exactness_failures(report) == []
    report.swaps[1] = _result(2, StepKind.RESTORE, 10.000000000001)
    failures = exactness_failures(report)
    assert len(failures) == 1
    assert "swap 2" in failures[0]
    assert "restore" in failures[0]


@pytest.mark.process
def test_demo_quick_runs_end_to_end(tmp_path: Path) -> None:
    """The reduced demo exits 0, prints the table, and every restore/sanity equals the baseline."""
    workdir = tmp_path / "work"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ggufswap",
            "demo",
            "--quick",
            "--layers",
            "2",
            "--workdir",
            str(workdir),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=170,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert re.search(r"^#\s+step\s+tensor\s+type\s+ver\s+perplexity", out, re.M), out
    rows = re.findall(
        r"^(\d+)\s+(quant|restore|sanity)\s+(blk\.\d+\.ffn_down_exps\.weight)", out, re.M
    )
    assert [(kind, tensor) for _, kind, tensor in rows] == [
        ("quant", "blk.0.ffn_down_exps.weight"),
        ("restore", "blk.0.ffn_down_exps.weight"),
        ("sanity", "blk.0.ffn_down_exps.weight"),
        ("quant", "blk.1.ffn_down_exps.weight"),
        ("restore", "blk.1.ffn_down_exps.weight"),
    ]
    assert "OK: 3 restores/sanity slots gave the baseline perplexity exactly (==)" in out
    assert "FAILED" not in out
    # The byte-identical rewrite changed no weights: nothing or a no-op was committed.
    sanity = re.search(r"^sanity slot \(swap 3, .*$", out, re.M)
    assert sanity is not None, out
    assert "no plan committed" in sanity.group() or "no-op plan committed" in sanity.group()
    # Both processes were stopped by SIGTERM and exited cleanly.
    assert re.search(r"^shutdown: runtime: exited with status 0$", out, re.M), out
    assert "killed" not in out
    # Progress went to stderr, one line per swap.
    assert len(re.findall(r"^\[\d/5\] ", proc.stderr, re.M)) == 5, proc.stderr
    # The workspace: the model, the saved originals, the config, and a private socket directory.
    assert (workdir / "ggufswap.yaml").is_file()
    assert (workdir / "run").stat().st_mode & 0o777 == 0o700
    assert not list((workdir / "model").glob(".*")), "temp files left in the model directory"


@pytest.mark.process
def test_demo_refuses_a_non_empty_workdir(tmp_path: Path) -> None:
    """A --workdir that already holds files is refused before anything starts."""
    (tmp_path / "something").write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "ggufswap", "demo", "--quick", "--workdir", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "is not empty" in proc.stderr


@pytest.mark.process
def test_a_failed_demo_keeps_the_logs_it_names(tmp_path: Path) -> None:
    """When the runtime cannot start, the demo fails and keeps the temporary workdir whose log
    its message names."""
    shim = tmp_path / "no-torch"
    shim.mkdir()
    (shim / "torch.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    scratch = Path(tempfile.mkdtemp(prefix="gs-demo-", dir="/tmp"))  # short socket paths
    proc = subprocess.run(
        [sys.executable, "-m", "ggufswap", "demo", "--quick", "--layers", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "PYTHONPATH": str(shim), "TMPDIR": str(scratch)},
    )
    assert proc.returncode != 0, proc.stdout
    logs = re.findall(r"(/\S+?\.log)", proc.stdout + proc.stderr)
    assert logs, f"no log named:\n{proc.stdout}\n{proc.stderr}"
    for log in logs:
        assert Path(log).is_file(), f"{log} was removed"
    try:
        assert "ggufswap[runtime]" in Path(logs[0]).read_text()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.process
def test_a_socket_path_too_long_is_one_clear_message(tmp_path: Path) -> None:
    """A temporary directory too deep for Unix socket paths ends the demo with a message that
    names the endpoint, not a thread's traceback."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "ggufswap", "demo", "--quick", "--layers", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "TMPDIR": str(deep)},
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "could not subscribe to ipc://" in proc.stderr
