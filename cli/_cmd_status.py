"""``ggufswap status [ENDPOINT]``: ask the agent or a runtime how it is doing."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ggufswap.config import ConfigError, default_runtime_dir, load_config
from ggufswap.config.endpoints import ipc_endpoint
from ggufswap.ipc import (
    ErrorReply,
    IpcError,
    MessageType,
    PeerRefused,
    PeerTimeout,
    StatusReply,
    make_message,
    parse_reply,
    request,
)

AGENT_SOCKET = "agent.sock"
STATUS_SUFFIX = ".status.sock"
# Keys of status replies whose value is a wall-clock time (seconds since the epoch).
TIME_KEY_SUFFIX = "_at"

EXIT_OK = 0
EXIT_UNREACHABLE = 1
EXIT_USAGE = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the status of the agent or a runtime",
        description=(
            "Send a status request to ENDPOINT, or to every process a --config names (the agent "
            "and each runtime), and print the replies as tables, or as JSON with --json."
        ),
    )
    parser.add_argument(
        "endpoint",
        nargs="?",
        help="e.g. ipc:///run/ggufswap/agent.sock (default: every status socket in the default "
        "socket directory, /run/ggufswap under systemd)",
    )
    parser.add_argument("--config", metavar="FILE", help="take the endpoints from a config file")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="S")
    parser.set_defaults(func=run)


def endpoints_of(args: argparse.Namespace) -> list[str]:
    if args.endpoint:
        return [args.endpoint]
    if not args.config:
        return default_endpoints()
    config = load_config(args.config)
    found: list[str] = []
    if config.models:
        found.append(config.agent.status_endpoint)
    if config.runtime is not None:
        found.append(config.runtime.status_endpoint)
    return found


def default_endpoints(*, directory: Path | None = None) -> list[str]:
    """With neither ENDPOINT nor --config: the status sockets in the default socket directory
    (the agent's ``agent.sock``, each runtime's ``NAME.status.sock``)."""
    directory = default_runtime_dir() if directory is None else directory
    found = sorted(directory.glob(f"*{STATUS_SUFFIX}"))
    agent = directory / AGENT_SOCKET
    sockets = ([agent] if agent.exists() else []) + found
    if not sockets:
        raise ValueError(
            f"no agent.sock or *{STATUS_SUFFIX} in {directory} (the default socket directory); "
            "give an ENDPOINT or --config FILE"
        )
    return [ipc_endpoint(path) for path in sockets]


def _answer(reply: Mapping[str, Any]) -> dict[str, Any]:
    """A status reply as shown: the process and its status map, or the error it stands for."""
    try:
        body = parse_reply(reply).body
    except IpcError as exc:
        return {"error": f"bad status reply: {exc}"}
    match body:
        case StatusReply():
            return {"process": body.process.value, "status": dict(body.status)}
        case ErrorReply():
            return {"error": body.message}
        case _:
            return {"error": f"answered a status request with {type(body).__name__}"}


def run(args: argparse.Namespace) -> int:
    try:
        endpoints = endpoints_of(args)
    except (ValueError, ConfigError) as exc:
        print(f"ggufswap status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    replies: dict[str, Any] = {}
    code = EXIT_OK
    for endpoint in endpoints:
        try:
            reply = request(
                endpoint, make_message(MessageType.STATUS), timeout_s=args.timeout, retries=0
            )
        except (PeerTimeout, PeerRefused) as exc:
            replies[endpoint] = {"error": str(exc)}
            code = EXIT_UNREACHABLE
            continue
        replies[endpoint] = answer = _answer(reply)
        if "error" in answer:
            code = EXIT_UNREACHABLE
    if args.json:
        json.dump(replies, sys.stdout, indent=2, sort_keys=True, default=str)
        print()
    else:
        for endpoint, reply in replies.items():
            print("\n".join(render(endpoint, reply)))
    return code


def render(endpoint: str, reply: Mapping[str, Any]) -> list[str]:
    """A status reply as indented ``key: value`` lines, nested maps as sections."""
    lines = [f"== {reply.get('process', '?')} at {endpoint}"]
    if "error" in reply:
        return [*lines, f"  unreachable: {reply['error']}"]
    _walk(reply.get("status") or {}, 1, lines)
    return lines


def _walk(value: Mapping[str, Any], depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for key, item in value.items():
        if isinstance(item, Mapping) and item:
            lines.append(f"{pad}{key}:")
            _walk(item, depth + 1, lines)
        elif isinstance(item, list) and item and all(isinstance(x, Mapping) for x in item):
            lines.append(f"{pad}{key}:")
            for entry in item[-10:]:
                lines.append(
                    f"{pad}  - " + ", ".join(f"{k}={show(k, v)}" for k, v in entry.items())
                )
        else:
            lines.append(f"{pad}{key}: {show(key, item)}")


def show(key: str, value: object) -> str:
    """A status value as a person reads it: times in UTC, yes/no, '-' for nothing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and str(key).endswith(TIME_KEY_SUFFIX):
        moment = datetime.fromtimestamp(float(value), tz=timezone.utc)
        return moment.isoformat(timespec="seconds").replace("+00:00", "Z")
    if isinstance(value, list):
        return ", ".join(show("", v) for v in value) or "-"
    return str(value)
