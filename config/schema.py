"""The configuration as typed, frozen records.

``docs/configuration.md`` documents every key. Records hold resolved values: absolute paths,
normalized endpoints, sizes in bytes, compiled regular expressions and the defaults already
filled in, so that callers never re-interpret the YAML.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ggufswap.config.errors import ConfigProblem, MissingSectionError


class WatchBackend(str, enum.Enum):
    """How the agent learns that files changed."""

    AUTO = "auto"  # watchdog (inotify), or polling where the file system has no inotify
    WATCHDOG = "watchdog"
    PYINOTIFY = "pyinotify"
    POLLING = "polling"


class VerifyMode(str, enum.Enum):
    """What identifies a shard version: its stat identity alone, or also a content checksum."""

    STAT = "stat"
    CHECKSUM = "checksum"


class Storage(str, enum.Enum):
    """How the runtime holds weights."""

    DEQUANTIZED = "dequantized"  # in compute_dtype; quant changes are in-place copies
    NATIVE = "native"  # raw GGUF blocks, dequantized per use
    # native for quantized tensors when their dequantized bytes would not fit the pools
    AUTO = "auto"


class MapShards(str, enum.Enum):
    """``runtime.map_shards``: whether native CPU tensors are served from their files' pages."""

    OFF = "false"  # every tensor is copied into memory of the runtime's own
    AUTO = "auto"  # mapped where a read lease can be taken, else copied (and the log says why)
    ON = "true"  # mapped, or the load fails naming the file that cannot be


class Numerics(str, enum.Enum):
    """``runtime.numerics``: how the served decoder computes (docs/configuration.md)."""

    AUTO = "auto"  # the store's fastest products (ggml's where a libggml runs), float32 norms
    EXACT = "exact"  # float products: decoded weights times float activations
    GGML = "ggml"  # ggml's CPU arithmetic end to end: llama.cpp's rounding (native storage)


# Native storage keeps up to this many bytes of decoded dense tensors by default.
DEFAULT_DECODED_CACHE = 1 << 30


class ComputeDtype(str, enum.Enum):
    """Torch dtype names accepted for ``runtime.compute_dtype``."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class LogLevel(str, enum.Enum):
    """Levels accepted for ``log_level``."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class Keys:
    """Top-level section names."""

    AGENT = "agent"
    MODELS = "models"
    RUNTIME = "runtime"
    SECURITY = "security"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """``agent:``: settings of the sidecar process itself."""

    status_endpoint: str
    rescan_interval_s: float = 300.0
    metrics_port: int | None = None
    log_level: LogLevel = LogLevel.INFO


@dataclass(frozen=True, slots=True)
class WatchConfig:
    """``models[].watch[]``: one directory the agent watches for shard files."""

    path: Path
    glob: str = "*.gguf"
    recursive: bool = False
    backend: WatchBackend = WatchBackend.AUTO
    poll_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class TensorFilter:
    """``models[].tensors``: which tensor names the agent may plan (``re.search`` semantics).

    An empty ``include`` admits every tensor; ``exclude`` wins over ``include``.
    """

    include: tuple[re.Pattern[str], ...] = ()
    exclude: tuple[re.Pattern[str], ...] = ()

    def admits(self, tensor_name: str) -> bool:
        """Whether updates of ``tensor_name`` may be planned."""
        if any(p.search(tensor_name) for p in self.exclude):
            return False
        return not self.include or any(p.search(tensor_name) for p in self.include)


DEFAULT_IGNORE = ("*.tmp", ".*", "*.incomplete")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """``models[]``: one served model the agent keeps in sync with its files."""

    name: str
    runtime: str  # the runtime's control endpoint
    watch: tuple[WatchConfig, ...]
    # More runtimes serving the same model (replicas, or other groups' rank 0): each gets its plans.
    replicas: tuple[str, ...] = ()
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    settle_ms: int = 250
    tensors: TensorFilter = field(default_factory=TensorFilter)
    verify: VerifyMode = VerifyMode.CHECKSUM
    request_timeout_s: float = 5.0
    retries: int = 3
    # verify: checksum only: re-hash loaded tensors in the background at this rate (bytes/s;
    # 0: off) to find changes that keep the file's identity (writes through a shared mapping).
    scrub_bytes_per_s: int = 16 * 1000 * 1000


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """``runtime.pools[]``: a named byte budget on one torch device (``None``: unlimited)."""

    name: str
    device: str
    budget: int | None = None


