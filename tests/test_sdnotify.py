"""sd_notify without libsystemd: real AF_UNIX datagram sockets stand in for systemd."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ggufswap.ipc.sdnotify import (
    Notifier,
    NotifySocketError,
    WatchdogPinger,
    parse_notify_socket,
    watchdog_interval_s,
)

RECV_TIMEOUT_S = 5.0


class Receiver:
    """A bound SOCK_DGRAM socket playing systemd's notification socket."""

    def __init__(self, sock: socket.socket, notify_socket: str) -> None:
        self.sock = sock
        self.notify_socket = notify_socket

    def receive(self) -> dict[str, str]:
        data = self.sock.recv(4096)
        return dict(line.split("=", 1) for line in data.decode().split("\n"))

    def assert_empty(self) -> None:
        self.sock.setblocking(False)
        try:
            with pytest.raises(BlockingIOError):
                self.sock.recv(4096)
        finally:
            self.sock.settimeout(RECV_TIMEOUT_S)


@pytest.fixture
def path_receiver() -> Iterator[Receiver]:
    # A short directory of its own: pytest's tmp_path can exceed the 107-byte sun_path limit.
    with tempfile.TemporaryDirectory(prefix="sdn-") as directory:
        path = str(Path(directory) / "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            sock.settimeout(RECV_TIMEOUT_S)
            yield Receiver(sock, path)


@pytest.fixture
def abstract_receiver() -> Iterator[Receiver]:
    name = f"ggufswap-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(RECV_TIMEOUT_S)
        yield Receiver(sock, "@" + name)


@pytest.fixture(params=["path", "abstract"])
def receiver(request: pytest.FixtureRequest) -> Receiver:
    fixture_name = f"{request.param}_receiver"
    result: Receiver = request.getfixturevalue(fixture_name)
    return result


def test_ready_arrives(receiver: Receiver) -> None:
    """ready() sends READY=1 to a path or abstract NOTIFY_SOCKET."""
    notifier = Notifier.from_env({"NOTIFY_SOCKET": receiver.notify_socket})
    assert notifier.enabled
    assert notifier.ready()
    assert receiver.receive() == {"READY": "1"}


def test_ready_with_status_is_one_datagram(receiver: Receiver) -> None:
    """ready(status) sends READY=1 and STATUS= together in one datagram."""
    notifier = Notifier.from_env({"NOTIFY_SOCKET": receiver.notify_socket})
    notifier.ready("watching 3 models")
    assert receiver.receive() == {"READY": "1", "STATUS": "watching 3 models"}
    receiver.assert_empty()


def test_status_watchdog_stopping_arrive_in_order(path_receiver: Receiver) -> None:
    """status(), watchdog() and stopping() each send their own datagram."""
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path_receiver.notify_socket})
    assert notifier.status("loading 2/4 shards")
    assert notifier.watchdog()
    assert notifier.stopping()
    assert path_receiver.receive() == {"STATUS": "loading 2/4 shards"}
    assert path_receiver.receive() == {"WATCHDOG": "1"}
    assert path_receiver.receive() == {"STOPPING": "1"}


def test_reloading_carries_monotonic_usec(path_receiver: Receiver) -> None:
    """reloading() sends RELOADING=1 with the CLOCK_MONOTONIC time of the call in µs."""
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path_receiver.notify_socket})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    fields = path_receiver.receive()
    assert fields["RELOADING"] == "1"
    assert before <= int(fields["MONOTONIC_USEC"]) <= after


def test_extend_timeout_in_usec(path_receiver: Receiver) -> None:
    """extend_timeout(seconds) sends EXTEND_TIMEOUT_USEC in microseconds."""
    Notifier.from_env({"NOTIFY_SOCKET": path_receiver.notify_socket}).extend_timeout(90.5)
    assert path_receiver.receive() == {"EXTEND_TIMEOUT_USEC": "90500000"}


def test_notify_sends_arbitrary_fields(path_receiver: Receiver) -> None:
    """notify(**fields) sends every assignment given, in one datagram."""
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path_receiver.notify_socket})
    assert notifier.notify(STATUS="ok", ERRNO=5)
    assert path_receiver.receive() == {"STATUS": "ok", "ERRNO": "5"}


