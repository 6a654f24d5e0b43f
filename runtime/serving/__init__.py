"""ggufswap.runtime.serving: the reference server around the core and the models.

The daemon (``ggufswap runtime``), its serve loops (probe batches, HTTP completions), the
continuous batcher, the GGUF tokenizer, perplexity and KL divergence, and Prometheus metrics.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ggufswap.runtime.serving.errors import (
    GenerateError,
    ListenError,
    ServingError,
    TokenizerError,
)

if TYPE_CHECKING:
    from ggufswap.runtime.serving.perplexity import (
        NllStats,
        evaluate_batches,
        make_eval_tokens,
    )
    from ggufswap.runtime.serving.tokenizer import GgufTokenizer

# Imported on first use: the HTTP server's modules load without torch (see ggufswap.runtime).
# The ``perplexity`` function is not among them: its name is its module's, which any import of
# that module binds here first (use ``ggufswap.runtime.serving.perplexity.perplexity``).
_HOMES: dict[str, str] = {
    "NllStats": "ggufswap.runtime.serving.perplexity",
    "evaluate_batches": "ggufswap.runtime.serving.perplexity",
    "make_eval_tokens": "ggufswap.runtime.serving.perplexity",
    "GgufTokenizer": "ggufswap.runtime.serving.tokenizer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "GenerateError",
    "GgufTokenizer",
    "ListenError",
    "NllStats",
    "ServingError",
    "TokenizerError",
    "evaluate_batches",
    "make_eval_tokens",
]
