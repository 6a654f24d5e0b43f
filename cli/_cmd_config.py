"""``ggufswap check-config FILE``: validate a configuration and summarize what it sets up."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ggufswap._preflight import bind_dir_problems
from ggufswap.config import (
    Config,
    ConfigError,
    RuntimeConfig,
    ServeMode,
    config_to_dict,
    format_size,
    format_threads,
    load_config,
)

EXIT_OK = 0
EXIT_INVALID = 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check-config",
        help="validate a configuration file",
        description=(
            "Validate a YAML configuration (including that the watched directories, the model "
            "file and the key files exist) and print what it configures, or every problem as "
            "FILE:LINE: key: message. Exit status 0 when valid, 1 otherwise."
        ),
    )
    parser.add_argument("file", metavar="FILE", help="the YAML configuration file")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file, check_paths=True)
    except ConfigError as exc:
        if args.json:
            problems = [
                {"file": p.file, "line": p.line, "key": p.key_path, "message": p.message}
                for p in exc.problems
            ]
            _print_json({"ok": False, "problems": problems})
        else:
            print(str(exc), file=sys.stderr)
            count = len(exc.problems)
            print(f"{count} problem{'s' if count != 1 else ''} found", file=sys.stderr)
        return EXIT_INVALID
    unusable = bind_dir_problems(config)
    if unusable:
        if args.json:
            problems = [
                {"file": str(config.source), "line": None, "key": "", "message": m}
                for m in unusable
            ]
            _print_json({"ok": False, "problems": problems})
        else:
            print("\n".join(unusable), file=sys.stderr)
            count = len(unusable)
            print(f"{count} problem{'s' if count != 1 else ''} found", file=sys.stderr)
        return EXIT_INVALID
    if args.json:
        _print_json({"ok": True, "config": config_to_dict(config)})
    else:
        print("\n".join(summary_lines(config)))
    return EXIT_OK


def _print_json(data: dict[str, Any]) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def summary_lines(config: Config) -> list[str]:
    """A few lines a person reads to confirm the file means what they meant."""
    lines = [f"{config.source}: OK"]
    if config.models:
        agent = config.agent
        lines.append(
            f"agent: status {agent.status_endpoint}, rescan every {agent.rescan_interval_s:g} s, "
            f"log level {agent.log_level.value}"
            + (f", metrics on port {agent.metrics_port}" if agent.metrics_port else "")
        )
    for model in config.models:
        tensors = model.tensors
        scope = (
            "all tensors"
            if not tensors.include and not tensors.exclude
            else f"{len(tensors.include)} include / {len(tensors.exclude)} exclude pattern(s)"
        )
        lines.append(
            f"model {model.name} -> {model.runtime} (verify {model.verify.value}, "
            f"settle {model.settle_ms} ms, {scope})"
        )
        for watch in model.watch:
            depth = "recursive" if watch.recursive else "not recursive"
            lines.append(
                f"  watch {watch.path} {watch.glob} (backend {watch.backend.value}, {depth})"
            )
    runtime = config.runtime
    if runtime is not None:
        lines.append(
            f"runtime {runtime.name}: {runtime.model} "
            f"(storage {runtime.storage.value}, {runtime.compute_dtype.value}, "
            f"threads {format_threads(runtime.threads)})"
        )
        lines.append(f"  control {runtime.control_endpoint}")
        lines.append(f"  status  {runtime.status_endpoint}")
        lines.append(f"  events  {runtime.events_endpoint}")
        lines.append(f"  allowed roots: {', '.join(str(r) for r in runtime.allowed_roots)}")
        for pool in runtime.pools:
            budget = "unlimited" if pool.budget is None else format_size(pool.budget)
            lines.append(f"  pool {pool.name} on {pool.device}, budget {budget}")
        lines.append(f"  placement: {placement_summary(runtime)}")
        serve = runtime.serve
        if serve.mode is ServeMode.HTTP:
            lines.append(
                f"  serve http on {serve.host}:{serve.port} (max batch {serve.max_batch}, "
                f"queue {serve.max_queue}, timeout {serve.request_timeout_s:g} s)"
            )
        else:
            lines.append(f"  serve {serve.mode.value} (a batch every {serve.batch_interval_s:g} s)")
    security = config.security
    if security.curve is not None:
        lines.append("security: CURVE keys configured")
    elif security.allow_insecure_tcp:
        lines.append("security: WARNING allow_insecure_tcp is on (plaintext tcp:// allowed)")
    return lines


def placement_summary(runtime: RuntimeConfig) -> str:
    """One line saying where tensors start, in llama.cpp's words where they are used."""
    placement = runtime.placement
    if not placement.llama_layers:
        parts = [f"every tensor on {runtime.pools[0].name} first"]
    else:
        layers = placement.gpu_layers if placement.gpu_layers is not None else "all"
        parts = [f"gpu layers {layers} (llama.cpp's -ngl)"]
        rules = placement.rules()
        if rules:
            parts.append("overrides " + ", ".join(str(r) for r in rules))
        if placement.tensor_split:
            parts.append("tensor split " + ",".join(f"{x:g}" for x in placement.tensor_split))
    if placement.experts_pool:
        parts.append(f"experts in {placement.experts_pool}")
    if placement.split_experts:
        parts.append("MoE families split across pools when they fit no single pool")
    return "; ".join(parts)
