"""Converters from YAML nodes to the typed values of the schema; each raises ``Invalid``."""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from yaml.nodes import Node, ScalarNode

from ggufswap.config._nodes import Converter, NodeReader
from ggufswap.config.endpoints import check_endpoint
from ggufswap.config.errors import Invalid
from ggufswap.config.llama_args import parse_gpu_layers, parse_tensor_split
from ggufswap.config.schema import GpuLayers, MapShards, OverrideRule
from ggufswap.config.units import AUTO_THREADS, parse_size, parse_threads

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)

# Names appear in socket paths, log fields and metric labels.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NAME = NAME_PATTERN
# Devices whose syntax we can check without importing torch: TYPE or TYPE:INDEX.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
_DEVICE = re.compile(r"(?P<type>[a-z]+)(?::(?P<index>0|[1-9]\d{0,3}))?")


class PathKind(enum.Enum):
    """What a path must be when paths are checked."""

    FILE = "file"
    DIRECTORY = "directory"


class Values:
    """Converters bound to one reader, one base directory and one path-checking policy."""

    def __init__(self, reader: NodeReader, *, base_dir: Path, check_paths: bool):
        self.reader = reader
        self.base_dir = base_dir
        self.check_paths = check_paths

    def string(self, node: Node, path: str) -> str:
        del path
        value = self.reader.scalar(node)
        if not isinstance(value, str):
            hint = " (quote it to make it a string)" if value is not None else ""
            raise Invalid(f"expected a string, found {self.reader.describe(node)}{hint}")
        if not value:
            raise Invalid("expected a non-empty string, found ''")
        return value

    def name(self, node: Node, path: str) -> str:
        value = self.string(node, path)
        if not _NAME.fullmatch(value):
            raise Invalid(
                "a name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                f"digit; found {value!r}"
            )
        return value

    def boolean(self, node: Node, path: str) -> bool:
        del path
        value = self.reader.scalar(node)
        if not isinstance(value, bool):
            raise Invalid(f"expected true or false, found {self.reader.describe(node)}")
        return value

    def integer(self, *, minimum: int | None = None, maximum: int | None = None) -> Converter[int]:
        def convert(node: Node, path: str) -> int:
            del path
            value = self.reader.scalar(node)
            if isinstance(value, bool) or not isinstance(value, int):
                raise Invalid(f"expected an integer, found {self.reader.describe(node)}")
            if minimum is not None and value < minimum:
                raise Invalid(f"expected an integer >= {minimum}, found {value}")
            if maximum is not None and value > maximum:
                raise Invalid(f"expected an integer <= {maximum}, found {value}")
            return value

        return convert

    def port(self, node: Node, path: str) -> int:
        return self.integer(minimum=1, maximum=65535)(node, path)

    def seconds(self, node: Node, path: str) -> float:
        """A positive, finite number of seconds (an integer or a decimal)."""
        del path
        value = self.reader.scalar(node)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Invalid(f"expected a number of seconds, found {self.reader.describe(node)}")
        if not math.isfinite(value) or value <= 0:
            raise Invalid(f"expected a number of seconds > 0, found {value}")
        return float(value)

    def seconds_or_zero(self, node: Node, path: str) -> float:
        """A finite number of seconds >= 0."""
        value = self.reader.scalar(node)
        if value == 0 and not isinstance(value, bool):
            return 0.0
        return self.seconds(node, path)

    def threads(self, node: Node, path: str) -> int | None:
        """A thread count (``1..MAX_THREADS``) or ``auto`` (``None``)."""
        del path
        value = self.reader.scalar(node)
        if isinstance(value, bool) or not isinstance(value, int | str):
            found = self.reader.describe(node)
            raise Invalid(f"expected an integer >= 1 or '{AUTO_THREADS}', found {found}")
        try:
            return parse_threads(value)
        except ValueError as exc:
            raise Invalid(str(exc)) from None

    def gpu_layers(self, node: Node, path: str) -> GpuLayers:
        """llama.cpp's ``-ngl``: an integer >= 0 (layers, the output one counted), ``all`` or
        ``auto``."""
        del path
        value = self.reader.scalar(node)
        try:
            return parse_gpu_layers(value)
        except ValueError as exc:
            raise Invalid(str(exc)) from None

    def override_rule(self, node: Node, path: str) -> OverrideRule:
        """``REGEX=POOL``, as llama.cpp's ``-ot`` takes it."""
        try:
            return OverrideRule.parse(self.string(node, path))
        except ValueError as exc:
            raise Invalid(str(exc)) from None

    def tensor_split(self, node: Node, path: str) -> tuple[float, ...]:
        """``-ts``: a list of proportions, or llama.cpp's string form ``3,1``."""
        value = self.reader.scalar(node) if isinstance(node, ScalarNode) else None
        if isinstance(value, str):
            try:
                return parse_tensor_split(value)
            except ValueError as exc:
                raise Invalid(str(exc)) from None
        shares = self.list_of(self.proportion, min_items=1)(node, path)
        if not any(shares):
            raise Invalid(
                "expected at least one proportion > 0 (leave tensor_split out to split "
                "by free memory)"
            )
        return shares

    def proportion(self, node: Node, path: str) -> float:
        del path
        value = self.reader.scalar(node)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Invalid(f"expected a number >= 0, found {self.reader.describe(node)}")
        if not math.isfinite(value) or value < 0:
            raise Invalid(f"expected a number >= 0, found {value}")
        return float(value)

    def map_shards(self, node: Node, path: str) -> MapShards:
        """``true``, ``false`` or ``auto``."""
        del path
        value = self.reader.scalar(node)
        if isinstance(value, bool):
            return MapShards.ON if value else MapShards.OFF
        if value == MapShards.AUTO.value:
            return MapShards.AUTO
        raise Invalid(f"expected true, false or 'auto', found {self.reader.describe(node)}")

    def choice(self, enum_type: type[E]) -> Converter[E]:
        options = [str(member.value) for member in enum_type]

        def convert(node: Node, path: str) -> E:
            del path
            value = self.reader.scalar(node)
            for member in enum_type:
                if value == member.value:
                    return member
            found = repr(value) if isinstance(value, str) else self.reader.describe(node)
            raise Invalid(f"expected one of {'|'.join(options)}, found {found}")

        return convert

    def size(self, node: Node, path: str) -> int:
        """A byte size > 0: ``70GiB``, ``512MiB``, ``1.5GB`` or an integer number of bytes."""
        nbytes = self.size_or_zero(node, path)
        if nbytes == 0:
            raise Invalid(f"a budget must be > 0 bytes, found {self.reader.scalar(node)!r}")
        return nbytes

    def size_or_zero(self, node: Node, path: str) -> int:
        """A byte size >= 0 (``0`` turns the feature off), in the same forms as :meth:`size`."""
        del path
        value = self.reader.scalar(node)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise Invalid(
                f"expected a size such as 70GiB or a number of bytes, "
                f"found {self.reader.describe(node)}"
            )
        try:
            nbytes = parse_size(value)
        except ValueError as exc:
            raise Invalid(str(exc)) from None
        if nbytes < 0:
            raise Invalid(f"a size must be >= 0 bytes, found {value!r}")
        return nbytes

    def path(self, *, kind: PathKind | None) -> Converter[Path]:
        """A filesystem path; relative paths are relative to the configuration's directory."""

        def convert(node: Node, key_path: str) -> Path:
            text = self.string(node, key_path)
            if "\x00" in text:
                raise Invalid("a path cannot contain a NUL byte")
            resolved = Path(os.path.normpath(self.base_dir / os.path.expanduser(text)))
            if self.check_paths and kind is not None:
                self._check_exists(resolved, kind)
            return resolved

        return convert

    @staticmethod
    def _check_exists(path: Path, kind: PathKind) -> None:
        try:
            exists = path.exists()
        except OSError as exc:
            raise Invalid(f"cannot check {kind.value} {str(path)!r}: {exc}") from None
        if not exists:
            raise Invalid(f"{kind.value} {str(path)!r} does not exist")
        if kind is PathKind.DIRECTORY and not path.is_dir():
            raise Invalid(f"{str(path)!r} is not a directory")
        if kind is PathKind.FILE and not path.is_file():
            raise Invalid(f"{str(path)!r} is not a regular file")

    def endpoint(self, node: Node, path: str) -> str:
        text = self.string(node, path)
        endpoint, why = check_endpoint(text, base_dir=self.base_dir)
        if endpoint is None:
            raise Invalid(why)
        return endpoint

    def connect_endpoint(self, node: Node, path: str) -> str:
        """An endpoint to connect to: a ``tcp://*`` bind address names no host."""
        endpoint = self.endpoint(node, path)
        if endpoint.startswith("tcp://*:"):
            raise Invalid(f"{endpoint} is a bind address; name the host to connect to")
        return endpoint

    def regex(self, node: Node, path: str) -> re.Pattern[str]:
        text = self.string(node, path)
        try:
            return re.compile(text)
        except (re.error, OverflowError, RecursionError) as exc:
            raise Invalid(f"bad regular expression {text!r}: {exc}") from None

    def glob(self, node: Node, path: str) -> str:
        """A shell pattern matched against file names (never containing a directory)."""
        text = self.string(node, path)
        if "/" in text:
            raise Invalid(
                f"a pattern matches file names and cannot contain '/', found {text!r} "
                "(put the directory in 'path' and use 'recursive: true')"
            )
        return text

    def device(self, node: Node, path: str) -> str:
        text = self.string(node, path)
        match = _DEVICE.fullmatch(text)
        if match is None or match.group("type") not in DEVICE_TYPES:
            forms = ", ".join(f"{t}, {t}:N" for t in DEVICE_TYPES)
            raise Invalid(f"expected a torch device ({forms}), found {text!r}")
        return text

    def list_of(self, convert: Converter[T], *, min_items: int = 0) -> Converter[tuple[T, ...]]:
        def convert_list(node: Node, path: str) -> tuple[T, ...]:
            count_before = len(self.reader.problems)
            items = self.reader.items(node, path, convert)
            if len(items) < min_items and len(self.reader.problems) == count_before:
                raise Invalid(f"expected at least {min_items} item(s), found {len(items)}")
            return tuple(items)

        return convert_list


def optional(convert: Callable[[Node, str], T]) -> Callable[[Node, str], T | None]:
    """``convert`` typed as ``T | None``: a null never reaches it (``get`` returns the default)."""
    return convert
