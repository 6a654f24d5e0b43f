"""systemd service notifications (``sd_notify``) without libsystemd.

The contract with the daemons (``ggufswap agent``, ``ggufswap runtime``), both ``Type=notify``
units with ``WatchdogSec=`` (see ``systemd/``):

* Build one :class:`Notifier` in ``main`` with :meth:`Notifier.from_env`. Outside systemd
  (``NOTIFY_SOCKET`` unset) it is a no-op, so the daemons call it unconditionally.
* Call :meth:`Notifier.ready` once the daemon can do its job: the agent after its first scan of the
  watched directories and once its status socket is bound; the runtime once the model is loaded
  and its control socket is bound. ``systemctl start`` returns, and units ordered after it start,
  only then. Use :meth:`Notifier.status` for one-line progress ("loading 12/40 shards").
* A long start-up may send :meth:`Notifier.extend_timeout` before ``TimeoutStartSec=`` runs out.
* The main loop owns a :class:`WatchdogPinger`: it calls ``progress()`` each time it completes an
  iteration and ``maybe_ping()`` on every pass. **The ping must come from the loop whose progress it
  proves**, never from a helper thread or timer: a thread that pings on a clock keeps a deadlocked
  daemon alive forever, which is exactly what the watchdog exists to catch. A loop that waits must
  wait with a timeout shorter than the ping interval (half of ``WatchdogSec=``) so that an idle
  daemon still completes iterations; a single step longer than ``WatchdogSec=`` needs a larger
  ``WatchdogSec=`` (drop-in) or its own ``progress()``/``maybe_ping()`` calls inside it.
* On SIGHUP the agent sends :meth:`Notifier.reloading`, re-reads its config, then ``ready()``
  again (also when the new config is invalid and the old one stays in force).
* :meth:`Notifier.stopping` when shutdown begins.

Each call sends one ``AF_UNIX``/``SOCK_DGRAM`` datagram of newline-separated ``KEY=value``
assignments to ``NOTIFY_SOCKET`` (a path, or an abstract socket written ``@name``), from the
calling process itself: ``NotifyAccess=main`` accepts only datagrams whose sender is the main PID.
A send failure is logged and reported as ``False``, never raised: losing a notification must not
take the daemon down. Only an invalid ``NOTIFY_SOCKET`` raises, at construction.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Mapping, MutableMapping

from ggufswap.ipc import supervisor
from ggufswap.ipc.errors import NotifySocketError
from ggufswap.logs import get_logger

log = get_logger(__name__)

# Environment variables set by systemd for the service's main process.
ENV_NOTIFY_SOCKET = "NOTIFY_SOCKET"
ENV_WATCHDOG_USEC = "WATCHDOG_USEC"
ENV_WATCHDOG_PID = "WATCHDOG_PID"
ENV_VARIABLES = (ENV_NOTIFY_SOCKET, ENV_WATCHDOG_USEC, ENV_WATCHDOG_PID)

# Largest sun_path (Linux): 108 bytes, of which a filesystem path needs one for its NUL.
_SUN_PATH_MAX = 108
_ABSTRACT_PREFIX = "@"
# A datagram that systemd cannot take at once means it is wedged; do not block the main loop.
_SEND_TIMEOUT_S = 1.0
_FIELD_NAME = re.compile(r"[A-Z][A-Z0-9_]*\Z")
_USEC_PER_S = 1_000_000


class Field:
    """The assignment names of the sd_notify protocol that this module sends (sd_notify(3))."""

    READY = "READY"
    RELOADING = "RELOADING"
    STOPPING = "STOPPING"
    STATUS = "STATUS"
    WATCHDOG = "WATCHDOG"
    MONOTONIC_USEC = "MONOTONIC_USEC"
    EXTEND_TIMEOUT_USEC = "EXTEND_TIMEOUT_USEC"


def parse_notify_socket(value: str) -> bytes:
    """The ``sockaddr_un`` path for a ``NOTIFY_SOCKET`` value (``@name`` → abstract ``\\0name``)."""
    if value.startswith(_ABSTRACT_PREFIX):
        name = os.fsencode(value[len(_ABSTRACT_PREFIX) :])
        address = b"\0" + name
        if not name or len(address) > _SUN_PATH_MAX:
            msg = (
                f"{ENV_NOTIFY_SOCKET}={value!r}: expected an abstract socket name of 1 to "
                f"{_SUN_PATH_MAX - 1} bytes after '@', found {len(name)} bytes"
            )
            raise NotifySocketError(msg)
        return address
    if not value.startswith("/"):
        msg = (
            f"{ENV_NOTIFY_SOCKET}={value!r}: expected an absolute socket path or an abstract "
            "socket '@name' (vsock: addresses are not supported)"
        )
        raise NotifySocketError(msg)
    address = os.fsencode(value)
    if len(address) >= _SUN_PATH_MAX:
        msg = (
            f"{ENV_NOTIFY_SOCKET}={value!r}: expected a path of at most {_SUN_PATH_MAX - 1} "
            f"bytes, found {len(address)} bytes"
        )
        raise NotifySocketError(msg)
    return address


def watchdog_interval_s(
    environ: Mapping[str, str] | None = None, *, pid: int | None = None
) -> float | None:
    """Half the watchdog period from ``WATCHDOG_USEC``, or ``None`` when there is no watchdog.

    ``None`` also when ``WATCHDOG_PID`` is set to another process (the variables were inherited,
    not meant for this one) or when ``WATCHDOG_USEC`` is not a positive integer (logged).
    """
    env = os.environ if environ is None else environ
    raw_usec = env.get(ENV_WATCHDOG_USEC)
    if raw_usec is None:
        return None
    own_pid = os.getpid() if pid is None else pid
    raw_pid = env.get(ENV_WATCHDOG_PID)
    if raw_pid is not None:
        if not raw_pid.isdecimal():
            log.warning("sd_watchdog_pid_invalid", expected="a process id", found=raw_pid)
            return None
        if int(raw_pid) != own_pid:
            log.debug("sd_watchdog_other_process", watchdog_pid=int(raw_pid), pid=own_pid)
            return None
    if not raw_usec.isdecimal() or int(raw_usec) == 0:
        log.warning("sd_watchdog_usec_invalid", expected="a positive integer (µs)", found=raw_usec)
        return None
    return int(raw_usec) / _USEC_PER_S / 2


class Notifier:
    """Sends sd_notify datagrams to systemd; a no-op (``enabled`` is ``False``) outside systemd.

    Every sending method returns whether the datagram was sent. Not a lifecycle object: each call
    opens, uses and closes its own socket, so there is nothing to close and it is fork-safe.
    """

    def __init__(
        self, *, notify_socket: str | None, watchdog_interval_s: float | None = None
    ) -> None:
        self._address = None if notify_socket is None else parse_notify_socket(notify_socket)
        self._notify_socket = notify_socket
        self._watchdog_interval_s = watchdog_interval_s if self._address is not None else None

    @classmethod
    def from_env(
        cls,
        environ: MutableMapping[str, str] | None = None,
        *,
        unset_environment: bool = False,
    ) -> Notifier:
        """The notifier systemd set up for this process (``os.environ`` unless ``environ``).

        ``unset_environment`` removes the variables afterwards, so that child processes (compile
        workers, ``subprocess`` calls) do not inherit them. An empty ``NOTIFY_SOCKET`` counts as
        unset. Raises :class:`NotifySocketError` if ``NOTIFY_SOCKET`` is set but invalid.
        """
        env = os.environ if environ is None else environ
        notifier = cls(
            notify_socket=env.get(ENV_NOTIFY_SOCKET) or None,
            watchdog_interval_s=watchdog_interval_s(env),
        )
        if unset_environment:
            for name in ENV_VARIABLES:
                env.pop(name, None)
        return notifier

    @classmethod
    def disabled(cls) -> Notifier:
        """A notifier that sends nothing (for embedding and tests)."""
        return cls(notify_socket=None)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def notify_socket(self) -> str | None:
        """The ``NOTIFY_SOCKET`` value this notifier sends to, ``None`` when disabled."""
        return self._notify_socket

    def watchdog_interval_s(self) -> float | None:
        """How often to send ``WATCHDOG=1`` (half of ``WatchdogSec=``); ``None``: no watchdog."""
        return self._watchdog_interval_s

    def __repr__(self) -> str:
        return (
            f"Notifier(notify_socket={self._notify_socket!r}, "
            f"watchdog_interval_s={self._watchdog_interval_s!r})"
        )

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up (or a reload) is complete."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def status(self, text: str) -> bool:
        """``STATUS=text``: one line shown by ``systemctl status`` (newlines become spaces)."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``; prefer :class:`WatchdogPinger`, which pings only on progress."""
        return self.notify(WATCHDOG=1)

    def stopping(self) -> bool:
        """``STOPPING=1``: shutdown has begun."""
        return self.notify(STOPPING=1)

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (``Type=notify-reload`` semantics).

        Follow it with :meth:`ready` when the reload is finished, successful or not.
        """
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(RELOADING=1, MONOTONIC_USEC=now_usec)

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: the current start/stop step needs ``seconds`` more from now."""
        return self.notify(EXTEND_TIMEOUT_USEC=max(0, round(seconds * _USEC_PER_S)))

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` assignments in one datagram, e.g. ``notify(READY=1, STATUS="ok")``.

        Names must be upper-case sd_notify names (ValueError otherwise: a programming error);
        newlines in values become spaces so that a value cannot inject an assignment. Returns
        ``False`` without sending when disabled or when the send fails (logged as a warning).
        """
        bad = [name for name in fields if not _FIELD_NAME.match(name)]
        if bad or not fields:
            msg = f"sd_notify field names must match {_FIELD_NAME.pattern!r}, found {bad or '{}'}"
            raise ValueError(msg)
        if self._address is None:
            return False
        payload = "\n".join(f"{name}={_one_line(value)}" for name, value in fields.items())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(_SEND_TIMEOUT_S)
                sock.sendto(payload.encode(), self._address)
        except OSError as exc:
            log.warning(
                "sd_notify_failed",
                notify_socket=self._notify_socket,
                fields=sorted(fields),
                error=str(exc),
            )
            return False
        return True


def _one_line(value: str | int) -> str:
    return str(value).replace("\r", " ").replace("\n", " ")


class WatchdogPinger:
    """Sends ``WATCHDOG=1`` only while the owning loop makes progress and no essential thread of
    the process is down.

    The owner's main loop calls :meth:`progress` each time it completes an iteration and
    :meth:`maybe_ping` on every pass; a ping is sent when progress was reported since the last
    ping and the interval has elapsed. A stuck loop calls neither, systemd misses its pings and
    restarts the service. Both methods must be called from that same loop (not thread-safe, and a
    ping from elsewhere would prove nothing). ``clock`` is injectable for tests.

    The loop is not the only thing that must live: while any essential supervised thread is
    restarting or dead (``ggufswap.ipc.supervisor.down``, injectable as ``threads_down``), no
    ping is sent either, and the first withheld ping is logged (``watchdog.withheld``).
    """

    def __init__(
        self,
        notifier: Notifier,
        *,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        threads_down: Callable[[], list[str]] = supervisor.down,
    ) -> None:
        self._notifier = notifier
        self._threads_down = threads_down
        self.withheld: list[str] = []  # the essential threads down at the last withheld ping
        self._interval_s = notifier.watchdog_interval_s() if interval_s is None else interval_s
        self._clock = clock
        self._last_ping_at = clock()
        self._progressed = False

    @property
    def enabled(self) -> bool:
        """Whether pings are sent at all (a notifier and a watchdog interval are both present)."""
        return self._notifier.enabled and self._interval_s is not None

    @property
    def interval_s(self) -> float | None:
        return self._interval_s

    def progress(self) -> None:
        """The loop completed an iteration."""
        self._progressed = True

    def maybe_ping(self) -> bool:
        """Ping if there was progress since the last ping and the interval elapsed; sent?"""
        if self._interval_s is None or not self._progressed:
            return False
        now = self._clock()
        if now - self._last_ping_at < self._interval_s:
            return False
        down = self._threads_down()
        if down:
            if down != self.withheld:  # said when it changes, not at every pass
                log.error("watchdog.withheld", threads_down=down)
            self.withheld = down
            return False
        if self.withheld:
            log.info("watchdog.resumed", threads_were_down=self.withheld)
            self.withheld = []
        # The attempt counts even if the send fails: the failure is logged, and retrying at once
        # on every pass would flood the log.
        self._last_ping_at = now
        self._progressed = False
        return self._notifier.watchdog()
