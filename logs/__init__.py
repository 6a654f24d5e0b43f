"""ggufswap.logs, the loggers of every package: the host's structlog configuration when there is
one, stderr otherwise.

Every ggufswap module logs through ``log = get_logger(__name__)``. Library code never configures
logging (the host program owns that), but structlog's unconfigured default prints to *stdout*,
which corrupts a host that writes its own data there (JSON on a pipe, a notebook cell's output).
So while structlog is unconfigured, these loggers render with structlog's default processors to
``sys.stderr`` (looked up at each call, so redirections apply), at level info and above. Once
the host calls ``structlog.configure`` (``ggufswap``'s command line does, in ``main``), every
logger follows that configuration, whenever it was created: the decision is made per call.

A foundation of its own (the ``logs/`` folder): every layer imports it, and it imports nothing of
ggufswap.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["Logger", "get_logger"]

_FALLBACK_LEVEL = logging.INFO
_FallbackWrapper = structlog.make_filtering_bound_logger(_FALLBACK_LEVEL)


class Logger:
    """A module's logger (what ``get_logger`` returns): ``log.info("event", key=value)``,
    ``log.bind(key=value)`` for a logger that adds context to every line."""

    __slots__ = ("_configured", "_context", "_name")

    def __init__(self, name: str, context: dict[str, Any] | None = None) -> None:
        self._name = name
        self._context = context or {}
        self._configured: Any = None  # structlog's lazy proxy, made on first configured use

    def bind(self, **values: Any) -> Logger:
        return Logger(self._name, {**self._context, **values})

    def _target(self) -> Any:
        if structlog.is_configured():
            if self._configured is None:
                self._configured = structlog.get_logger(self._name, **self._context)
            return self._configured
        return structlog.wrap_logger(
            structlog.PrintLogger(file=sys.stderr),
            wrapper_class=_FallbackWrapper,
            **self._context,
        )

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return getattr(self._target(), method)


def get_logger(name: str) -> Logger:
    """The logger for module ``name`` (pass ``__name__``)."""
    return Logger(name)
