"""The agent daemon: one main loop that turns change reports into scans and scans into plans.

Threads: the watcher backends (report paths into a :class:`ChangeQueue`, nothing else), one
:class:`~ggufswap.agent.link.RuntimeLink` per model (talks to its runtime, computes plans), the
status server, and the main loop here, which owns the debouncer, the shard indexes and the
watches. The main loop waits at most ``MAX_WAIT_S`` at a time, so stop and reload flags (set by
signal handlers, which do nothing else) are seen promptly, and it feeds the systemd watchdog
only when it completes an iteration.

Coalescing: changed paths settle individually (``settle_ms``); a model is re-scanned once no
path is pending, or when paths have been pending for ``max_defer_s`` (then the still-settling
files are skipped and their tensors held). A burst of thousands of events is one scan.

The watched directories and their backends are ``agent/watchset.py``'s ``WatchSet``; the
main loop hands it the roots its models need and makes the full scans its checks ask for.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufswap.agent.debounce import Debouncer
from ggufswap.agent.errors import AgentError, DaemonStateError
from ggufswap.agent.index import Health, ModelIndex, ModelSnapshot, WatchRoot
from ggufswap.agent.link import RuntimeLink
from ggufswap.agent.status import runtimes_view, status_handler, status_line
from ggufswap.agent.watch import ChangeQueue, RescanReason, Watcher
from ggufswap.agent.watchset import WatchSet
from ggufswap.config import Config, ConfigError, ModelConfig, WatchBackend, load_config
from ggufswap.ipc import MessageType, RequestServer, SocketOptions, supervisor
from ggufswap.ipc.codec import STATUS_MAX_REQUEST_SIZE
from ggufswap.ipc.sdnotify import Notifier, WatchdogPinger
from ggufswap.logs import get_logger
from ggufswap.shards import Fingerprinter, HeaderCache

log = get_logger(__name__)

MAX_WAIT_S = 0.2
ROOT_CHECK_S = 0.5
STOP_STEP_TIMEOUT_S = 3.0  # per stage of shutdown; TimeoutStopSec=15 bounds the whole


class DaemonState(str, enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


_ALLOWED: dict[DaemonState, frozenset[DaemonState]] = {
    # STOPPING straight from CREATED: a start() that failed half-way closes what it opened.
    DaemonState.CREATED: frozenset({DaemonState.RUNNING, DaemonState.STOPPING}),
    DaemonState.RUNNING: frozenset({DaemonState.STOPPING}),
    DaemonState.STOPPING: frozenset({DaemonState.STOPPED}),
    DaemonState.STOPPED: frozenset(),
}


@dataclass
class _Model:
    config: ModelConfig
    index: ModelIndex
    link: RuntimeLink | None
    dirty: bool = True
    # One more link per ``replicas`` endpoint: each reconciles its own runtime against the files.
    replicas: list[RuntimeLink] = field(default_factory=list)
    last_health: dict[str, Health] = field(default_factory=dict)


def _links(slot: _Model) -> list[RuntimeLink]:
    """The model's runtime links: its ``runtime`` first, then its ``replicas``."""
    return ([slot.link] if slot.link is not None else []) + slot.replicas


