"""ggufswap.runtime.serving: the reference server around the core and the models.

The daemon (``ggufswap runtime``), its serve loops (probe batches, HTTP completions), the
continuous batcher, the GGUF tokenizer, perplexity and KL divergence, and Prometheus metrics.
"""

from __future__ import annotations

from ggufswap.runtime.serving.errors import (
    GenerateError,
    ListenError,
    ServingError,
    TokenizerError,
)
from ggufswap.runtime.serving.perplexity import (
    NllStats,
    evaluate_batches,
    make_eval_tokens,
    perplexity,
)
from ggufswap.runtime.serving.tokenizer import GgufTokenizer

__all__ = [
    "GenerateError",
    "GgufTokenizer",
    "ListenError",
    "NllStats",
    "ServingError",
    "TokenizerError",
    "evaluate_batches",
    "make_eval_tokens",
    "perplexity",
]