# llama.cpp's -ngl: a count of layers (the output layer counts), "all", or "auto" (--fit);
# None: not set (every tensor prefers the first pool).
GpuLayers = int | Literal["all", "auto"] | None
GPU_LAYERS_WORDS = ("all", "auto")
# common/common.h's LLM_FFN_EXPS_REGEX (--cpu-moe) and the CPU buffer's name.
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
CPU_BUFFER = "CPU"
# llama.cpp's --fit-target default: bytes kept free on each device.
DEFAULT_FIT_MARGIN = 1 << 30


def block_regex(block: int) -> str:
    """``llm_ffn_block_regex(block, LLM_FFN_EXPS_REGEX)``: one block's experts (--n-cpu-moe)."""
    return rf"blk\.{block}{FFN_EXPS_REGEX}"


@dataclass(frozen=True, slots=True)
class OverrideRule:
    """``REGEX=TARGET`` (llama.cpp's ``-ot``): tensors whose name the regex finds
    (``re.search``) go to TARGET, a pool's name or a llama.cpp buffer name (``CPU``: the
    fallback pool; ``CUDA<i>``: the pool on ``cuda:<i>``)."""

    pattern: str
    target: str

    @classmethod
    def parse(cls, text: str) -> OverrideRule:
        """``REGEX=TARGET``; ValueError names what is wrong."""
        pattern, sep, target = text.rpartition("=")
        if not sep or not pattern or not target:
            raise ValueError(f"expected REGEX=POOL (llama.cpp's -ot form), found {text!r}")
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"bad regular expression {pattern!r}: {exc}") from None
        return cls(pattern, target)

    def __str__(self) -> str:
        return f"{self.pattern}={self.target}"


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """``runtime.placement``: which pool each tensor starts in, in llama.cpp's vocabulary
    (``runtime/placement.py`` applies it; docs/configuration.md has the table).

    ``gpu_layers`` is ``-ngl``, ``override_tensor`` its ``-ot`` rules, ``cpu_moe``/``n_cpu_moe``
    ``--cpu-moe``/``--n-cpu-moe``, ``tensor_split`` ``-ts``, ``fit_margin`` ``--fit-target``
    (bytes). ``experts_pool`` sends every expert family to one pool (a rule after the others);
    ``split_experts`` splits a family that fits no single pool by expert ranges.
    """

    gpu_layers: GpuLayers = None
    override_tensor: tuple[OverrideRule, ...] = ()
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    tensor_split: tuple[float, ...] = ()
    fit_margin: int = DEFAULT_FIT_MARGIN
    experts_pool: str | None = None
    split_experts: bool = False

    @property
    def user_rules(self) -> bool:
        """Whether any override rule was set (``-ot``, ``--cpu-moe``, ``--n-cpu-moe``)."""
        return bool(self.override_tensor) or self.cpu_moe or self.n_cpu_moe > 0

    @property
    def llama_layers(self) -> bool:
        """Whether llama.cpp's layer placement applies (any of its keys is set)."""
        return self.gpu_layers is not None or self.user_rules or bool(self.tensor_split)

    def rules(self) -> list[OverrideRule]:
        """Every override in the order llama.cpp tries them: ``-ot`` rules first, then the ones
        ``--cpu-moe`` and ``--n-cpu-moe`` add."""
        rules = list(self.override_tensor)
        if self.cpu_moe:
            rules.append(OverrideRule(FFN_EXPS_REGEX, CPU_BUFFER))
        rules += [OverrideRule(block_regex(i), CPU_BUFFER) for i in range(self.n_cpu_moe)]
        return rules


