"""The compiled kernels (``runtime/kernels/csrc/qkernels.c``), when the install could build them.

One place decides whether they run: :func:`handles` (this GGML type, rows of this length, on the
CPU). :mod:`.dequant` decodes with them and :mod:`.qmatmul` multiplies with them; both fall back
to the torch kernels where they do not run. ``disabled()`` turns them off for a block of code
(tests exercise both paths on the same machine).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from ggufswap.shards.ggml_types import GGMLType

__all__ = ["available", "disabled", "handles", "module", "types"]


def _load() -> ModuleType | None:
    try:
        from ggufswap.runtime.kernels import _qkernels  # type: ignore[attr-defined]
    except ImportError:
        return None
    loaded: ModuleType = _qkernels
    return loaded


_module = _load()
# The project's type table (a mainline member equals gguf's GGMLQuantizationType member of the
# same code; ik_llama.cpp's IQ4_KS has no gguf member).
_TYPES: frozenset[GGMLType] = (
    frozenset() if _module is None else frozenset(GGMLType(t) for t in _module.types())
)
_BLOCK = {t: 0 if _module is None else int(_module.block_size(int(t))) for t in _TYPES}


class _Switch:
    enabled = True


def available() -> bool:
    """Whether the extension was built and is enabled."""
    return _module is not None and _Switch.enabled


def types() -> frozenset[GGMLType]:
    """GGML types the compiled kernels handle (empty when they are unavailable)."""
    return _TYPES if available() else frozenset()


def handles(ggml_type: int, row: int, device: torch.device) -> bool:
    """Whether the compiled kernels decode/multiply ``ggml_type`` rows of ``row`` values there."""
    return (
        available()
        and device.type == "cpu"
        and ggml_type in _TYPES
        and row % _BLOCK[GGMLType(ggml_type)] == 0
    )


def module() -> Any:
    """The extension module (call only after :func:`handles` said yes)."""
    assert _module is not None, "the compiled kernels were not built"
    assert _Switch.enabled, "the compiled kernels are disabled here"
    return _module


@contextmanager
def disabled() -> Iterator[None]:
    """Use the torch kernels only, within the block (process-wide: for tests and benchmarks)."""
    before, _Switch.enabled = _Switch.enabled, False
    try:
        yield
    finally:
        _Switch.enabled = before
