"""Prometheus metrics of the runtime: the swap series (plans, stalls, weight version, slot
states, pool bytes: :class:`RuntimeMetrics`, fed by the runtime's plan events) and, in http
mode, the serving series (:class:`ServingMetrics`: requests, latency, tokens, queue), both on the
serving port's ``/metrics``. ``runtime.metrics_port`` also serves the swap series on a port of
their own (the probe and perplexity modes have no HTTP server). prometheus-client comes with the
``runtime`` extra and is imported only here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ggufswap.ipc import Event, PlanCommittedEvent, PlanRejectedEvent, SlotState

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry

    from ggufswap.runtime.engine import HotSwapRuntime

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


# Request latencies: a few milliseconds (health, tokenize) to minutes (long generations).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ROUTES_COUNTED = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/props",
        "/tokenize",
        "/detokenize",
        "/metrics",
        "/v1/weights/update",
        "/update_weights_from_disk",
        "/v1/weights",
    }
)


class ServingMetrics:
    """The serving port's ``/metrics``: requests by route and status, their latency, tokens,
    the queue and the batch, beside the swap series of :class:`RuntimeMetrics` (one registry),
    which join once the runtime has started."""

    def __init__(self) -> None:
        import prometheus_client as prom

        self._prom = prom
        self.registry = prom.CollectorRegistry()
        self.content_type = str(prom.CONTENT_TYPE_LATEST)
        r = self.registry
        self.requests = prom.Counter(
            "ggufswap_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.latency = prom.Histogram(
            "ggufswap_http_request_seconds",
            "HTTP request latency by route (streams: to the first byte)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_seconds = prom.Histogram(
            "ggufswap_generation_seconds",
            "Completion requests from arrival to the last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = prom.Counter(
            "ggufswap_prompt_tokens", "Prompt tokens of completed requests", registry=r
        )
        self.completion_tokens = prom.Counter(
            "ggufswap_completion_tokens", "Tokens generated by completed requests", registry=r
        )
        self.queued = prom.Gauge(
            "ggufswap_queue_prompts", "Prompts waiting to start (each n times)", registry=r
        )
        self.running = prom.Gauge(
            "ggufswap_sequences_running", "Sequences being decoded", registry=r
        )
        self.runtime_metrics: RuntimeMetrics | None = None

    def attach(self, runtime: HotSwapRuntime, batcher: Any) -> None:
        """Add the swap series of ``runtime`` and read the queue from ``batcher``."""
        self.runtime_metrics = RuntimeMetrics(runtime, registry=self.registry)
        self.queued.set_function(lambda: float(batcher.status()["queued_prompts"]))
        self.running.set_function(lambda: float(batcher.status()["in_flight"]))

    def request(self, route: str, status: int, seconds: float) -> None:
        label = route if route in ROUTES_COUNTED else "other"
        self.requests.labels(label, str(status)).inc()
        self.latency.labels(label).observe(seconds)

    def tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)

    def generation(self, seconds: float) -> None:
        self.generation_seconds.observe(seconds)

    def exposition(self) -> bytes:
        if self.runtime_metrics is not None:
            self.runtime_metrics.refresh()
        return bytes(self._prom.generate_latest(self.registry))