class ServeMode(str, enum.Enum):
    """What ``ggufswap runtime`` serves (``runtime.serve.mode``)."""

    HTTP = "http"  # OpenAI-style completions (docs/serving.md)
    PROBE = "probe"  # a fixed batch in a loop, a logits digest per weight version (tests)
    PERPLEXITY = "perplexity"  # a token stream in a loop, perplexity per weight version (demo)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """``runtime.serve``: the reference server's mode and HTTP settings (CLI flags override)."""

    mode: ServeMode = ServeMode.HTTP
    host: str = "127.0.0.1"  # no authentication: keep it on loopback unless a proxy guards it
    port: int = 8000  # 0: any free port (status reports the bound one)
    max_batch: int = 8  # sequences decoded together
    max_queue: int = 64  # waiting requests before 503
    request_timeout_s: float = 60.0
    batch_interval_s: float = 0.01  # probe and perplexity modes: pause between batches


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """``runtime:``: the inference process that loads the model and applies plans."""

    name: str
    model: Path
    control_endpoint: str
    status_endpoint: str
    events_endpoint: str
    allowed_roots: tuple[Path, ...]
    pools: tuple[PoolConfig, ...]
    storage: Storage = Storage.AUTO
    compute_dtype: ComputeDtype = ComputeDtype.FLOAT32
    strict_types: bool = False
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    metrics_port: int | None = None
    log_level: LogLevel = LogLevel.INFO
    threads: int | None = None  # torch's CPU threads; None: auto, from the process's CPU affinity
    decoded_cache: int = DEFAULT_DECODED_CACHE  # native storage: decoded dense tensors kept (bytes)
    map_shards: MapShards = MapShards.AUTO  # native storage: serve CPU tensors from their files
    numerics: Numerics = Numerics.AUTO  # how the served decoder computes
    serve: ServeConfig = field(default_factory=ServeConfig)

    def pool(self, name: str) -> PoolConfig:
        """The pool called ``name``; raises ``KeyError`` naming the pools that exist."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no pool {name!r}; pools: {', '.join(p.name for p in self.pools)}")


@dataclass(frozen=True, slots=True)
class CurveConfig:
    """``security.curve``: ZeroMQ CURVE certificate files (``zmq.auth`` format)."""

    server_secret_key: Path | None = None
    server_public_key: Path | None = None
    client_secret_key: Path | None = None
    authorized_keys_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """``security:``: transport security of ``tcp://`` endpoints."""

    curve: CurveConfig | None = None
    allow_insecure_tcp: bool = False


@dataclass(frozen=True, slots=True)
class Config:
    """A whole configuration file. ``models`` is empty and ``runtime`` is ``None`` when absent."""

    source: Path | None
    agent: AgentConfig
    models: tuple[ModelConfig, ...] = ()
    runtime: RuntimeConfig | None = None
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def require_runtime(self) -> RuntimeConfig:
        """The ``runtime`` section, or ``MissingSectionError`` saying that the file lacks it."""
        if self.runtime is None:
            raise MissingSectionError([self._missing(Keys.RUNTIME, "the runtime command")])
        return self.runtime

    def require_models(self) -> tuple[ModelConfig, ...]:
        """The ``models`` list, or ``MissingSectionError`` saying that the file lacks it."""
        if not self.models:
            raise MissingSectionError([self._missing(Keys.MODELS, "the agent command")])
        return self.models

    def model(self, name: str) -> ModelConfig:
        """The model called ``name``; raises ``KeyError`` naming the models that exist."""
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model {name!r}; models: {', '.join(m.name for m in self.models)}")

    def _missing(self, key: str, who: str) -> ConfigProblem:
        file = str(self.source) if self.source is not None else "<config>"
        return ConfigProblem(
            file, None, key, f"{who} needs a '{key}' section and this file has none"
        )
