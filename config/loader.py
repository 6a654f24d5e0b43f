"""Load a YAML configuration file into ``Config``, reporting every problem with its line."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

from yaml.nodes import Node

from ggufswap.config._checks import cross_check
from ggufswap.config._convert import NAME_PATTERN, PathKind, Values, optional
from ggufswap.config._nodes import NodeReader, Section
from ggufswap.config.endpoints import (
    Transport,
    check_endpoint,
    default_runtime_dir,
    ipc_endpoint,
    sibling_endpoint,
    transport_of,
)
from ggufswap.config.errors import ConfigError, ConfigProblem, Invalid
from ggufswap.config.fstypes import pseudo_fs
from ggufswap.config.schema import (
    DEFAULT_DECODED_CACHE,
    DEFAULT_IGNORE,
    AgentConfig,
    ComputeDtype,
    Config,
    CurveConfig,
    Keys,
    LogLevel,
    MapShards,
    ModelConfig,
    Numerics,
    PlacementConfig,
    PoolConfig,
    RuntimeConfig,
    SecurityConfig,
    ServeConfig,
    ServeMode,
    Storage,
    TensorFilter,
    VerifyMode,
    WatchBackend,
    WatchConfig,
)

SCHEMA_VERSION = 1
TOP_KEYS = ("version", Keys.AGENT, Keys.MODELS, Keys.RUNTIME, Keys.SECURITY)
AGENT_KEYS = ("status_endpoint", "rescan_interval_s", "metrics_port", "log_level")
MODEL_KEYS = (
    "name",
    "runtime",
    "replicas",
    "watch",
    "ignore",
    "settle_ms",
    "tensors",
    "verify",
    "request_timeout_s",
    "retries",
    "scrub_rate",
)
WATCH_KEYS = ("path", "glob", "recursive", "backend", "poll_interval_s")
TENSOR_KEYS = ("include", "exclude")
RUNTIME_KEYS = (
    "name",
    "model",
    "control_endpoint",
    "status_endpoint",
    "events_endpoint",
    "allowed_roots",
    "storage",
    "compute_dtype",
    "strict_types",
    "pools",
    "placement",
    "metrics_port",
    "log_level",
    "threads",
    "decoded_cache",
    "map_shards",
    "numerics",
    "serve",
)
SERVE_KEYS = (
    "mode",
    "host",
    "port",
    "max_batch",
    "max_queue",
    "request_timeout_s",
    "batch_interval_s",
)
POOL_KEYS = ("name", "device", "budget")
PLACEMENT_KEYS = (
    "gpu_layers",
    "override_tensor",
    "cpu_moe",
    "n_cpu_moe",
    "tensor_split",
    "fit_margin",
    "experts_pool",
    "split_experts",
)
SECURITY_KEYS = ("curve", "allow_insecure_tcp")
CURVE_KEYS = ("server_secret_key", "server_public_key", "client_secret_key", "authorized_keys_dir")

DEFAULT_RUNTIME_NAME = "runtime"  # a runtime-only text without a file, or an unusable file name
YAML_SUFFIXES = (".yaml", ".yml")
DEFAULT_POOLS = (PoolConfig(name="host", device="cpu", budget=None),)
LOCALHOST = "127.0.0.1"
# A configuration file is a few KiB; a larger one is refused before it is read.
MAX_CONFIG_BYTES = 1 << 20
_NO_PATH = Path()


def load_config(
    path: str | os.PathLike[str],
    *,
    check_paths: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Read and validate the YAML file at ``path``.

    Raises ``ConfigError`` listing every problem. With ``check_paths`` the watched directories,
    the model file, the allowed roots and the CURVE key files must also exist. ``environ``
    (default ``os.environ``) chooses the default runtime directory of ``ipc://`` sockets.
    """
    file = Path(os.path.abspath(path))
    try:
        data = _read_bounded(file)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError([ConfigProblem(str(file), None, "", f"cannot read: {reason}")]) from None
    except ValueError as exc:
        raise ConfigError([ConfigProblem(str(file), None, "", str(exc))]) from None
    return load_config_text(
        data, source=file, base_dir=file.parent, check_paths=check_paths, environ=environ
    )


