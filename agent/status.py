"""The agent's ``status`` endpoint: a ROUTER (ipc ``RequestServer``) answering ``status``.

The reply's ``status`` map (documented for ``ggufswap status`` and other clients)::

    pid, uptime_s, config, state            the daemon
    watched: [{model, directory, recursive, backend, why, link_target, watching}]
    backends: {NAME: {healthy, overflows, directories}}
    scans: {count, last_at, last_duration_s, last_reason, rescans: {REASON: count}}
    events: reports received from the backends
    models: {NAME: {generation, desired, held, pending_paths,
                    shards: {valid, invalid, settling},
                    invalid_shards: [{path, reason, held_by_last_good}],
                    writing_shards: [{path, reason}] (open for writing: held),
                    problems: [...], link: {...}}}

``link`` is :meth:`ggufswap.agent.link.RuntimeLink.status`: ``state``, ``connected``,
``weight_version``, ``pending_plan``, ``last_plans`` (with ``outcome``), ``blocked``, ``refused``
and ``last_error``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ggufswap.ipc import (
    ErrorCode,
    Fields,
    Handler,
    MessageType,
    Process,
    Request,
    make_error,
    make_reply,
)


def status_handler(build: Callable[[], dict[str, Any]]) -> Handler:
    """A ``RequestServer`` handler answering ``status`` with ``build()``; others get an error."""

    def handle(request: Request) -> Mapping[str, Any] | None:
        if request.type is MessageType.STATUS:
            return make_reply(
                request.msg, MessageType.STATUS_REPLY, process=Process.AGENT.value, status=build()
            )
        return make_error(
            request.msg.get(Fields.ID),
            ErrorCode.UNKNOWN_TYPE,
            f"the agent answers 'status' and 'ping', not {request.type.value!r}; plans go to "
            "a runtime's control endpoint",
        )

    return handle


def runtimes_view(runtimes: list[dict[str, Any]]) -> dict[str, Any]:
    """The model-level view of a model served by several runtimes (``models[].replicas``), from
    each link's status: the weight version each runtime serves (each counts its own commits), and
    whether all of them serve the files as last scanned (each reported its state, reconciled the
    newest scan, and has no plan in flight)."""
    newest = max(r["reconciled_generation"] for r in runtimes)
    return {
        "runtimes": runtimes,
        "weight_versions": {r["endpoint"]: r["weight_version"] for r in runtimes},
        "in_sync": all(
            r["weight_version"] is not None
            and r["pending_plan"] is None
            and r["reconciled_generation"] == newest
            for r in runtimes
        ),
    }


def status_line(status: Mapping[str, Any]) -> str:
    """One line for ``systemctl status`` (sd_notify ``STATUS=``)."""
    parts = []
    for name, model in sorted(status.get("models", {}).items()):
        shards = model.get("shards", {})
        link = model.get("link") or {}
        text = f"{name}: {shards.get('valid', 0)} valid"
        if shards.get("invalid"):
            text += f", {shards['invalid']} invalid"
        if link:
            text += f", runtime {link.get('state')}"
            if link.get("weight_version") is not None:
                text += f" v{link['weight_version']}"
        if "runtimes" in model:
            text += f", {len(model['runtimes'])} runtimes"
            text += ", in sync" if model.get("in_sync") else ", syncing"
        parts.append(text)
    return "; ".join(parts) or "no models"
