"""ggufswap.config: the YAML configuration as typed, frozen records.

``load_config(path)`` reads and validates a file and returns a ``Config``; every problem is
reported at once in a ``ConfigError`` whose lines read ``FILE:LINE: key.path: message``.
``docs/configuration.md`` documents every key.
"""

from __future__ import annotations

from ggufswap.config._checks import numerics_problems
from ggufswap.config._export import config_to_dict
from ggufswap.config.endpoints import Transport, default_runtime_dir, transport_of
from ggufswap.config.errors import ConfigError, ConfigProblem, MissingSectionError
from ggufswap.config.loader import SCHEMA_VERSION, load_config, load_config_text
from ggufswap.config.schema import (
    DEFAULT_DECODED_CACHE,
    AgentConfig,
    ComputeDtype,
    Config,
    CurveConfig,
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
from ggufswap.config.units import (
    AUTO_THREADS,
    MAX_THREADS,
    format_size,
    format_threads,
    parse_size,
    parse_threads,
)

__all__ = [
    "AUTO_THREADS",
    "DEFAULT_DECODED_CACHE",
    "MAX_THREADS",
    "SCHEMA_VERSION",
    "AgentConfig",
    "ComputeDtype",
    "Config",
    "ConfigError",
    "ConfigProblem",
    "CurveConfig",
    "LogLevel",
    "MapShards",
    "MissingSectionError",
    "ModelConfig",
    "Numerics",
    "PlacementConfig",
    "PoolConfig",
    "RuntimeConfig",
    "SecurityConfig",
    "ServeConfig",
    "ServeMode",
    "Storage",
    "TensorFilter",
    "Transport",
    "VerifyMode",
    "WatchBackend",
    "WatchConfig",
    "config_to_dict",
    "default_runtime_dir",
    "format_size",
    "format_threads",
    "load_config",
    "load_config_text",
    "numerics_problems",
    "parse_size",
    "parse_threads",
    "transport_of",
]
