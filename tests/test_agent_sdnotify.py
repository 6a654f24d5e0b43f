"""The agent speaks sd_notify: READY after its first scan, WATCHDOG only while its loop runs."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import Proc, status_of

from ggufswap.agent import AgentDaemon
from ggufswap.config import load_config
from ggufswap.ipc.sdnotify import Notifier
from ggufswap.shards import Layout, tiny_moe, write_model

WATCHDOG_USEC = 400_000  # the agent pings every 0.2 s while its loop makes progress


class NotifySocket:
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))

    def next(self, timeout: float) -> dict[str, str] | None:
        """The next datagram as a field map, or None if none arrives within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        return dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)

    def wait_for(self, key: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            fields = self.next(left)
            if fields is not None and key in fields:
                return fields
        raise AssertionError(f"no {key} datagram within {timeout}s")

    def drain(self) -> None:
        while self.next(0.01) is not None:
            pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


def write_config(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    write_model(tiny_moe(), model, layout=Layout.PER_TENSOR)
    run = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
agent:
  status_endpoint: ipc://{run}/agent.sock
models:
  - name: m
    runtime: ipc://{run}/absent-runtime.sock
    watch: [{{path: {model}}}]
    settle_ms: 50
"""
    )
    return config


@pytest.mark.process
def test_agent_process_ready_after_first_scan_then_watchdog(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """READY=1 arrives after the first scan with the status socket bound; WATCHDOG=1 follows
    periodically, stops while the process is stopped, resumes, and STOPPING=1 ends it."""
    config = write_config(tmp_path)
    proc = Proc(
        ["agent", "--config", str(config)],
        log=tmp_path / "agent.log",
        env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)},
    )
    try:
        ready = notify.wait_for("READY", timeout=60)
        assert ready["READY"] == "1"
        status = status_of(f"ipc://{tmp_path}/run/agent.sock", timeout=5)
        assert status is not None, "READY before the status socket answers"
        assert status["scans"]["count"] >= 1, "READY before the first scan"
        assert status["models"]["m"]["shards"]["valid"] == 51
        for _ in range(3):
            notify.wait_for("WATCHDOG", timeout=5)
        proc.signal(signal.SIGSTOP)
        notify.drain()
        assert notify.next(1.0) is None, "a stopped process cannot make progress"
        proc.signal(signal.SIGCONT)
        notify.wait_for("WATCHDOG", timeout=5)
        proc.signal(signal.SIGTERM)
        notify.wait_for("STOPPING", timeout=15)
        assert proc.stop() == 0
    finally:
        proc.kill()


class StallableAgent(AgentDaemon):
    """The real daemon, whose loop iteration can be held by the test (a stuck scan, say)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.released = threading.Event()
        self.released.set()

    def step(self) -> None:
        self.released.wait(30)
        super().step()


def test_stalled_loop_sends_no_watchdog_while_other_threads_run(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """While the main loop is stuck, the status server and watchers live on but WATCHDOG=1 stops,
    so systemd restarts the agent; pings resume when the loop moves again."""
    config = load_config(write_config(tmp_path))
    notifier = Notifier(notify_socket=str(notify.path), watchdog_interval_s=WATCHDOG_USEC / 2e6)
    agent = StallableAgent(config, notifier=notifier, connect=False)
    agent.start()
    thread = threading.Thread(target=agent.run, name="agent-main")
    thread.start()
    try:
        notify.wait_for("READY", timeout=30)
        notify.wait_for("WATCHDOG", timeout=5)
        agent.released.clear()
        notify.drain()
        notify.next(0.5)  # an iteration already past the gate may still ping once
        assert notify.next(1.5) is None, "WATCHDOG=1 sent while the loop was stalled"
        assert status_of(f"ipc://{tmp_path}/run/agent.sock", timeout=5) is not None
        agent.released.set()
        notify.wait_for("WATCHDOG", timeout=5)
    finally:
        agent.released.set()
        agent.request_stop()
        thread.join(30)
    assert not thread.is_alive()
