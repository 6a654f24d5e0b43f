"""Errors raised by the sweep: every one is a :class:`SweepLibraryError`.

The base is its own (not the runtime's): the light half of the package (recipes, type names,
sources, child processes: what a parent that only starts a runtime process needs) imports no
torch, and ``ggufswap.runtime``'s package does."""

from __future__ import annotations


class SweepLibraryError(Exception):
    """Base class of every error the sweep package raises."""


class RecipeError(SweepLibraryError, ValueError):
    """A recipe that cannot be used; the message names the file and every problem."""


class SourceError(SweepLibraryError):
    """No quantized tensor could be made or found for a round; the message says which and why."""


class KldError(SweepLibraryError, ValueError):
    """A baseline file that cannot be used; the message says why."""


class SweepError(SweepLibraryError):
    """The sweep cannot go on (the model no longer matches its baseline, a restore failed, the
    output directory belongs to another sweep); the message says what was found."""


class BaselineMismatch(SweepError):
    """``--out`` holds the journal of a sweep of another model, text, context or numerics."""


class ChildFailed(SweepError):
    """A child process (the sweep's runtime or agent) exited or did not answer in time."""


class RoundRefused(SweepLibraryError):
    """A round that cannot be measured; the sweep reports it and goes on. ``changed``: what a
    commit that changed other tensors than asked did change (None: nothing was committed)."""

    def __init__(self, message: str, *, changed: frozenset[str] | None = None) -> None:
        super().__init__(message)
        self.changed = changed
