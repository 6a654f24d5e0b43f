"""Supervised threads (issue 28, break 1): no long-lived thread of either process dies silently.

A body that raises is restarted with backoff; while an essential thread is down the systemd
watchdog gets no ``WATCHDOG=1``; an essential thread that keeps failing is given up and the
process exits non-zero (for systemd to restart it). The unit tests drive the supervisor with
real threads; the process tests break every long-lived thread of a real agent and a real runtime
with failpoints (``GGUFSWAP_FAILPOINTS``), and reproduce the issue's own case: a link whose
runtime's socket directory was insecure for a while.
"""

from __future__ import annotations

import http.client
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_helpers import WAIT_S, Rig
from processes import Proc, status_of, wait_for
from runtime_helpers import Q, one_thread
from test_agent_sdnotify import WATCHDOG_USEC, NotifySocket
from test_agent_sdnotify import write_config as write_agent_config

from ggufswap.ipc import supervisor
from ggufswap.ipc.errors import InjectedFault
from ggufswap.ipc.supervisor import Backoff, Supervised, ThreadHealth
from ggufswap.runtime.serving.http import CompletionServer, HttpOptions

QUICK = Backoff(initial=0.01, maximum=0.02, give_up_after=3, healthy_after_s=30.0)


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


class Flaky:
    """A body that raises its first ``failures`` runs, then runs until stopped."""

    def __init__(self, stop: threading.Event, failures: int | None) -> None:
        self.stop = stop
        self.failures = failures
        self.runs = 0
        self.running = threading.Event()

    def __call__(self) -> None:
        self.runs += 1
        if self.failures is None or self.runs <= self.failures:
            raise RuntimeError(f"run {self.runs} fails")
        self.running.set()
        self.stop.wait()


def test_a_body_that_raises_is_restarted_and_down_until_it_runs(stop: threading.Event) -> None:
    """Two crashes, two restarts after the backoff; the thread is listed down only while it
    restarts, and its status keeps the last error."""
    body = Flaky(stop, failures=2)
    thread = Supervised("test-flaky", body, stop=stop, backoff=QUICK).start()
    assert body.running.wait(WAIT_S)
    assert (thread.restarts, body.runs, thread.health) == (2, 3, ThreadHealth.RUNNING)
    assert "test-flaky" not in supervisor.down()
    assert thread.status()["last_error"] == "RuntimeError: run 2 fails"
    stop.set()
    assert thread.join(WAIT_S)
    assert thread.health is ThreadHealth.STOPPED


def test_an_essential_thread_that_keeps_failing_is_given_up_and_reported(
    stop: threading.Event,
) -> None:
    """After ``give_up_after`` crashes in a row an essential thread is dead (not restarted),
    listed down, and every ``on_dead`` hook is called with its name; a hook added later is
    told at once."""
    told: list[str] = []
    remove = supervisor.on_dead(told.append)
    try:
        thread = Supervised("test-doomed", Flaky(stop, None), stop=stop, backoff=QUICK).start()
        wait_for(lambda: not thread.is_alive(), timeout=WAIT_S, what="the thread to end")
        assert thread.health is ThreadHealth.DEAD
        assert told == ["test-doomed"]
        assert "test-doomed" in supervisor.down()
        late: list[str] = []
        supervisor.on_dead(late.append)()  # added (and told at once), then removed
        assert late == ["test-doomed"]
        assert thread.join(WAIT_S)  # the owner stops it: no longer listed
        assert "test-doomed" not in supervisor.down()
    finally:
        remove()


def test_a_thread_that_is_not_essential_is_restarted_forever(stop: threading.Event) -> None:
    """A thread that is not essential is never given up, and never listed down."""
    body = Flaky(stop, failures=QUICK.give_up_after + 2)
    thread = Supervised("test-optional", body, stop=stop, essential=False, backoff=QUICK).start()
    assert body.running.wait(WAIT_S)
    assert thread.restarts == QUICK.give_up_after + 2
    assert "test-optional" not in supervisor.down()


def test_failpoints_break_the_threads_they_name(stop: threading.Event) -> None:
    """``GGUFSWAP_FAILPOINTS`` makes the matching threads' bodies raise at their first COUNT
    starts (``always``: every start), and no other thread's; a bad entry is refused."""
    supervisor.load_failpoints("test-fp-*=2,test-never=always")
    try:
        runs: list[str] = []
        done = threading.Event()

        def body() -> None:
            runs.append("ran")
            done.set()

        thread = Supervised("test-fp-one", body, stop=stop, backoff=QUICK).start()
        assert done.wait(WAIT_S)
        assert thread.join(WAIT_S)
        assert (thread.restarts, runs) == (2, ["ran"])
        assert "InjectedFault" in str(thread.last_error)
        with pytest.raises(ValueError, match="PATTERN=COUNT"):
            supervisor.load_failpoints("no-count")
    finally:
        supervisor.load_failpoints("")
    assert issubclass(InjectedFault, RuntimeError)


