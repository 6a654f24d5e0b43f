"""Optional Prometheus metrics for the agent (``agent.metrics_port``).

A collector that reads the daemon's status at scrape time: the metrics are the status, so they
cannot drift from what ``ggufswap status`` shows, and the main loop pays nothing for them.
prometheus-client is optional (``pip install ggufswap[metrics]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def _require_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise RuntimeError(
            "agent.metrics_port is set but prometheus-client is not installed: "
            "pip install 'ggufswap[metrics]'"
        ) from exc
    return prometheus_client


class AgentCollector:
    """Turns one status snapshot into metric families on every scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status
        self._prom = _require_prometheus()

    def describe(self) -> list[Any]:
        return []  # families vary with the configured models: collected, not declared

    def collect(self) -> Iterator[Any]:
        from prometheus_client import core

        status = self._status()
        scans = status.get("scans", {})
        yield core.CounterMetricFamily(
            "ggufswap_agent_scans", "Scans of the watched models", value=scans.get("count", 0)
        )
        rescans = core.CounterMetricFamily(
            "ggufswap_agent_rescans", "Full rescans by reason", labels=["reason"]
        )
        for reason, count in sorted((scans.get("rescans") or {}).items()):
            rescans.add_metric([reason], count)
        yield rescans
        shards = core.GaugeMetricFamily(
            "ggufswap_agent_shards", "Shard files by validation state", labels=["model", "state"]
        )
        plans = core.CounterMetricFamily(
            "ggufswap_agent_plans", "Plans sent, by outcome", labels=["model", "outcome"]
        )
        version = core.GaugeMetricFamily(
            "ggufswap_agent_runtime_weight_version",
            "The runtime's weight version as the agent last saw it",
            labels=["model"],
        )
        connected = core.GaugeMetricFamily(
            "ggufswap_agent_runtime_connected", "Whether the runtime link is up", labels=["model"]
        )
        for name, model in sorted((status.get("models") or {}).items()):
            for state, count in sorted((model.get("shards") or {}).items()):
                shards.add_metric([name, state], count)
            link = model.get("link") or {}
            for outcome, count in sorted((link.get("plans_by_outcome") or {}).items()):
                plans.add_metric([name, outcome], count)
            if link.get("weight_version") is not None:
                version.add_metric([name], link["weight_version"])
            connected.add_metric([name], 1.0 if link.get("connected") else 0.0)
        yield from (shards, plans, version, connected)


def serve_metrics(
    status: Callable[[], dict[str, Any]], port: int, *, addr: str = "127.0.0.1"
) -> Any:
    """Serve ``/metrics`` for ``status`` on ``addr:port`` from a daemon thread; the HTTP server
    (``shutdown()`` then ``server_close()`` stop it)."""
    prom = _require_prometheus()
    registry = prom.CollectorRegistry()
    registry.register(AgentCollector(status))
    server, _thread = prom.start_http_server(port, addr=addr, registry=registry)
    return server