def _read_bounded(file: Path) -> bytes:
    """The bytes of ``file``, which must be a regular file of at most MAX_CONFIG_BYTES (checked
    on the open descriptor before reading: a FIFO, a device or /dev/zero is refused, never read);
    ValueError says why not."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(
                f"not a regular file (mode {stat.filemode(st.st_mode)}); "
                "a configuration is a YAML file"
            )
        if st.st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{st.st_size} bytes; a configuration is at most {MAX_CONFIG_BYTES}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:  # grew while being read
            raise ValueError(f"over {MAX_CONFIG_BYTES} bytes; a configuration is at most that")
        return data
    finally:
        os.close(fd)


def load_config_text(
    text: str | bytes,
    *,
    source: str | os.PathLike[str] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    check_paths: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Validate YAML ``text``; ``source`` names it in messages, relative paths use ``base_dir``.

    ``base_dir`` defaults to the directory of ``source``, else the current directory.
    """
    file = "<config>" if source is None else os.fspath(source)
    if base_dir is None:
        base_dir = os.path.dirname(os.path.abspath(file)) if source is not None else os.getcwd()
    reader = NodeReader(file=file)
    values = Values(reader, base_dir=Path(os.path.abspath(base_dir)), check_paths=check_paths)
    builder = _Builder(
        reader,
        values,
        runtime_dir=default_runtime_dir(environ=environ),
        file_stem=_file_stem(source),
    )
    root = reader.compose(text)
    config = None
    if root is not None or not reader.problems:  # a syntax error leaves nothing to check
        config = builder.build(root, Path(file) if source is not None else None)
    if reader.problems or config is None:
        problems = sorted(reader.problems, key=lambda p: p.line or 0)
        raise ConfigError(problems or [ConfigProblem(file, None, "", "invalid configuration")])
    return config