def test_the_http_server_loop_is_restarted_on_its_port_after_a_crash() -> None:
    """The HTTP server's thread (essential) that crashes is run again with a new uvicorn
    server on the same port, listening anew when the crash closed its socket; it answers."""
    server = CompletionServer(options=HttpOptions(port=0), model_name="m")
    port = server.port
    server._sock.close()  # what a crash of the event loop may leave behind
    supervisor.load_failpoints("ggufswap-http=1")
    try:
        server.start()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 503
        assert b"loading" in response.read()
        connection.close()
        assert supervisor.snapshot()["ggufswap-http"]["restarts"] == 1
        assert "ggufswap-http" not in supervisor.down()
    finally:
        supervisor.load_failpoints("")
        server.close()
    assert "ggufswap-http" not in supervisor.snapshot()


# --- the processes --------------------------------------------------------------------------


def _agent_with_failpoints(tmp_path: Path, failpoints: str, notify: NotifySocket) -> Proc:
    config = write_agent_config(tmp_path)
    env = {
        "NOTIFY_SOCKET": str(notify.path),
        "WATCHDOG_USEC": str(WATCHDOG_USEC),
        supervisor.ENV_FAILPOINTS: failpoints,
    }
    return Proc(["agent", "--config", str(config)], log=tmp_path / "agent.log", env=env)


@pytest.mark.process
@pytest.mark.reliability(
    "faults",
    "the agent's link thread raises at its first 2 starts, then at every start (failpoints)",
    tries=2,
    outcome="no WATCHDOG=1 while it is down; restarted after 0.1 + 0.2 s and pinging again; "
    "failing every start: given up after 6 crashes (~3 s), no ping ever sent, exit status 1",
)
@pytest.mark.parametrize("failures", ["2", "always"])
def test_the_watchdog_stops_while_a_link_is_down_and_the_agent_exits_when_it_is_given_up(
    tmp_path: Path, failures: str
) -> None:
    """An agent whose link thread fails twice gets it restarted and pings the watchdog again
    once it runs (none while it is down); one whose link fails at every start sends no ping,
    gives it up and exits 1."""
    notify = NotifySocket(tmp_path / "notify.sock")
    agent = _agent_with_failpoints(tmp_path, f"ggufswap-link-*={failures}", notify)
    try:
        notify.wait_for("READY", timeout=WAIT_S)
        if failures == "always":
            assert agent.popen.wait(WAIT_S) == 1, agent.log()
            assert _pings(notify) == 0
            log = agent.log()
            assert log.index("watchdog.withheld") < log.index("thread.dead"), log
            assert "agent.thread_given_up" in log
            return
        notify.wait_for("WATCHDOG", timeout=WAIT_S)
        status = wait_for(
            lambda: status_of(_agent_status(tmp_path)), timeout=WAIT_S, what="the status"
        )
        link = status["threads"]["ggufswap-link-m"]
        assert (link["restarts"], link["health"]) == (2, "running"), link
        assert status["threads_down"] == []
        assert agent.popen.poll() is None
        log = agent.log()
        assert log.index("watchdog.withheld") < log.index("watchdog.resumed"), log
    finally:
        agent.stop()
        notify.close()


def _pings(notify: NotifySocket) -> int:
    """The WATCHDOG=1 datagrams received (and not yet read)."""
    count = 0
    while (fields := notify.next(0.01)) is not None:
        count += "WATCHDOG" in fields
    return count


def _agent_status(tmp_path: Path) -> str:
    return f"ipc://{tmp_path / 'run'}/agent.sock"


RUNTIME_THREADS = {
    "ggufswap-ipc-runtime",
    "ggufswap-ipc-runtime-status",
    "ggufswap-stager",
    "ggufswap-control-fair",
    "ggufswap-leases",
}
AGENT_THREADS = {"ggufswap-ipc-agent", "ggufswap-link-tiny-moe", "ggufswap-scrub-tiny-moe"}


