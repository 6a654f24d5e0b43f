"""Optional Prometheus metrics for the runtime (``runtime.metrics_port``).

A thin adapter over the runtime's plan events; prometheus-client is an optional dependency
(``pip install ggufswap[metrics]``) and is imported only when a port is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.ipc import Event, PlanCommittedEvent, PlanRejectedEvent, SlotState
from ggufswap.runtime.engine import HotSwapRuntime

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry

# Commit stalls are sub-millisecond to tens of milliseconds; buckets in seconds.
STALL_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)


class RuntimeMetrics:
    """Counters and gauges of one runtime, fed by its events; served over HTTP if asked."""

    def __init__(
        self, runtime: HotSwapRuntime, *, registry: CollectorRegistry | None = None
    ) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise RuntimeError(
                "metrics_port is set but prometheus-client is not installed: "
                "pip install 'ggufswap[metrics]'"
            ) from exc
        self._prom = prom
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self.runtime = runtime
        r = self.registry
        self.plans = prom.Counter(
            "ggufswap_runtime_plans", "Plans by outcome", ["outcome"], registry=r
        )
        self.stall = prom.Histogram(
            "ggufswap_runtime_commit_stall_seconds",
            "Time the inference loop paused to commit a plan",
            buckets=STALL_BUCKETS,
            registry=r,
        )
        self.bytes_reloaded = prom.Gauge(
            "ggufswap_runtime_bytes_reloaded",
            "Bytes read from shards for committed plans",
            registry=r,
        )
        self.weight_version = prom.Gauge(
            "ggufswap_runtime_weight_version", "Current weight version", registry=r
        )
        self.tensors = prom.Gauge(
            "ggufswap_runtime_tensors", "Tensors by slot state", ["state"], registry=r
        )
        self.pool_used = prom.Gauge(
            "ggufswap_runtime_pool_used_bytes", "Bytes used per pool", ["pool"], registry=r
        )
        self._http: WSGIServer | None = None  # the /metrics HTTP server while serving
        runtime.on_event(self._on_event)
        self.refresh()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, PlanCommittedEvent):
            self.plans.labels("committed").inc()
            self.stall.observe(event.stall_ms / 1e3)
        elif isinstance(event, PlanRejectedEvent):
            self.plans.labels("stale" if event.stale else "rejected").inc()
        self.refresh()

    def refresh(self) -> None:
        self.weight_version.set(self.runtime.weight_version)
        self.bytes_reloaded.set(self.runtime.bytes_reloaded)
        counts = self.runtime.store.state_counts()
        for state in SlotState:
            self.tensors.labels(state.value).set(counts[state.value])
        for name, used in self.runtime.store.pools.usage().items():
            self.pool_used.labels(name).set(used)

    def serve(self, port: int, *, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread, until :meth:`close`."""
        self._http, _thread = self._prom.start_http_server(port, addr=addr, registry=self.registry)

    def close(self) -> None:
        """Stop serving ``/metrics``: the thread ends and the port is released."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def exposition(self) -> bytes:
        return bytes(self._prom.generate_latest(self.registry))
