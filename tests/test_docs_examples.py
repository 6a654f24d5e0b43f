"""The runnable examples in docs/ run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


def test_embed_runtime_example_runs() -> None:
    """docs/examples/embed_runtime.py commits its plan between batches and exits 0."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "embed_runtime.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "plan COMMITTED" in out.stdout
    assert "committed v1: blk.1.ffn_down_exps.weight" in out.stdout
