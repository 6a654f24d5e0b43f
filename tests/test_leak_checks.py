"""The autouse leak checks of conftest.py, run on a small suite in a pytest subprocess: a test
that leaves a thread or a descriptor behind errors, naming it; a warning fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

INNER = """
import os
import threading
import warnings

import pytest


def test_leaves_a_thread():
    threading.Thread(target=threading.Event().wait, name="leaky-thread", daemon=True).start()


def test_leaves_a_descriptor(tmp_path):
    os.open(tmp_path / "leaky-file", os.O_CREAT | os.O_WRONLY)


def test_warns():
    warnings.warn("a stray warning", UserWarning)


@pytest.mark.leaks_ok("the test says why")
def test_opted_out(tmp_path):
    os.open(tmp_path / "kept-open", os.O_CREAT | os.O_WRONLY)


def test_cleans_up(tmp_path):
    with open(tmp_path / "closed", "w") as f:
        f.write("x")
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
"""


def test_leaked_threads_descriptors_and_warnings_fail_the_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leaked thread and a leaked descriptor each error at teardown naming what leaked, a
    warning fails its test, and a test that cleans up or is marked leaks_ok passes."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini(
        "[pytest]\n"
        "markers =\n    leaks_ok(reason): may leak\n"
        "filterwarnings =\n    error\n"
        "addopts = -p no:cacheprovider\n"
    )
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the conftest's helper modules
    # The leaking tests wait out the grace for their thread or descriptor to go: not 5 s each.
    monkeypatch.setenv("GGUFSWAP_TEST_LEAK_GRACE_S", "0.5")
    result = pytester.runpytest_subprocess(timeout=120)
    # The two leaking tests pass their call and error at teardown: pytest counts both.
    result.assert_outcomes(passed=4, failed=1, errors=2)
    result.stdout.fnmatch_lines_random(
        [
            "*the test left 1 thread(s) running: leaky-thread (daemon=True)*",
            "*the test left 1 descriptor(s) open: * -> */leaky-file*",
            "*UserWarning: a stray warning*",
        ]
    )
