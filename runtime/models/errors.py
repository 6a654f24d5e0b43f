"""Errors raised by the model architectures: every one is a :class:`ModelError`."""

from __future__ import annotations

from ggufswap.runtime import RuntimeLibraryError


class ModelError(RuntimeLibraryError):
    """Base class of every error the models package raises."""


class HParamsError(ModelError, ValueError):
    """GGUF metadata does not describe a model the reference decoder can run."""


class MissingWeightError(ModelError, KeyError):
    """The provider lacks tensors the model needs, holds them with the wrong shape, or holds
    tensors the architecture does not have (which llama.cpp's loader refuses)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class KVCacheError(ModelError, ValueError):
    """A forward does not continue the sequence its cache holds."""
