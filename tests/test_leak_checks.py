"""The autouse leak checks of conftest.py, run on a small suite in a pytest subprocess: a test
that leaves a thread or a descriptor behind errors, naming it; a warning fails the test. And
their rules (leak_rules.py): a device driver's descriptors and threads are not a test's leak."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import leak_rules
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


@pytest.mark.process
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


# What /proc/self/fd showed on a CUDA host after the first CUDA call (numbers illustrative).
BEFORE = {0: "/dev/null", 1: "pipe:[100]", 2: "pipe:[100]", 5: "anon_inode:[eventfd]"}
CUDA_INIT = {
    20: "/dev/nvidiactl",
    21: "/dev/nvidia0",
    22: "/dev/nvidia-uvm",
    23: "/dev/nvidia-uvm-tools",
    24: "anon_inode:[eventfd]",
    25: "anon_inode:[eventfd]",
    26: "pipe:[4711]",
}


def test_the_first_cuda_calls_descriptors_are_not_a_leak_but_the_tests_own_are() -> None:
    """In the test where the driver's device nodes appear, they and the eventfds and pipes opened
    with them are not leaks; a file the test left open still is."""
    after = {**BEFORE, **CUDA_INIT, 30: "/tmp/pytest-of-root/leaky-file"}
    assert leak_rules.leaked_descriptors(BEFORE, after) == {30: "/tmp/pytest-of-root/leaky-file"}
    assert leak_rules.driver_initialized(BEFORE, after)


def test_without_a_driver_an_eventfd_or_a_pipe_is_a_leak() -> None:
    """Where no driver node appeared (none at all, or the driver was initialized by an earlier
    test), a new eventfd or pipe counts: a ZeroMQ socket left open holds one; a driver node opened
    later (a second device) still does not count."""
    after = {**BEFORE, 8: "anon_inode:[eventfd]", 9: "pipe:[200]"}
    assert leak_rules.leaked_descriptors(BEFORE, after) == {
        8: "anon_inode:[eventfd]",
        9: "pipe:[200]",
    }
    assert not leak_rules.driver_initialized(BEFORE, after)
    initialized = {**BEFORE, **CUDA_INIT}
    later = {**initialized, 40: "anon_inode:[eventfd]"}
    assert leak_rules.leaked_descriptors(initialized, later) == {40: "anon_inode:[eventfd]"}
    assert leak_rules.leaked_descriptors(initialized, {**initialized, 41: "/dev/nvidia1"}) == {}


def test_a_descriptor_number_reused_for_another_target_is_new() -> None:
    """A number closed and reopened on another file is a new descriptor."""
    assert leak_rules.leaked_descriptors(BEFORE, {**BEFORE, 5: "/tmp/other"}) == {5: "/tmp/other"}


def test_the_companion_prefixes_match_what_linux_shows_for_an_eventfd_and_a_pipe() -> None:
    """The link targets the rule reads are the kernel's: an eventfd and a pipe opened here
    show as the companion kinds the rule names."""
    event = os.eventfd(0)
    read, write = os.pipe()
    try:
        targets = [os.readlink(f"/proc/self/fd/{fd}") for fd in (event, read, write)]
    finally:
        for fd in (event, read, write):
            os.close(fd)
    assert all(t.startswith(leak_rules.DRIVER_COMPANIONS) for t in targets), targets
    assert not any(leak_rules.is_driver_node(t) for t in targets)


def test_a_foreign_thread_is_the_drivers_only_in_the_test_that_initialized_it() -> None:
    """A thread Python did not start (a native thread that entered the interpreter) is not a
    leak in the test that initialized a driver, and is one otherwise; a Thread always is."""
    own = threading.Thread(target=lambda: None)
    foreign = object.__new__(threading._DummyThread)  # not registered: only its type matters
    before = [threading.main_thread()]
    after = [*before, own, foreign]
    assert leak_rules.leaked_threads(before, after, driver=True) == [own]
    assert leak_rules.leaked_threads(before, after, driver=False) == [own, foreign]
