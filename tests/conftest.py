"""Shared fixtures: small, generic builders of real files in ``tmp_path``."""

from __future__ import annotations

from collections.abc import Callable
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
