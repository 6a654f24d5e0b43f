"""``ggufswap agent --config FILE`` (the sidecar) and ``ggufswap plan --config FILE`` (prints the
plan the agent would send; never sends it)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from ggufswap.config import Config, ConfigError, ModelConfig, load_config

if TYPE_CHECKING:
    from ggufswap.ipc import RuntimeState

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2


def register(subparsers: Any) -> None:
    agent = subparsers.add_parser(
        "agent",
        help="watch shard directories and keep runtimes in sync (the sidecar daemon)",
        description=(
            "Watch the models' shard directories, validate changed shards and send each runtime "
            "the plan that takes it from what it has loaded to what is on disk. SIGTERM/SIGINT "
            "stop it cleanly, SIGHUP reloads the config (an invalid one is logged and ignored)."
        ),
    )
    agent.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    agent.set_defaults(func=run_agent)

    plan = subparsers.add_parser(
        "plan",
        help="print the plan the agent would send now",
        description=(
            "Scan the watched directories and print, per model, the plan that would be sent now. "
            "The runtime's state is fetched when it answers; otherwise the plan is computed "
            "against an empty state (every desired tensor), and the output says which."
        ),
    )
    plan.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    plan.add_argument(
        "--dry-run",
        action="store_true",
        help="accepted for clarity; plan only ever prints (the agent is what sends plans)",
    )
    plan.add_argument("--model", metavar="NAME", help="only this model")
    plan.add_argument("--json", action="store_true", help="print a JSON object")
    plan.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="wait this long for a runtime"
    )
    plan.set_defaults(func=run_plan)


def _load(path: str) -> Config | None:
    try:
        config = load_config(path)
        config.require_models()
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return None
    return config


def run_agent(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return EXIT_CONFIG
    from ggufswap._preflight import socket_dir_problem

    why = socket_dir_problem(config.agent.status_endpoint)
    if why is not None:
        where = f"{config.source}: agent.status_endpoint: {config.agent.status_endpoint}"
        print(f"ggufswap agent: {where}: {why}", file=sys.stderr)
        return EXIT_CONFIG
    from ggufswap._signals import ProcessSignals
    from ggufswap.agent import AgentDaemon, AgentError
    from ggufswap.ipc import IpcError
    from ggufswap.ipc.sdnotify import Notifier

    signals = ProcessSignals().install()
    daemon = AgentDaemon(
        config,
        notifier=Notifier.from_env(unset_environment=True),
        stop=signals.stop,
        reload=signals.reload,
    )
    try:
        daemon.start()
    except (AgentError, IpcError, ImportError) as exc:
        print(f"ggufswap agent: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    daemon.run()
    if daemon.failure is not None:
        print(f"ggufswap agent: {daemon.failure}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def run_plan(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return EXIT_CONFIG
    models = [m for m in config.models if args.model in (None, m.name)]
    if not models:
        print(f"ggufswap plan: no model {args.model!r} in {args.config}", file=sys.stderr)
        return EXIT_CONFIG
    results = [_dry_run(model, config, timeout_s=args.timeout) for model in models]
    if args.json:
        json.dump({"models": results}, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        for result in results:
            print("\n".join(_lines(result)))
    return EXIT_OK


def _runtime_state(
    model: ModelConfig, config: Config, *, timeout_s: float | None
) -> tuple[RuntimeState | None, str]:
    """The state ``model``'s runtime reports, or None and why not."""
    from ggufswap.ipc import (
        ErrorReply,
        IpcError,
        MessageType,
        RuntimeState,
        SocketOptions,
        make_message,
        parse_reply,
        request,
    )

    try:
        reply = request(
            model.runtime,
            make_message(MessageType.STATE),
            timeout_s=timeout_s if timeout_s is not None else model.request_timeout_s,
            retries=0,
            options=SocketOptions.of(config.security),
        )
        match parse_reply(reply).body:
            case RuntimeState() as state:
                return state, ""
            case ErrorReply() as error:
                return None, f"runtime answered error {error.code.name}: {error.message}"
            case other:
                return None, f"runtime answered {type(other).__name__} to a state request"
    except IpcError as exc:
        return None, f"runtime unreachable ({exc})"


def _dry_run(model: ModelConfig, config: Config, *, timeout_s: float | None) -> dict[str, Any]:
    from ggufswap.agent import ModelIndex, reconcile
    from ggufswap.ipc import plan_to_wire
    from ggufswap.shards import Fingerprinter

    snapshot = ModelIndex(model).scan()
    actual, why_empty = _runtime_state(model, config, timeout_s=timeout_s)
    result = reconcile(
        snapshot.desired,
        actual.by_name() if actual is not None else {},
        model=model.name,
        base_version=actual.weight_version if actual is not None else 0,
        verify=model.verify,
        fingerprint=Fingerprinter(),
        plan_unloaded=actual is None,
    )
    return {
        "model": model.name,
        "runtime": model.runtime,
        "compared_with": "runtime" if actual is not None else "empty",
        "why_empty": why_empty or None,
        "weight_version": actual.weight_version if actual is not None else None,
        "shards": {
            "valid": sum(1 for s in snapshot.shards if s.health.value == "valid"),
            "invalid": [{"path": s.path, "reason": s.reason} for s in snapshot.invalid],
        },
        "problems": list(snapshot.problems),
        "held": sorted(snapshot.held),
        "plan": plan_to_wire(result.plan) if result.plan is not None else None,
        "why": dict(result.why),
        "blocked": [{"tensor": b.tensor, "reason": b.reason} for b in result.blocked],
        "not_loaded": len(result.not_loaded),
    }


def _lines(result: dict[str, Any]) -> list[str]:
    from ggufswap.shards.ggml_types import ggml_type

    lines = [f"model {result['model']} -> {result['runtime']}"]
    if result["compared_with"] == "runtime":
        lines.append(
            f"  compared with the runtime's state (weight_version {result['weight_version']})"
        )
    else:
        lines.append(
            f"  compared with an EMPTY state: {result['why_empty']}; every desired tensor is listed"
        )
    shards = result["shards"]
    lines.append(f"  shards: {shards['valid']} valid, {len(shards['invalid'])} invalid")
    lines.extend(f"    invalid {s['path']}: {s['reason']}" for s in shards["invalid"])
    lines.extend(f"  problem: {p}" for p in result["problems"])
    if result["held"]:
        lines.append(f"  held (not planned until their shards are valid): {len(result['held'])}")
    plan = result["plan"]
    if plan is None:
        lines.append("  nothing to send: the runtime has what is on disk")
    else:
        lines.append(f"  plan {plan['plan_id']}: {len(plan['jobs'])} job(s)")
        for job in plan["jobs"]:
            why = result["why"].get(job["name"], "")
            known = ggml_type(job["type"])
            type_name = known.name if known is not None else f"type {job['type']}"
            # The torch order, as `ggufswap inspect` prints it (ne reversed); JSON keeps ne.
            shape = "x".join(str(d) for d in reversed(job["ne"]))
            lines.append(
                f"    {job['name']}  {type_name} shape {shape}  {job['path']} "
                f"@ {job['offset']}  ({why})"
            )
    lines.extend(f"  blocked {b['tensor']}: {b['reason']}" for b in result["blocked"])
    if result["not_loaded"]:
        lines.append(f"  not loaded by the runtime (never planned): {result['not_loaded']}")
    return lines
