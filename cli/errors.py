"""Errors raised by the command line's own modules: every one is a :class:`CliError`.

A subcommand turns every error it catches, the library's and these, into a message on stderr and
an exit code; these are the ones the command line raises itself (the demos' steps).
"""

from __future__ import annotations


class CliError(Exception):
    """Base class of every error the command line (``ggufswap``'s own modules) raises."""


class DemoError(CliError, RuntimeError):
    """The demo could not complete a step; the message says which and what was seen."""


class DemoSweepError(CliError):
    """The real-model demo cannot run (no text, a work directory in use); the message says why."""
