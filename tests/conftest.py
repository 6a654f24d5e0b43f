"""Shared fixtures: small, generic builders of real files in ``tmp_path``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the reliability matrix rows recorded by this session (see tests/reliability.py)."""
    import reliability

    reliability.write()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
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
