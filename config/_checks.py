"""Checks that span several keys: unique names, pool references, endpoints and their security."""

from __future__ import annotations

import difflib
import itertools
import os
from pathlib import Path

from ggufswap.config._nodes import NodeReader, item_path
from ggufswap.config.endpoints import (
    Transport,
    default_runtime_dir,
    socket_dir_problem,
    transport_of,
)
from ggufswap.config.schema import (
    CPU_BUFFER,
    ComputeDtype,
    Config,
    Keys,
    Numerics,
    RuntimeConfig,
    ServeMode,
    Storage,
)

_SERVER_KEYS = ("server_secret_key", "authorized_keys_dir")
_CLIENT_KEYS = ("client_secret_key", "server_public_key")


def cross_check(config: Config, reader: NodeReader) -> None:
    """Record every cross-key problem of an otherwise parsed configuration."""
    _unique_names(reader, Keys.MODELS, [m.name for m in config.models], "model name")
    # Defaulted runtime endpoints derive from the names, whose duplicates are reported above.
    explicit = [
        (f"{item_path(Keys.MODELS, i)}.runtime", m.runtime) for i, m in enumerate(config.models)
    ]
    _unique_values(reader, [(k, e) for k, e in explicit if k in reader.lines], "runtime endpoint")
    if config.runtime is not None:
        _check_runtime(config.runtime, reader)
    _check_bind_endpoints(config, reader)
    _check_tcp_security(config, reader)
    _check_socket_dirs(config, reader)
    ports = [("agent.metrics_port", config.agent.metrics_port)]
    if config.runtime is not None:
        ports.append(("runtime.metrics_port", config.runtime.metrics_port))
    given: list[tuple[str, object]] = [(k, v) for k, v in ports if v is not None]
    _unique_values(reader, given, "metrics port")
    if config.runtime is not None:
        serve = config.runtime.serve
        clashes = [k for k, v in given if serve.mode is ServeMode.HTTP and v == serve.port]
        for key_path in clashes:
            reader.report_at("runtime.serve.port", f"port {serve.port} is also used by {key_path}")


def _unique_names(reader: NodeReader, list_path: str, names: list[str], what: str) -> None:
    """Report each repeated ``name`` of the entries of a list, at its own line."""
    keyed = [(f"{item_path(list_path, i)}.name", name) for i, name in enumerate(names)]
    _unique_values(reader, [(k, v) for k, v in keyed if v], what)


def _unique_values(reader: NodeReader, keyed: list[tuple[str, object]], what: str) -> None:
    first: dict[object, str] = {}
    for key_path, value in keyed:
        if value in first:
            other = first[value]
            line = reader.lines.get(other)
            at = f"{other} at line {line}" if line is not None else other
            reader.report_at(key_path, f"duplicate {what} {value!r} (also used by {at})")
        else:
            first[value] = key_path


def numerics_problems(runtime: RuntimeConfig) -> list[tuple[str, str]]:
    """``(key, problem)`` for each setting ``runtime.numerics`` cannot run with: ggml's numerics
    round by each weight's GGUF blocks (native storage) and compute in float32."""
    if runtime.numerics is not Numerics.GGML:
        return []
    problems = []
    if runtime.storage is Storage.DEQUANTIZED:
        problems.append(
            ("storage", "numerics ggml reads the weights' GGUF blocks: it needs storage native "
             "(or auto), found dequantized; set runtime.storage: native, or numerics auto")
        )  # fmt: skip
    if runtime.compute_dtype is not ComputeDtype.FLOAT32:
        problems.append(
            ("compute_dtype", "numerics ggml computes in float32, found "
             f"{runtime.compute_dtype.value}; set runtime.compute_dtype: float32")
        )  # fmt: skip
    return problems


