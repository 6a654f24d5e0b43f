"""Which libggml a sweep's ``ggml`` numerics multiply with (``--ggml``; light: no torch).

ggml numerics take their products from a libggml (``runtime/kernels/_ggml.py``), and the figures
are then that library's arithmetic: llama.cpp's with mainline's libggml (llama-cpp-python's), to
compare with mainline's ``llama-perplexity``; ik_llama.cpp's with its fork's (the
``ik-llama-cpp-python`` wheel), to compare with ik_llama.cpp's, whose activation rounding differs
(its mean KLD of a round is 25 % lower on Gemma 3: docs/sweep.md). One library a process,
chosen before the first product. ``auto`` (the default) takes mainline's when llama-cpp-python
is installed and every type of the sweep (the model's and the recipe's targets) is mainline's,
else ik_llama.cpp's when installed, else whatever the process finds (``$GGUFSWAP_GGML``, then
ik's, then mainline's). ``protocol.json``'s ``products`` records the outcome.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from typing import Final

from ggufswap.sweep.qtypes import is_ik_type

AUTO: Final = "auto"
MAINLINE: Final = "mainline"
IK: Final = "ik"
CHOICES: Final = (AUTO, MAINLINE, IK, "off")  # or a libggml's path
_PACKAGES: Final = {MAINLINE: "llama_cpp", IK: "ik_llama_cpp"}
ENV: Final = "GGUFSWAP_GGML"  # runtime/kernels/_ggml.py's: a library chosen for the process


def installed(which: str) -> bool:
    """Whether the package of ``which`` (``mainline`` or ``ik``) is importable (not imported)."""
    try:
        return importlib.util.find_spec(_PACKAGES[which]) is not None
    except (ImportError, ValueError):
        return False


def choose(option: str, types: Iterable[int]) -> str:
    """The library a sweep asks for: ``option`` itself unless ``auto``; then ``$GGUFSWAP_GGML``'s
    when that is set (``auto``), else ``mainline`` when its package is installed and no type in
    ``types`` is ik_llama.cpp's own, ``ik`` when ik's is installed, else ``auto`` (the process's
    own default)."""
    if option != AUTO or os.environ.get(ENV, "").strip():
        return option
    ik_types = any(is_ik_type(t) for t in types)
    if not ik_types and installed(MAINLINE):
        return MAINLINE
    return IK if installed(IK) else AUTO
