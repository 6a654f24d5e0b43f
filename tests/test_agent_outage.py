"""While a runtime is down or still loading its model, the agent says so once, retries quietly,
and forgets the outage's error once the runtime answers."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_fakes import FakeRuntime, write_per_tensor_model
from processes import Proc, status_of, wait_for

pytestmark = pytest.mark.process

OUTAGE_S = 4.0  # about 13 retry rounds of 0.3 s


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gs-outage-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_an_outage_is_logged_once_and_its_error_cleared_on_reconnect(
    tmp_path: Path, short_dir: Path
) -> None:
    """An absent runtime gives one warning, not one per retry; once it answers, the link is
    connected and last_error is empty."""
    paths = write_per_tensor_model(tmp_path / "m", 2)
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"agent: {{status_endpoint: 'ipc://{short_dir}/agent.sock'}}\n"
        f"models:\n  - name: m\n    runtime: ipc://{short_dir}/rt.sock\n"
        f"    watch: [{{path: {paths[0].parent}}}]\n"
        "    request_timeout_s: 0.3\n    retries: 1\n"
    )
    agent = Proc(["agent", "--config", str(config)], log=tmp_path / "agent.log")
    try:

        def link() -> dict[str, object]:
            status = status_of(f"ipc://{short_dir}/agent.sock") or {}
            return dict((status.get("models", {}).get("m") or {}).get("link") or {})

        wait_for(lambda: link().get("last_error"), timeout=30, what="the outage to be noticed")
        time.sleep(OUTAGE_S)  # the outage goes on: retries, not warnings
        records = [json.loads(line) for line in agent.log().splitlines() if line.startswith("{")]
        warnings = [r["event"] for r in records if r.get("level") == "warning"]
        assert len(warnings) <= 3, warnings
        with FakeRuntime(f"ipc://{short_dir}/rt.sock", paths[0]):
            # Connected (a pong on the last retry's socket) may come before the state reply
            # that ends the outage: wait for the link to be in sync.
            wait_for(
                lambda: link().get("connected") and link().get("state") == "idle",
                timeout=30,
                what="the reconnect",
            )
            assert link().get("last_error") is None, link()
    finally:
        assert agent.stop() == 0, agent.log()


LOADING_S = 9.0  # a runtime loading its model: over two heartbeat timeouts of a 5 s request


@pytest.mark.process
@pytest.mark.reliability(
    "faults",
    "runtime absent for 9 s with the default request_timeout_s (5 s): a runtime still loading",
    tries=1,
    outcome="no warning from any logger (ipc.peer_lost included) for the reconnects while it "
    "stays away; the outage itself said once",
)
def test_a_runtime_that_stays_away_gets_no_warning_per_reconnect(
    tmp_path: Path, short_dir: Path
) -> None:
    """With the default 5 s request timeout each retry's socket outlives its heartbeat budget
    (3 s); a peer that never answered is no loss: ``ipc.peer_lost`` is not repeated at warning
    level every few seconds, and the whole outage gives at most the link's one warning."""
    paths = write_per_tensor_model(tmp_path / "m", 2)
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"agent: {{status_endpoint: 'ipc://{short_dir}/agent.sock'}}\n"
        f"models:\n  - name: m\n    runtime: ipc://{short_dir}/rt.sock\n"
        f"    watch: [{{path: {paths[0].parent}}}]\n    retries: 0\n"
    )
    agent = Proc(["agent", "--config", str(config)], log=tmp_path / "agent.log")
    try:
        wait_for(lambda: status_of(f"ipc://{short_dir}/agent.sock"), timeout=30, what="the agent")
        time.sleep(LOADING_S)  # the runtime "loads": every reconnect of the link meets no one
        records = [json.loads(line) for line in agent.log().splitlines() if line.startswith("{")]
        warnings = [r["event"] for r in records if r.get("level") in ("warning", "error")]
        assert "ipc.peer_lost" not in warnings, warnings
        assert len(warnings) <= 1, warnings
    finally:
        assert agent.stop() == 0, agent.log()
