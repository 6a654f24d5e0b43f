"""The agent daemon's lifecycle moves through one guarded table, as a runtime link's does."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufswap.agent import AgentDaemon
from ggufswap.agent.daemon import DaemonState
from ggufswap.agent.errors import AgentError, DaemonStateError
from ggufswap.config import load_config


def _daemon(tmp_path: Path, sockdir: Path) -> AgentDaemon:
    watch = tmp_path / "models"
    watch.mkdir()
    path = tmp_path / "agent.yaml"
    path.write_text(
        f"""
agent:
  status_endpoint: ipc://{sockdir}/agent.sock
models:
  - name: m
    runtime: ipc://{sockdir}/rt.sock
    watch:
      - path: {watch}
        backend: polling
"""
    )
    return AgentDaemon(load_config(path), connect=False)


def test_a_second_start_is_refused_and_close_ends_stopped(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """start() twice raises DaemonStateError naming both states; close() ends STOPPED, twice."""
    daemon = _daemon(tmp_path, tmp_path_factory.mktemp("s"))
    daemon.start()
    try:
        assert daemon.state is DaemonState.RUNNING
        with pytest.raises(DaemonStateError, match="cannot go from running to running"):
            daemon.start()
    finally:
        daemon.close()
    assert daemon.state is DaemonState.STOPPED
    daemon.close()
    assert daemon.state is DaemonState.STOPPED
    assert issubclass(DaemonStateError, AgentError)


def test_a_daemon_never_started_closes_and_cannot_start_after(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A daemon closed before start() is STOPPED, and start() then raises."""
    daemon = _daemon(tmp_path, tmp_path_factory.mktemp("s"))
    daemon.close()
    assert daemon.state is DaemonState.STOPPED
    with pytest.raises(DaemonStateError, match="cannot go from stopped to running"):
        daemon.start()