def test_newline_in_status_cannot_inject_an_assignment(path_receiver: Receiver) -> None:
    """A newline in a value becomes a space, so the text cannot add READY=1."""
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path_receiver.notify_socket})
    notifier.status("bad file\nREADY=1")
    assert path_receiver.receive() == {"STATUS": "bad file READY=1"}


def test_invalid_field_name_raises() -> None:
    """A lower-case or empty field name is a programming error, even when disabled."""
    with pytest.raises(ValueError, match="field names"):
        Notifier.disabled().notify(ready=1)
    with pytest.raises(ValueError, match="field names"):
        Notifier.disabled().notify()


def test_disabled_notifier_sends_nothing(path_receiver: Receiver) -> None:
    """Without NOTIFY_SOCKET (or with it empty) the notifier is disabled and sends nothing."""
    for environ in ({}, {"NOTIFY_SOCKET": ""}):
        notifier = Notifier.from_env(environ)
        assert not notifier.enabled
        assert notifier.notify_socket is None
        assert not notifier.ready("x")
        assert not notifier.status("x")
        assert not notifier.watchdog()
        assert not notifier.stopping()
        assert not notifier.reloading()
        assert notifier.watchdog_interval_s() is None
    path_receiver.assert_empty()
    # The receiver does work: an enabled notifier's datagram arrives.
    Notifier.from_env({"NOTIFY_SOCKET": path_receiver.notify_socket}).stopping()
    assert path_receiver.receive() == {"STOPPING": "1"}


@pytest.mark.process
def test_from_env_reads_os_environ_in_a_real_process(path_receiver: Receiver) -> None:
    """A child given NOTIFY_SOCKET sends READY=1 from its own PID (what NotifyAccess=main needs)."""
    path_receiver.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    code = "from ggufswap.ipc.sdnotify import Notifier; Notifier.from_env().ready('up')"
    env = {**os.environ, "NOTIFY_SOCKET": path_receiver.notify_socket}
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        data, ancillary, _flags, _addr = path_receiver.sock.recvmsg(
            4096, socket.CMSG_SPACE(struct.calcsize("3i"))
        )
        assert child.wait(timeout=RECV_TIMEOUT_S) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=RECV_TIMEOUT_S)
    assert data == b"READY=1\nSTATUS=up"
    (level, kind, creds) = ancillary[0]
    assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)
    sender_pid, _uid, _gid = struct.unpack("3i", creds)
    assert sender_pid == child.pid


def test_unset_environment_removes_the_variables() -> None:
    """from_env(unset_environment=True) removes NOTIFY_SOCKET and WATCHDOG_* from the mapping."""
    environ = {
        "NOTIFY_SOCKET": "@x",
        "WATCHDOG_USEC": "1000000",
        "WATCHDOG_PID": str(os.getpid()),
        "PATH": "/bin",
    }
    notifier = Notifier.from_env(environ, unset_environment=True)
    assert notifier.enabled
    assert notifier.watchdog_interval_s() == 0.5
    assert environ == {"PATH": "/bin"}


def test_send_failure_is_logged_not_raised(tmp_path: Path) -> None:
    """Sending to a socket nobody listens on returns False and logs a warning."""
    notifier = Notifier(notify_socket=str(tmp_path / "gone"))
    with capture_logs() as logs:
        assert notifier.ready() is False
    assert [entry["event"] for entry in logs] == ["sd_notify_failed"]
    assert logs[0]["log_level"] == "warning"
    assert logs[0]["notify_socket"] == str(tmp_path / "gone")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("relative/notify", "absolute socket path"),
        ("vsock:2:1234", "vsock"),
        ("@", "1 to 107 bytes"),
        ("/" + "a" * 107, "at most 107 bytes, found 108"),
        ("@" + "a" * 108, "found 108 bytes"),
    ],
)
def test_invalid_notify_socket_raises_at_construction(value: str, match: str) -> None:
    """An unusable NOTIFY_SOCKET raises NotifySocketError naming the value."""
    with pytest.raises(NotifySocketError, match=match):
        Notifier.from_env({"NOTIFY_SOCKET": value})


