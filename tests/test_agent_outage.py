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
            wait_for(lambda: link().get("connected"), timeout=30, what="the reconnect")
            assert link().get("last_error") is None, link()
    finally:
        assert agent.stop() == 0, agent.log()