def _check_runtime(runtime: RuntimeConfig, reader: NodeReader) -> None:
    for key, problem in numerics_problems(runtime):
        reader.report_at(f"runtime.{key}", problem)
    _unique_names(reader, "runtime.pools", [p.name for p in runtime.pools], "pool name")
    pool_names = [p.name for p in runtime.pools]
    wanted = runtime.placement.experts_pool
    # A reference into a broken pool list would only repeat the pool's own problem.
    if (
        wanted is not None
        and wanted not in pool_names
        and not reader.has_problem_under("runtime.pools")
    ):
        close = difflib.get_close_matches(wanted, pool_names, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        reader.report_at(
            "runtime.placement.experts_pool",
            f"no pool named {wanted!r}; pools: {', '.join(pool_names)}{hint}",
        )
    if not reader.has_problem_under("runtime.pools"):
        _check_override_targets(runtime, reader)
    if not reader.has_problem_under("runtime.model") and not any(
        _is_within(runtime.model, root) for root in runtime.allowed_roots
    ):
        roots = ", ".join(str(r) for r in runtime.allowed_roots)
        reader.report_at(
            "runtime.model",
            f"{str(runtime.model)!r} is outside allowed_roots ({roots}); "
            "add its directory to runtime.allowed_roots",
        )


def override_targets(runtime: RuntimeConfig) -> list[str]:
    """What an override rule may name: a pool, ``CPU`` (the fallback pool) or ``CUDA<i>``: the
    pool on ``cuda:<i>``, or where no pool is on CUDA, the i-th pool before the fallback."""
    cuda = [p.device for p in runtime.pools if p.device.startswith("cuda")]
    buffers = sorted({f"CUDA{d.partition(':')[2] or '0'}" for d in cuda})
    if not cuda:
        buffers = [f"CUDA{i}" for i in range(_gpu_pools(runtime))]
    return [p.name for p in runtime.pools] + [CPU_BUFFER] + buffers


def _gpu_pools(runtime: RuntimeConfig) -> int:
    """How many pools come before the fallback (the last CPU pool; one is added when none is
    declared)."""
    return len(runtime.pools) - any(p.device.partition(":")[0] == "cpu" for p in runtime.pools)


def _check_override_targets(runtime: RuntimeConfig, reader: NodeReader) -> None:
    targets = override_targets(runtime)
    rules_path = "runtime.placement.override_tensor"
    # the rules that parsed, with the index of their YAML item (a bad item is left out of them)
    paths = (item_path(rules_path, i) for i in itertools.count())
    listed = itertools.takewhile(lambda path: path in reader.lines, paths)
    valid = [path for path in listed if not reader.has_problem_under(path)]
    for path, rule in zip(valid, runtime.placement.override_tensor, strict=False):
        if rule.target not in targets:
            close = difflib.get_close_matches(rule.target, targets, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            reader.report_at(
                path, f"{rule.target!r} names no pool; targets: {', '.join(targets)}{hint}"
            )
    ratio = len(runtime.placement.tensor_split)
    devices = _gpu_pools(runtime)
    if ratio > max(devices, 1):
        reader.report_at(
            "runtime.placement.tensor_split",
            f"{ratio} proportions for {devices} GPU pool(s) (the pools before the fallback)",
        )


def _is_within(path: Path, root: Path) -> bool:
    try:
        return os.path.commonpath([path, root]) == str(root)
    except ValueError:
        return False


def _bind_endpoints(config: Config) -> list[tuple[str, str]]:
    """``(key path, endpoint)`` of every socket bound by a process this file configures."""
    out = [("agent.status_endpoint", config.agent.status_endpoint)] if config.models else []
    if config.runtime is not None:
        out += [
            ("runtime.control_endpoint", config.runtime.control_endpoint),
            ("runtime.status_endpoint", config.runtime.status_endpoint),
            ("runtime.events_endpoint", config.runtime.events_endpoint),
        ]
    return [(k, e) for k, e in out if e]


def _check_bind_endpoints(config: Config, reader: NodeReader) -> None:
    _unique_values(reader, list(_bind_endpoints(config)), "endpoint")


def _check_tcp_security(config: Config, reader: NodeReader) -> None:
    """A ``tcp://`` endpoint needs CURVE keys unless ``allow_insecure_tcp`` says otherwise."""
    if config.security.allow_insecure_tcp:
        return
    curve = config.security.curve
    servers = [(k, e) for k, e in _bind_endpoints(config) if transport_of(e) is Transport.TCP]
    clients = [
        (f"{item_path(Keys.MODELS, i)}.runtime", m.runtime)
        for i, m in enumerate(config.models)
        if m.runtime and transport_of(m.runtime) is Transport.TCP
    ]
    for endpoints, needed in ((servers, _SERVER_KEYS), (clients, _CLIENT_KEYS)):
        missing = [k for k in needed if curve is None or getattr(curve, k) is None]
        if not missing:
            continue
        keys = " and ".join(f"security.curve.{k}" for k in missing)
        for key_path, endpoint in endpoints:
            if key_path not in reader.lines:
                continue  # derived from the control endpoint, which is reported itself
            reader.report_at(
                key_path,
                f"{endpoint} is tcp:// without CURVE keys: set {keys} "
                "(or security.allow_insecure_tcp: true to accept plaintext, "
                "unauthenticated connections)",
            )


def _check_socket_dirs(config: Config, reader: NodeReader) -> None:
    """The directory of every ``ipc://`` socket, bound or connected to, passes the StrictModes
    check (``socket_dir_problem``): reported at the key, or at the endpoint it derives from."""
    clients = [
        (f"{item_path(Keys.MODELS, i)}.runtime", m.runtime)
        for i, m in enumerate(config.models)
        if m.runtime
    ]
    default_dir = os.path.realpath(default_runtime_dir())
    seen: set[tuple[Path, bool]] = set()
    for key_path, endpoint, bound in [
        *((k, e, True) for k, e in _bind_endpoints(config)),
        *((k, e, False) for k, e in clients),
    ]:
        if transport_of(endpoint) is not Transport.IPC or endpoint.startswith("ipc://@"):
            continue
        parent = Path(os.path.dirname(endpoint.removeprefix("ipc://")))
        owner_checked = bound or os.path.realpath(parent) == default_dir
        if (parent, owner_checked) in seen:
            continue  # one report per directory
        seen.add((parent, owner_checked))
        problem = socket_dir_problem(parent, owner_checked=owner_checked)
        if problem is not None:
            reader.report_at(key_path, f"{endpoint}: {problem}")