def test_longest_valid_addresses_are_accepted() -> None:
    """A 107-byte path and a 107-byte abstract name are not over-rejected."""
    assert parse_notify_socket("/" + "a" * 106) == b"/" + b"a" * 106
    assert parse_notify_socket("@" + "a" * 107) == b"\0" + b"a" * 107


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4243"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "pid"}, None),
        ({"WATCHDOG_USEC": "abc"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
    ],
)
def test_watchdog_interval_parsing(environ: dict[str, str], expected: float | None) -> None:
    """Half of WATCHDOG_USEC in seconds; None without it, when invalid, or for another PID."""
    assert watchdog_interval_s(environ, pid=4242) == expected


def test_watchdog_pid_mismatch_disables_the_notifier_watchdog(path_receiver: Receiver) -> None:
    """WATCHDOG_PID naming another process leaves the notifier with no watchdog interval."""
    base = {"NOTIFY_SOCKET": path_receiver.notify_socket, "WATCHDOG_USEC": "2000000"}
    own = Notifier.from_env({**base, "WATCHDOG_PID": str(os.getpid())})
    other = Notifier.from_env({**base, "WATCHDOG_PID": str(os.getpid() + 1)})
    assert own.watchdog_interval_s() == 1.0
    assert other.watchdog_interval_s() is None
    assert not WatchdogPinger(other).enabled


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_pinger_pings_only_after_progress_and_interval(path_receiver: Receiver) -> None:
    """WATCHDOG=1 goes out only when progress was reported and the interval has elapsed."""
    notifier = Notifier.from_env(
        {"NOTIFY_SOCKET": path_receiver.notify_socket, "WATCHDOG_USEC": "10000000"}
    )
    clock = FakeClock()
    pinger = WatchdogPinger(notifier, clock=clock)
    assert pinger.enabled
    assert pinger.interval_s == 5.0

    pinger.progress()
    clock.now += 4.9
    assert not pinger.maybe_ping(), "interval not elapsed yet"
    clock.now += 0.1
    assert pinger.maybe_ping()
    assert path_receiver.receive() == {"WATCHDOG": "1"}

    clock.now += 60.0
    assert not pinger.maybe_ping(), "no progress since the last ping: a stuck loop stops pinging"
    path_receiver.assert_empty()

    pinger.progress()
    assert pinger.maybe_ping()
    assert path_receiver.receive() == {"WATCHDOG": "1"}
    pinger.progress()
    clock.now += 1.0
    assert not pinger.maybe_ping(), "interval counts from the previous ping"
    path_receiver.assert_empty()


def test_pinger_withholds_pings_while_an_essential_thread_is_down(path_receiver: Receiver) -> None:
    """With progress and the interval elapsed, no WATCHDOG=1 goes out while a supervised
    essential thread is down; pings resume once none is."""
    notifier = Notifier.from_env(
        {"NOTIFY_SOCKET": path_receiver.notify_socket, "WATCHDOG_USEC": "10000000"}
    )
    clock = FakeClock()
    down = ["ggufswap-link-m"]
    pinger = WatchdogPinger(notifier, clock=clock, threads_down=lambda: list(down))
    pinger.progress()
    clock.now += 5.0
    assert not pinger.maybe_ping(), "an essential thread is down"
    assert pinger.withheld == ["ggufswap-link-m"]
    path_receiver.assert_empty()
    down.clear()
    assert pinger.maybe_ping()
    assert path_receiver.receive() == {"WATCHDOG": "1"}
    assert pinger.withheld == []


def test_pinger_without_watchdog_never_pings(path_receiver: Receiver) -> None:
    """Without WATCHDOG_USEC the pinger is disabled and sends nothing, however much progress."""
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path_receiver.notify_socket})
    clock = FakeClock()
    pinger = WatchdogPinger(notifier, clock=clock)
    assert not pinger.enabled
    pinger.progress()
    clock.now += 3600.0
    assert not pinger.maybe_ping()
    path_receiver.assert_empty()


def test_pinger_explicit_interval_overrides_environment(path_receiver: Receiver) -> None:
    """An explicit interval_s is used instead of WATCHDOG_USEC."""
    notifier = Notifier(notify_socket=path_receiver.notify_socket)
    clock = FakeClock()
    pinger = WatchdogPinger(notifier, interval_s=0.5, clock=clock)
    pinger.progress()
    clock.now += 0.5
    assert pinger.maybe_ping()
    assert path_receiver.receive() == {"WATCHDOG": "1"}
