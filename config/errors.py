"""Errors raised while loading a configuration file.

Every problem names the file, the YAML line and the key path, and says what was expected and
what was found. A loader collects every problem it can find before raising, so that one run of
``ggufswap check-config`` shows all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import yaml


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One thing wrong with a configuration file.

    ``line`` is 1-based, or ``None`` for a problem with the file as a whole (unreadable, empty).
    ``key_path`` is the dotted path of the offending key (``models[0].watch[0].backend``), or an
    empty string at the top level.
    """

    file: str
    line: int | None
    key_path: str
    message: str

    def __str__(self) -> str:
        """``FILE:LINE: key.path: message`` on one line (line breaks in values are escaped)."""
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        text = (
            f"{where}: {self.key_path}: {self.message}"
            if self.key_path
            else f"{where}: {self.message}"
        )
        return text.replace("\r", "\\r").replace("\n", "\\n")


class ConfigError(Exception):
    """Base class of every configuration error; ``problems`` lists all of them, in file order."""

    def __init__(self, problems: Iterable[ConfigProblem]):
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)
        assert self.problems, "a ConfigError needs at least one problem"
        super().__init__("\n".join(str(p) for p in self.problems))


class MissingSectionError(ConfigError, LookupError):
    """A command needs a section (``models`` or ``runtime``) that the file does not have."""


class Invalid(ConfigError):
    """Raised by a converter; the reader records it as a problem at ``node`` (or the value).

    It never leaves the loader: every ``Invalid`` becomes a :class:`ConfigProblem` of the
    :class:`ConfigError` the loader raises, at the file and line the reader knows. Were one to
    escape, it would still read as one configuration problem, at ``node``'s line if given.
    """

    def __init__(self, message: str, node: yaml.Node | None = None):
        mark = node.start_mark if node is not None else None
        where = ConfigProblem(
            file=mark.name if mark is not None else "<configuration>",
            line=mark.line + 1 if mark is not None else None,
            key_path="",
            message=message,
        )
        super().__init__([where])
        self.message = message
        self.node = node
