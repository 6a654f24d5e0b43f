"""Shared fixtures: small, generic builders of real files in ``tmp_path``, and the autouse checks
that fail a test which leaves threads or file descriptors behind (warnings are errors through
``filterwarnings`` in pyproject.toml)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pluggy
import pytest
import zmq
from watchdog.observers.inotify_c import InotifyFD

if TYPE_CHECKING:  # imported by the fixtures themselves: the agent's tests need no torch
    from fault_helpers import Rig, Zygote
    from hostile import Live

# How long a finished test's threads may take to end, and its descriptors to close (libzmq closes
# a socket's descriptors in its own I/O thread, after ``close()`` returned).
LEAK_GRACE_S = 5.0


@pytest.fixture(scope="session", autouse=True)
def process_wide_singletons() -> None:
    """Start, before any test, what libraries keep for the whole process once first used: the
    ZeroMQ context of ``zmq.Context.instance()`` (which ipc/ uses; its I/O and reaper threads'
    descriptors) and watchdog's shared inotify reader (a thread, an inotify descriptor and a
    pipe, shared by every watchdog observer and never stopped). They belong to the session, not
    to the first test that opens a socket or a watcher."""
    zmq.Context.instance().socket(zmq.PAIR).close()
    InotifyFD.get_instance()


def _leaks_ok(request: pytest.FixtureRequest) -> bool:
    marker = request.node.get_closest_marker("leaks_ok")
    if marker is None:
        return False
    if not marker.args or not str(marker.args[0]).strip():
        raise pytest.UsageError(f"{request.node.nodeid}: leaks_ok needs a reason")
    return True


@pytest.fixture(autouse=True)
def no_leaked_threads(request: pytest.FixtureRequest, no_leaked_fds: None) -> Iterator[None]:
    """Fail a test that leaves a thread running it started (or a function fixture started)."""
    before = set(threading.enumerate())
    yield
    if _leaks_ok(request):
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = [t for t in threading.enumerate() if t not in before]
    for thread in leaked:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [f"{t.name} (daemon={t.daemon})" for t in leaked if t.is_alive()]
    if alive:
        pytest.fail(f"the test left {len(alive)} thread(s) running: {', '.join(alive)}")


def _open_fds() -> dict[int, str]:
    """This process's open descriptors and what each points to."""
    fds: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, or one closed meanwhile
    return fds


@pytest.fixture(autouse=True)
def no_leaked_fds(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a file descriptor open it opened (or a function fixture opened)."""
    before = set(_open_fds().items())
    yield
    if _leaks_ok(request):
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    while leaked := sorted(set(_open_fds().items()) - before):
        if time.monotonic() > deadline:
            described = ", ".join(f"{fd} -> {target}" for fd, target in leaked)
            pytest.fail(f"the test left {len(leaked)} descriptor(s) open: {described}")
        time.sleep(0.01)


@pytest.fixture
def sockdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short private directory for ipc:// sockets (a socket path holds at most 107 bytes, and
    ``tmp_path`` is named after the test)."""
    return tmp_path_factory.mktemp("s")


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """A process that has imported the runtime and forks ``ggufswap`` commands on request
    (fault_helpers.Zygote), shared by a module's tests."""
    from fault_helpers import Zygote

    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def rig(request: pytest.FixtureRequest, tmp_path: Path, zygote: Zygote) -> Iterator[Rig]:
    """A model directory and a config for a runtime and an agent run by the zygote
    (fault_helpers.Rig), stopped afterwards; a ``rig(**options)`` marker (on the module or the
    test) passes options to ``Rig.create``."""
    from fault_helpers import Rig

    marker = request.node.get_closest_marker("rig")
    r = Rig.create(tmp_path, zygote, **(marker.kwargs if marker else {}))
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def live(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    """One runtime and one agent process on a tiny model (hostile.live_processes), shared by a
    module's tests."""
    from hostile import live_processes

    with live_processes(tmp_path_factory.mktemp(request.module.__name__)) as processes:
        yield processes


@pytest.fixture
def gguf_file(tmp_path: Path) -> Callable[..., Path]:
    """Write GGUF bytes (or anything with a ``.data`` bytes attribute) to a file in ``tmp_path``."""

    def write(content: bytes | object, name: str = "model.gguf") -> Path:
        data = content if isinstance(content, bytes) else getattr(content, "data")
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    return write


# Rows recorded this session that docs/reliability.md lacks (pytest_runtestloop sets it).
_MISSING_FROM_DOC = pytest.StashKey[list[tuple[str, str, str]]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Generator[None, object, object]:
    """Once every selected test has run, fail the session when docs/reliability.md misses a row
    that a passing test recorded (a partial run checks the rows of the tests it ran)."""
    result = yield
    import reliability
    import render_reliability

    rows = [vars(row) for row in reliability.rows()]
    missing = render_reliability.missing_from_doc(rows, render_reliability.DOC.read_text())
    if missing:
        session.config.stash[_MISSING_FROM_DOC] = missing
        session.testsfailed += 1  # the exit status is then 1 (TESTS_FAILED), as pytest-cov does
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the rows that docs/reliability.md misses, and how to regenerate it."""
    missing = terminalreporter.config.stash.get(_MISSING_FROM_DOC, [])
    if missing:
        terminalreporter.section("docs/reliability.md is out of date", sep="=", red=True)
        terminalreporter.line(
            f"{len(missing)} row(s) recorded by tests that passed are not in its table "
            "(area, fault, test); run `python tests/render_reliability.py` and commit the doc:"
        )
        for key in missing:
            terminalreporter.line(f"  {key}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the reliability matrix rows recorded by this session (see tests/reliability.py)."""
    import reliability

    reliability.write()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """A test marked ``reliability(area, fault, tries=, outcome=)`` records its row on a pass."""
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("reliability")
    if marker is None or report.when != "call" or not report.passed:
        return
    import reliability

    area, fault = marker.args
    reliability.record(
        area,
        fault,
        tries=int(marker.kwargs["tries"]),
        outcome=str(marker.kwargs["outcome"]),
        test=item.nodeid,
    )
