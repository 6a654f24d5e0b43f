"""A configuration as plain JSON-ready data (for ``check-config --json`` and status output)."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path
from typing import Any

from ggufswap.config.schema import Config, MapShards, OverrideRule


def config_to_dict(config: Config) -> dict[str, Any]:
    """Every field of ``config`` as dicts, lists, strings, numbers, booleans and ``None``."""
    plain = _plain(config)
    assert isinstance(plain, dict), "a dataclass becomes a dict"
    return plain


def _plain(value: object) -> Any:
    if isinstance(value, OverrideRule):  # written as YAML and -ot read it: REGEX=POOL
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, MapShards):  # written as YAML reads it: true, false or auto
        return {MapShards.ON: True, MapShards.OFF: False}.get(value, value.value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, re.Pattern):
        return value.pattern
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
