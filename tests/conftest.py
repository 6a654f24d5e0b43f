"""Shared fixtures: small, generic builders of real files in ``tmp_path``."""

from __future__ import annotations

from collections.abc import Callable, Generator
from pathlib import Path

import pluggy
import pytest


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
