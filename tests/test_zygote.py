"""Which commands the tests fork from the worker's zygote (tests/zygote.py) and which get a fresh
interpreter, and what a forked command's end looks like to the test."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import zygote
from processes import PROBE_YAML, run_ggufswap, wait_for

from ggufswap.shards import tiny_dense, write_model


@pytest.mark.parametrize(
    ("args", "env", "forked"),
    [
        (["runtime", "--config", "x"], {}, True),
        (["sweep"], {"OMP_NUM_THREADS": "1", "GGUFSWAP_GGML": "off"}, True),
        (["agent", "--config", "x"], {}, False),  # no torch: nothing to save
        ([], {}, False),
        (["runtime"], {"OMP_NUM_THREADS": "2"}, False),  # torch's pool is sized as it loads
        (["perplexity"], {"PYTHONPATH": "/elsewhere"}, False),  # another import path
        (["serve"], {"LD_PRELOAD": "libfoo.so"}, False),
        (["runtime"], {"OMP_WAIT_POLICY": "ACTIVE"}, False),
    ],
)
def test_a_command_is_forked_only_in_the_environment_the_zygote_imported_in(
    args: list[str], env: dict[str, str], forked: bool
) -> None:
    """Torch commands are forked unless their environment changes what loads with torch."""
    assert zygote.forkable(args, env) is forked


@pytest.mark.process
def test_a_forked_command_ends_as_the_installed_one_would(tmp_path: Path) -> None:
    """A usage error exits 2 with argparse's message; a SIGKILLed runtime's return code is -9,
    a SIGTERMed one's 0 (its own orderly stop)."""
    usage = run_ggufswap("runtime", "--threads", "0")
    assert usage.returncode == 2
    assert "usage: ggufswap runtime" in usage.stderr
    first = write_model(tiny_dense(), tmp_path / "model")[0]
    for sig, code in ((signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 0)):
        run_dir = Path(tempfile.mkdtemp(prefix="gs-zygote-"))  # a short path for ipc://
        try:
            config = tmp_path / f"{sig.name}.yaml"
            config.write_text(
                f"runtime: {{model: {first}, control_endpoint: 'ipc://{run_dir}/rt.sock', "
                f"serve: {PROBE_YAML}}}\n"
            )
            child = zygote.shared().spawn(
                ["runtime", "--config", str(config)], log=tmp_path / f"{sig.name}.log"
            )
            wait_for(lambda: "runtime.ready" in child.log(), timeout=60, what="runtime.ready")
            child.send_signal(sig)
            assert child.wait(60) == code, child.log()
        finally:
            shutil.rmtree(run_dir)