@pytest.mark.process
@pytest.mark.usefixtures(one_thread.__name__)
@pytest.mark.rig(map_shards=True)
@pytest.mark.reliability(
    "faults",
    "every long-lived thread of the runtime and the agent raises at its first start (failpoints)",
    tries=8,
    outcome="each restarted once with backoff and listed in status; no unsupervised thread "
    "besides the libraries'; an update then commits and served = fresh load",
)
def test_every_long_lived_thread_of_both_processes_is_restarted_after_a_crash(rig: Rig) -> None:
    """With every supervised thread of both processes failing its first start, each is
    restarted once, both processes list it in their status (and no other thread of their own
    outside supervision), and an update through the agent still commits."""
    once = {supervisor.ENV_FAILPOINTS: "ggufswap-*=1"}
    rig.start_runtime(env=once)
    rig.start_agent(env=once)
    version = rig.runtime_status()["weight_version"]
    name = "blk.0.ffn_down_exps.weight"
    rig.model.put(name, rig.model.variant(name, Q.Q4_0, rig.tmp / "variants"))
    rig.wait_version_above(version)
    rig.wait_converged()
    assert rig.probe_digest(rig.runtime_status()["weight_version"]) == rig.fresh_digest()
    runtime, agent = rig.runtime_status(), rig.agent_status_body()
    assert agent is not None
    for status, expected in ((runtime, RUNTIME_THREADS), (agent, AGENT_THREADS)):
        threads = status["threads"]
        assert expected <= set(threads), sorted(threads)
        assert all(threads[n]["restarts"] == 1 for n in expected), threads
        assert status["threads_down"] == []
    assert runtime["threads_unsupervised"] == [], runtime["threads_unsupervised"]
    # The agent's other threads are watchdog's (its inotify backend): the observer, an emitter
    # per watch, and the process-wide inotify reader (an unnamed thread); the daemon rebuilds a
    # backend whose observer died.
    others = set(agent["threads_unsupervised"])
    assert {"watchdog-observer", "watchdog-emitter"} <= others, others
    assert len(others - {"watchdog-observer", "watchdog-emitter"}) <= 1, others


@pytest.mark.process
@pytest.mark.usefixtures(one_thread.__name__)
@pytest.mark.reliability(
    "faults",
    "a runtime's stager raises at every start (failpoints)",
    tries=1,
    outcome="given up after 6 crashes; the runtime stops and exits with status 1",
)
def test_a_runtime_whose_stager_keeps_failing_exits_non_zero(rig: Rig) -> None:
    """The runtime gives an essential thread that fails at every start up, stops, and exits 1
    (also when it was given up during the model load, before the daemon listened)."""
    child = rig.start_runtime(env={supervisor.ENV_FAILPOINTS: "ggufswap-stager=always"})
    wait_for(lambda: not child.alive(), timeout=WAIT_S, what="the runtime to exit")
    assert child.exit_code() == 1, child.log()[-3000:]
    assert "runtime.thread_given_up" in child.log()


@pytest.mark.process
@pytest.mark.usefixtures(one_thread.__name__)
@pytest.mark.reliability(
    "faults",
    "runtime stopped; its socket directory chmod 0770 until the link logs the refusal, then "
    "0700 again; runtime restarted; a new version renamed in (issue 28's reproduction)",
    tries=1,
    outcome="the link treats the insecure endpoint as unreachable (one error line, not a "
    "crash) and retries; the update commits once the directory is private again",
)
def test_a_link_survives_an_insecure_socket_directory(rig: Rig) -> None:
    """While the runtime's socket directory is group-writable the link refuses it as an
    unreachable endpoint (an error logged once), keeps retrying, and reconnects and delivers
    the next update once the directory is private again."""
    rig.start_runtime()
    agent = rig.start_agent()
    assert rig.runtime is not None
    rig.runtime.stop()
    run_dir = Path(rig.control.removeprefix("ipc://")).parent
    mode = run_dir.stat().st_mode & 0o777
    os.chmod(run_dir, 0o770)
    try:
        wait_for(
            lambda: "link.endpoint_refused" in agent.log() or "link.crashed" in agent.log(),
            timeout=WAIT_S,
            what="the link to meet the insecure directory",
        )
        # The window: a few retry periods (request_timeout_s is 2 s here) refused.
        time.sleep(5.0)
    finally:
        os.chmod(run_dir, mode)
    log = agent.log()
    assert "link.crashed" not in log, log[-3000:]
    assert "thread.crashed" not in log, log[-3000:]
    assert log.count("link.endpoint_refused") == 1, log[-3000:]
    rig.start_runtime()
    version = rig.runtime_status()["weight_version"]
    name = "blk.0.ffn_down_exps.weight"
    rig.model.put(name, rig.model.variant(name, Q.Q4_0, rig.tmp / "variants"))
    rig.wait_version_above(version)
    rig.wait_converged()