class AgentDaemon:
    """The agent. ``start()`` (binds, first scan, READY), ``run()`` until stopped, ``close()``.

    Its lifecycle, ``CREATED → RUNNING → STOPPING → STOPPED``, moves only through ``_move``,
    guarded by ``_ALLOWED`` as a link's is (a second ``start()`` raises ``DaemonStateError``).

    ``request_stop`` and ``request_reload`` only set flags: they are what signal handlers call.
    ``connect=False`` runs without runtime links (scans and status only).
    """

    def __init__(
        self,
        config: Config,
        *,
        config_path: Path | None = None,
        notifier: Notifier | None = None,
        connect: bool = True,
        max_defer_s: float | None = None,
        heartbeat_interval_s: float = 1.0,
        stop: threading.Event | None = None,
        reload: threading.Event | None = None,
    ) -> None:
        self.config = config
        self._config_path = config_path if config_path is not None else config.source
        self._notifier = notifier if notifier is not None else Notifier.disabled()
        self._pinger = WatchdogPinger(self._notifier)
        self._connect = connect
        self._max_defer_override = max_defer_s
        self._heartbeat_s = heartbeat_interval_s
        self._cache = HeaderCache()
        self._fingerprinter = Fingerprinter()
        self.queue = ChangeQueue()
        self._debouncer = Debouncer()
        self._watches = WatchSet(self.queue, stop_timeout_s=STOP_STEP_TIMEOUT_S)
        self._models: dict[str, _Model] = {}
        self._server: RequestServer | None = None
        self._metrics_http: Any = None  # the /metrics HTTP server, when metrics_port is set
        self._options = SocketOptions.of(config.security)  # of the current config
        self._state = DaemonState.CREATED
        self._stop_flag = stop if stop is not None else threading.Event()
        self._reload_flag = reload if reload is not None else threading.Event()
        self._started_at = time.monotonic()
        self._next_rescan = 0.0
        self._next_root_check = 0.0
        self._scans = 0
        self._rescans: dict[str, int] = {}
        self._last_scan: dict[str, Any] = {}
        self._published: dict[str, Any] = {}
        self._status_text = ""
        self._pending_count = 0
        self._forced_at = 0.0
        self._reloads: dict[str, Any] = {"ok": 0, "failed": 0, "last_error": None}
        self.iterations = 0
        # Set when an essential supervised thread was given up: run() ends, main exits 1.
        self.failure: str | None = None
        self._forget_dead_hook: Any = None

    # -- flags (signal-safe) -----------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop_flag.set()

    def request_reload(self) -> None:
        self._reload_flag.set()

    @property
    def state(self) -> DaemonState:
        return self._state

    def _move(self, to: DaemonState) -> None:
        self._check_move(to)
        self._state = to

    def _check_move(self, to: DaemonState) -> None:
        if to not in _ALLOWED[self._state]:
            raise DaemonStateError(f"agent: cannot go from {self._state.value} to {to.value}")

    def watchers(self) -> dict[WatchBackend, Watcher]:
        """The running backend instances (for diagnostics and tests)."""
        return dict(self._watches.watchers)

    @property
    def status_endpoint(self) -> str | None:
        return self._server.endpoint if self._server is not None else None

    # -- start -------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the status socket, watch, scan every model, connect; then READY=1."""
        self._check_move(DaemonState.RUNNING)
        self._forget_dead_hook = supervisor.on_dead(self._on_thread_dead)
        self._server = RequestServer(
            self.config.agent.status_endpoint,
            status_handler(self.status),
            name="agent",
            # `ggufswap status` by members of the socket directory's group (docs/operations.md)
            options=dataclasses.replace(self._options, group_access=True),
            types=(MessageType.STATUS,),
            max_request_size=STATUS_MAX_REQUEST_SIZE,
        ).start()
        try:
            self._build(self.config)
        except BaseException:
            self.close()
            raise
        self._move(DaemonState.RUNNING)
        if self.config.agent.metrics_port is not None:
            from ggufswap.agent.metrics import serve_metrics

            self._metrics_http = serve_metrics(self.status, self.config.agent.metrics_port)
        self._publish()
        self._notifier.ready(status=status_line(self._published))
        log.info("agent.ready", models=sorted(self._models), status=self.status_endpoint)

    def _build(self, config: Config) -> None:
        """Indexes, watches, a first scan of every model, and links (in that order)."""
        models = config.require_models()
        for model in models:
            self._models[model.name] = _Model(
                model, ModelIndex(model, cache=self._cache), link=None
            )
        now = time.monotonic()
        self._sync_watches()
        self._scan_dirty(now, reason="startup", force=True)
        self._sync_watches()  # link targets found by the first scan
        for slot in self._models.values():
            if self._connect:
                slot.link, *slot.replicas = (
                    RuntimeLink(
                        dataclasses.replace(slot.config, runtime=endpoint, replicas=()),
                        fingerprinter=self._fingerprinter,
                        options=self._options,
                        heartbeat_interval_s=self._heartbeat_s,
                        state_refresh_s=config.agent.rescan_interval_s,
                        on_stale=self._on_stale,
                        scrub=endpoint == slot.config.runtime,  # one scrub per model
                    )
                    for endpoint in (slot.config.runtime, *slot.config.replicas)
                )
                slot.link.scrub_also(slot.replicas)
                for link in _links(slot):
                    if slot.index.snapshot is not None:
                        link.set_desired(slot.index.snapshot)
                    link.start()
        self._next_rescan = now + config.agent.rescan_interval_s
        self._next_root_check = now + ROOT_CHECK_S

    def _on_stale(self, model: str) -> None:  # called from a link thread
        self.queue.rescan_needed(RescanReason.STALE, model)

    def _on_thread_dead(self, name: str) -> None:  # called from the thread given up
        """An essential thread failed ``give_up_after`` times in a row: the watchdog pings
        stopped already; stop, so that the process exits non-zero and is restarted."""
        self.failure = f"essential thread {name} failed repeatedly and was given up"
        log.error("agent.thread_given_up", thread=name, exit="non-zero, for a restart")
        self._stop_flag.set()

    # -- watches -----------------------------------------------------------------------------

    def _wanted(self) -> list[tuple[WatchRoot, str]]:
        """Every directory some model needs, with the model."""
        return [
            (root, slot.config.name)
            for slot in self._models.values()
            for root in slot.index.watch_roots()
        ]

    def _sync_watches(self) -> None:
        """Watch every directory some model needs; forget the others."""
        self._watches.sync(self._wanted())

    def _check_roots(self) -> None:
        """Re-watch directories that changed, restart dead backends; rescan after either."""
        for reason, detail in self._watches.check(self._wanted()):
            self._request_full_scan(reason, detail)

    # -- the loop ----------------------------------------------------------------------------

    def _max_defer_s(self) -> float:
        if self._max_defer_override is not None:
            return self._max_defer_override
        settle = max((m.config.settle_ms for m in self._models.values()), default=0) / 1000
        return max(2.0, 8 * settle)

    def run(self) -> None:
        """The main loop, until ``request_stop``; then a bounded shutdown."""
        try:
            while not self._stop_flag.is_set():
                if self._reload_flag.is_set():
                    self._reload_flag.clear()
                    self.reload()
                self.step()
                self._pinger.progress()
                self._pinger.maybe_ping()
        finally:
            self.close()

    def step(self) -> None:
        """One iteration: wait for reports (bounded), settle, scan, hand scans to the links."""
        now = time.monotonic()
        wait = min(MAX_WAIT_S, self._next_rescan - now, self._next_root_check - now)
        deadline = self._debouncer.next_deadline()
        if deadline is not None:
            wait = min(wait, deadline - now)
        self.queue.wait(max(0.0, wait))
        paths, rescans = self.queue.drain()
        now = time.monotonic()
        for path in paths:
            self._route(path, now)
        for request in rescans:
            self._request_full_scan(request.reason, request.detail)
        for key in self._debouncer.due(now):
            # Settled: a scan that ran while it was pending skipped it (and held its tensors).
            for slot in self._models.values():
                if slot.index.concerns(key):
                    slot.dirty = True
        if now >= self._next_rescan:
            self._next_rescan = now + self.config.agent.rescan_interval_s
            self._request_full_scan(RescanReason.PERIODIC, "rescan_interval_s")
        if now >= self._next_root_check:
            self._next_root_check = now + ROOT_CHECK_S
            self._check_roots()
        oldest = self._debouncer.oldest_since()
        if len(self._debouncer) == 0:
            self._scan_dirty(now, reason="changes")
        elif oldest is not None and now - max(oldest, self._forced_at) >= self._max_defer_s():
            # Changes for longer than max_defer_s: scan what has settled, at most that often.
            self._forced_at = now
            self._scan_dirty(now, reason="deferred too long")
        self._pending_count = len(self._debouncer)
        self.iterations += 1

    def _route(self, path: str, now: float) -> None:
        settle_s = None
        for slot in self._models.values():
            if slot.index.concerns(path):
                slot.dirty = True
                settle_s = max(settle_s or 0.0, slot.config.settle_ms / 1000)
        if settle_s is not None:
            self._debouncer.touch(path, now, settle_s)
        if self._watches.event_on(path):  # a watched directory itself: look at it now
            self._next_root_check = now

    def _request_full_scan(self, reason: RescanReason, detail: str) -> None:
        self._rescans[reason.value] = self._rescans.get(reason.value, 0) + 1
        log.info("scan.full_requested", reason=reason.value, detail=detail)
        for slot in self._models.values():
            if reason is not RescanReason.STALE or detail in (slot.config.name, ""):
                slot.dirty = True
        self._last_scan["reason"] = reason.value

    def _scan_dirty(self, now: float, *, reason: str, force: bool = False) -> None:
        pending = self._debouncer.pending()
        scanned = False
        for slot in self._models.values():
            if not (slot.dirty or force):
                continue
            slot.dirty = False
            snapshot = slot.index.scan(skip=pending)
            scanned = True
            self._scans += 1
            self._last_scan.update(
                at=snapshot.scanned_at, duration_s=round(snapshot.scan_s, 6), model=slot.config.name
            )
            self._report_health(slot, snapshot)
            for shard in snapshot.shards:
                if shard.health is Health.SETTLING and shard.path not in pending:
                    # Held because another process has it open for writing: no event may come
                    # when it stops (an mmap writer), so look again after a settle window.
                    self._route(shard.path, now)
            for link in _links(slot):
                link.set_desired(snapshot)
        if scanned:
            self._sync_watches()  # new or vanished link targets
            self._publish()

    def _report_health(self, slot: _Model, snapshot: ModelSnapshot) -> None:
        current = {s.path: s.health for s in snapshot.shards}
        for shard in snapshot.shards:
            before = slot.last_health.get(shard.path)
            if shard.health is Health.INVALID and before is not Health.INVALID:
                log.warning(
                    "shard.invalid",
                    model=slot.config.name,
                    shard=shard.path,
                    reason=shard.reason,
                    held_by_last_good=shard.held_by_last_good,
                )
            elif shard.health is Health.VALID and before is Health.INVALID:
                log.info("shard.valid", model=slot.config.name, shard=shard.path)
        for problem in snapshot.problems:
            log.warning("model.problem", model=slot.config.name, problem=problem)
        slot.last_health = current

    # -- status ------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Rebuild the main-loop part of the status (read by the status server's thread)."""
        models: dict[str, Any] = {}
        for name, slot in self._models.items():
            snap = slot.index.snapshot
            if snap is None:
                continue
            counts = {h.value: 0 for h in Health}
            for shard in snap.shards:
                counts[shard.health.value] += 1
            models[name] = {
                "generation": snap.generation,
                "desired": len(snap.desired),
                "held": len(snap.held),
                "shards": counts,
                "invalid_shards": [
                    {"path": s.path, "reason": s.reason, "held_by_last_good": s.held_by_last_good}
                    for s in snap.invalid[:100]
                ],
                "writing_shards": [
                    {"path": s.path, "reason": s.reason}
                    for s in snap.shards
                    if s.health is Health.SETTLING and s.reason is not None
                ][:100],
                "problems": list(snap.problems[:50]),
                "last_scan_at": snap.scanned_at,
                "last_scan_s": round(snap.scan_s, 6),
            }
        self._published = {
            **self._watches.status(),  # watched, backends
            "scans": {"count": self._scans, **self._last_scan, "rescans": dict(self._rescans)},
            "models": models,
        }
        text = status_line(self.status())
        if text != self._status_text:
            self._status_text = text
            self._notifier.status(text)

    def status(self) -> dict[str, Any]:
        """The status map (see ``ggufswap.agent.status``); safe from any thread."""
        published = self._published
        models = {name: dict(body) for name, body in published.get("models", {}).items()}
        for name, slot in list(self._models.items()):
            body = models.setdefault(name, {})
            body["link"] = slot.link.status() if slot.link is not None else None
            if slot.replicas:
                body.update(runtimes_view([link.status() for link in _links(slot)]))
        return {
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self._started_at, 3),
            "state": self._state.value,
            "config": str(self._config_path) if self._config_path else None,
            "events": self.queue.events,
            "pending_paths": self._pending_count,
            "reloads": dict(self._reloads),
            "threads": supervisor.snapshot(),
            "threads_down": supervisor.down(),
            "threads_unsupervised": supervisor.unsupervised(),
            **{k: v for k, v in published.items() if k != "models"},
            "models": models,
        }

    # -- reload and stop ---------------------------------------------------------------------

    def reload(self) -> bool:
        """SIGHUP: re-read the config; an invalid one is logged and the old one stays."""
        self._notifier.reloading()
        try:
            if self._config_path is None:
                raise AgentError("no configuration file to reload (the config came from text)")
            new = load_config(self._config_path)
            new.require_models()
        except (ConfigError, AgentError) as exc:
            log.error("agent.reload_failed", error=str(exc), kept="the previous configuration")
            self._reloads["failed"] += 1
            self._reloads["last_error"] = str(exc)
            self._notifier.ready(status=f"reload failed, previous config kept: {exc}"[:200])
            return False
        log.info("agent.reloading", config=str(self._config_path))
        self._teardown_models()
        self.config = new
        self._options = SocketOptions.of(new.security)  # for the new links; the status
        self._build(new)  # socket keeps its own until the agent restarts
        self._request_full_scan(RescanReason.RELOAD, str(self._config_path))
        self._reloads["ok"] += 1
        self._publish()
        self._notifier.ready(status=status_line(self.status()))
        return True

    def _teardown_models(self) -> None:
        for slot in self._models.values():
            for link in _links(slot):
                link.stop(STOP_STEP_TIMEOUT_S)
        self._models.clear()
        self._watches.unwatch_all()

    def close(self) -> None:
        """Bounded shutdown: links, then watchers, then the status socket."""
        if self._state is DaemonState.STOPPED:
            return
        if self._state is not DaemonState.STOPPING:  # STOPPING: a close that failed, again
            self._move(DaemonState.STOPPING)
        self._notifier.stopping()
        log.info("agent.stopping")
        # 1. links: each stops within STOP_STEP_TIMEOUT_S; plans in flight stay with the runtime.
        for slot in self._models.values():
            for link in _links(slot):
                link.stop(STOP_STEP_TIMEOUT_S)
        # 2. watcher threads.
        self._watches.close()
        # 3. the status socket (removes the ipc socket file).
        if self._server is not None:
            self._server.stop(STOP_STEP_TIMEOUT_S)
        # 4. the /metrics HTTP server.
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        if self._forget_dead_hook is not None:
            self._forget_dead_hook()
        self._move(DaemonState.STOPPED)
        log.info("agent.stopped")