class _Builder:
    """Turns the node tree into records, section by section."""

    def __init__(
        self, reader: NodeReader, values: Values, *, runtime_dir: Path, file_stem: str | None
    ):
        self.r = reader
        self.v = values
        self.runtime_dir = runtime_dir
        self.file_stem = file_stem

    def build(self, root: Node | None, source: Path | None) -> Config | None:
        if root is None:
            self.r.report(None, "", self._nothing_configured())
            return None
        try:
            top = self.r.section(root, "", keys=TOP_KEYS)
        except Invalid as exc:
            self.r.report(root, "", f"the top level must be a mapping: {exc.message}")
            return None
        version = self.r.get(top, "version", self.v.integer(), SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            self.r.report_at("version", f"expected version {SCHEMA_VERSION}, found {version}")
        agent = self.agent(self._section(top, Keys.AGENT, AGENT_KEYS))
        no_models: tuple[ModelConfig, ...] = ()
        models = self.r.get(top, Keys.MODELS, self.v.list_of(self.model, min_items=1), no_models)
        runtime = None
        if Keys.RUNTIME in top.values and not self.r.is_null(top.values[Keys.RUNTIME]):
            runtime = self.r.convert(
                top.values[Keys.RUNTIME], Keys.RUNTIME, self._runtime_of(models), None
            )
        elif Keys.MODELS not in top.values:
            self.r.report(root, "", self._nothing_configured())
        security = self.security(self._section(top, Keys.SECURITY, SECURITY_KEYS))
        models = self._default_model_endpoints(models, runtime)
        config = Config(
            source=source, agent=agent, models=models, runtime=runtime, security=security
        )
        cross_check(config, self.r)
        return config

    @staticmethod
    def _nothing_configured() -> str:
        return (
            f"nothing to configure: expected a '{Keys.MODELS}' list (for the agent) "
            f"and/or a '{Keys.RUNTIME}' section"
        )

    def _section(self, parent: Section, key: str, keys: tuple[str, ...]) -> Section | None:
        """The sub-mapping ``key`` of ``parent`` (empty when absent); ``None`` if malformed."""
        path = parent.child(key)
        try:
            return self.r.section(parent.values.get(key), path, keys=keys, parent=parent.node)
        except Invalid as exc:
            self.r.report(parent.values[key], path, exc.message)
            return None

    # --- agent -----------------------------------------------------------------------------

    def agent(self, sec: Section | None) -> AgentConfig:
        default_status = ipc_endpoint(self.runtime_dir / "agent.sock")
        if sec is None:
            return AgentConfig(status_endpoint=default_status)
        return AgentConfig(
            status_endpoint=self.r.get(sec, "status_endpoint", self.v.endpoint, default_status),
            rescan_interval_s=self.r.get(sec, "rescan_interval_s", self.v.seconds, 300.0),
            metrics_port=self.r.get(sec, "metrics_port", optional(self.v.port), None),
            log_level=self.r.get(sec, "log_level", self.v.choice(LogLevel), LogLevel.INFO),
        )

    def model(self, node: Node, path: str) -> ModelConfig:
        sec = self.r.section(node, path, keys=MODEL_KEYS, required=("name", "watch"))
        name = self.r.get(sec, "name", self.v.name, "")
        watch_list = self.v.list_of(self.watch, min_items=1)
        tensors = self._section(sec, "tensors", TENSOR_KEYS)
        regexes = self.v.list_of(self.v.regex)
        return ModelConfig(
            name=name,
            runtime=self.r.get(sec, "runtime", self.v.connect_endpoint, ""),  # "" until defaulted
            replicas=self.r.get(sec, "replicas", self.v.list_of(self.v.connect_endpoint), ()),
            watch=self.r.get(sec, "watch", watch_list, ()),
            ignore=self.r.get(sec, "ignore", self.v.list_of(self.v.glob), DEFAULT_IGNORE),
            settle_ms=self.r.get(sec, "settle_ms", self.v.integer(minimum=0), 250),
            tensors=TensorFilter(
                include=self.r.get(tensors, "include", regexes, ()) if tensors else (),
                exclude=self.r.get(tensors, "exclude", regexes, ()) if tensors else (),
            ),
            verify=self.r.get(sec, "verify", self.v.choice(VerifyMode), VerifyMode.CHECKSUM),
            request_timeout_s=self.r.get(sec, "request_timeout_s", self.v.seconds, 5.0),
            retries=self.r.get(sec, "retries", self.v.integer(minimum=0), 3),
            scrub_bytes_per_s=self.r.get(sec, "scrub_rate", self.v.size_or_zero, 16 * 1000 * 1000),
        )

    def _watch_root(self, node: Node, key_path: str) -> Path:
        """A watched directory: not on one of the kernel's pseudo file systems, whose files are
        not model shards (``/proc`` holds a file per process; ``/dev/zero`` never ends), judged
        by the file system's type (``/dev/shm``, a tmpfs, is a directory like any other)."""
        path = self.v.path(kind=PathKind.DIRECTORY)(node, key_path)
        real = os.path.realpath(path)
        kind = pseudo_fs(real)
        if kind is not None:
            raise Invalid(
                f"{str(path)!r} is on {kind}, a pseudo file system of the kernel; "
                "watch the directory that holds the model's GGUF files"
            )
        return path

    def watch(self, node: Node, path: str) -> WatchConfig:
        sec = self.r.section(node, path, keys=WATCH_KEYS, required=("path",))
        return WatchConfig(
            path=self.r.get(sec, "path", self._watch_root, _NO_PATH),
            glob=self.r.get(sec, "glob", self.v.glob, "*.gguf"),
            recursive=self.r.get(sec, "recursive", self.v.boolean, False),
            backend=self.r.get(sec, "backend", self.v.choice(WatchBackend), WatchBackend.AUTO),
            poll_interval_s=self.r.get(sec, "poll_interval_s", self.v.seconds, 1.0),
        )

    def _default_model_endpoints(
        self, models: tuple[ModelConfig, ...], runtime: RuntimeConfig | None
    ) -> tuple[ModelConfig, ...]:
        """Fill ``models[].runtime``: the runtime section's endpoint when it serves the only
        model, else ``ipc://<runtime dir>/<name>.sock``."""
        out = []
        for model in models:
            if model.runtime:
                out.append(model)
                continue
            if runtime is not None and len(models) == 1:
                endpoint = _connectable(runtime.control_endpoint)
            else:
                endpoint = ipc_endpoint(self.runtime_dir / f"{model.name}.sock")
            out.append(dataclasses.replace(model, runtime=endpoint))
        return tuple(out)

    # --- runtime ---------------------------------------------------------------------------

    def _runtime_of(
        self, models: tuple[ModelConfig, ...]
    ) -> Callable[[Node, str], RuntimeConfig | None]:
        return lambda node, path: self.runtime(node, path, models)

    def runtime(self, node: Node, path: str, models: tuple[ModelConfig, ...]) -> RuntimeConfig:
        sec = self.r.section(node, path, keys=RUNTIME_KEYS, required=("model",))
        # A runtime serving the file's only model takes its name; a runtime-only file (systemd's
        # /etc/ggufswap/%i.yaml) is named after the file, so that instance i binds i.sock, the
        # socket an agent's `models: [{name: i}]` dials by default.
        default_name = models[0].name if len(models) == 1 and models[0].name else None
        if default_name is None and not models:
            default_name = self.file_stem
        name = self.r.get(sec, "name", self.v.name, default_name or DEFAULT_RUNTIME_NAME)
        model = self.r.get(sec, "model", self.v.path(kind=PathKind.FILE), _NO_PATH)
        default_control = ipc_endpoint(self.runtime_dir / f"{name}.sock")
        control = self.r.get(sec, "control_endpoint", self.v.endpoint, default_control)
        status = self._sibling(sec, "status_endpoint", control, role="status", port_offset=1)
        events = self._sibling(sec, "events_endpoint", control, role="events", port_offset=2)
        roots = self.v.list_of(self.v.path(kind=PathKind.DIRECTORY), min_items=1)
        pools = self.v.list_of(self.pool, min_items=1)
        placement = self._section(sec, "placement", PLACEMENT_KEYS)
        serve = self._section(sec, "serve", SERVE_KEYS)
        return RuntimeConfig(
            name=name,
            model=model,
            control_endpoint=control,
            status_endpoint=status,
            events_endpoint=events,
            allowed_roots=self.r.get(sec, "allowed_roots", roots, (model.parent,)),
            pools=self.r.get(sec, "pools", pools, DEFAULT_POOLS),
            storage=self.r.get(sec, "storage", self.v.choice(Storage), Storage.AUTO),
            compute_dtype=self.r.get(
                sec, "compute_dtype", self.v.choice(ComputeDtype), ComputeDtype.FLOAT32
            ),
            strict_types=self.r.get(sec, "strict_types", self.v.boolean, False),
            placement=self.placement(placement),
            metrics_port=self.r.get(sec, "metrics_port", optional(self.v.port), None),
            log_level=self.r.get(sec, "log_level", self.v.choice(LogLevel), LogLevel.INFO),
            threads=self.r.get(sec, "threads", optional(self.v.threads), None),
            decoded_cache=self.r.get(
                sec, "decoded_cache", self.v.size_or_zero, DEFAULT_DECODED_CACHE
            ),
            map_shards=self.r.get(sec, "map_shards", self.v.map_shards, MapShards.AUTO),
            numerics=self.r.get(sec, "numerics", self.v.choice(Numerics), Numerics.AUTO),
            serve=self.serve(serve),
        )

    def serve(self, sec: Section | None) -> ServeConfig:
        if sec is None:
            return ServeConfig()
        d = ServeConfig()
        return ServeConfig(
            mode=self.r.get(sec, "mode", self.v.choice(ServeMode), d.mode),
            host=self.r.get(sec, "host", self.v.string, d.host),
            port=self.r.get(sec, "port", self.v.integer(minimum=0, maximum=65535), d.port),
            max_batch=self.r.get(sec, "max_batch", self.v.integer(minimum=1), d.max_batch),
            max_queue=self.r.get(sec, "max_queue", self.v.integer(minimum=1), d.max_queue),
            request_timeout_s=self.r.get(
                sec, "request_timeout_s", self.v.seconds, d.request_timeout_s
            ),
            batch_interval_s=self.r.get(
                sec, "batch_interval_s", self.v.seconds_or_zero, d.batch_interval_s
            ),
        )

    def _sibling(self, sec: Section, key: str, control: str, *, role: str, port_offset: int) -> str:
        """An explicit endpoint, or one derived from the control endpoint."""
        explicit = self.r.get(sec, key, self.v.endpoint, "")
        if explicit or not control:
            return explicit
        derived = sibling_endpoint(control, role=role, port_offset=port_offset)
        endpoint, why = check_endpoint(derived, base_dir=self.v.base_dir)
        if endpoint is None:
            self.r.report_at(
                sec.child("control_endpoint"),
                f"cannot derive {key} ({why}); set {sec.child(key)} explicitly",
                fallback=sec.node,
            )
            return ""
        return endpoint

    def pool(self, node: Node, path: str) -> PoolConfig:
        sec = self.r.section(node, path, keys=POOL_KEYS, required=("name", "device"))
        return PoolConfig(
            name=self.r.get(sec, "name", self.v.name, ""),
            device=self.r.get(sec, "device", self.v.device, ""),
            budget=self.r.get(sec, "budget", optional(self.v.size), None),
        )

    def placement(self, sec: Section | None) -> PlacementConfig:
        if sec is None:
            return PlacementConfig()
        d = PlacementConfig()
        return PlacementConfig(
            gpu_layers=self.r.get(sec, "gpu_layers", self.v.gpu_layers, d.gpu_layers),
            override_tensor=self.r.get(
                sec, "override_tensor", self.v.list_of(self.v.override_rule), ()
            ),
            cpu_moe=self.r.get(sec, "cpu_moe", self.v.boolean, False),
            n_cpu_moe=self.r.get(sec, "n_cpu_moe", self.v.integer(minimum=0), 0),
            tensor_split=self.r.get(sec, "tensor_split", self.v.tensor_split, ()),
            fit_margin=self.r.get(sec, "fit_margin", self.v.size_or_zero, d.fit_margin),
            experts_pool=self.r.get(sec, "experts_pool", optional(self.v.name), None),
            split_experts=self.r.get(sec, "split_experts", self.v.boolean, False),
        )

    # --- security --------------------------------------------------------------------------

    def security(self, sec: Section | None) -> SecurityConfig:
        if sec is None:
            return SecurityConfig()
        curve = None
        if "curve" in sec.values and not self.r.is_null(sec.values["curve"]):
            curve_sec = self._section(sec, "curve", CURVE_KEYS)
            if curve_sec is not None:
                key_file = optional(self.v.path(kind=PathKind.FILE))
                curve = CurveConfig(
                    server_secret_key=self.r.get(curve_sec, "server_secret_key", key_file, None),
                    server_public_key=self.r.get(curve_sec, "server_public_key", key_file, None),
                    client_secret_key=self.r.get(curve_sec, "client_secret_key", key_file, None),
                    authorized_keys_dir=self.r.get(
                        curve_sec,
                        "authorized_keys_dir",
                        optional(self.v.path(kind=PathKind.DIRECTORY)),
                        None,
                    ),
                )
        return SecurityConfig(
            curve=curve,
            allow_insecure_tcp=self.r.get(sec, "allow_insecure_tcp", self.v.boolean, False),
        )


def _file_stem(source: str | os.PathLike[str] | None) -> str | None:
    """The configuration file's name without ``.yaml``/``.yml``, when it is a valid name."""
    if source is None:
        return None
    name = Path(source).name
    for suffix in YAML_SUFFIXES:
        if name.endswith(suffix):
            name = name.removesuffix(suffix)
            break
    return name if NAME_PATTERN.fullmatch(name) else None


def _connectable(endpoint: str) -> str:
    """An endpoint a client can connect to: a ``tcp://*`` bind address becomes localhost."""
    if endpoint and transport_of(endpoint) is Transport.TCP and endpoint.startswith("tcp://*:"):
        return f"tcp://{LOCALHOST}:" + endpoint.removeprefix("tcp://*:")
    return endpoint
