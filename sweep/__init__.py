"""ggufswap.sweep: the per-tensor quantization sweep, the GGUF Tool Suite's job done by hot-swap.

For every tensor (or group) of a model and every target quant type a recipe names: swap the
tensor in, measure PPL and KL divergence against the baseline's logits with llama-perplexity's
protocol (:mod:`ggufswap.runtime.serving.perplexity`) and figures, restore, verify the restore
bit for bit, record. Modules:

- :mod:`.recipe` (which tensors, which types) over :mod:`.qtypes` (every type named as llama.cpp
  and ik_llama.cpp spell them);
- :mod:`.sources` (where a round's tensors come from: the user's files, :mod:`.suite_dir`;
  requant; ik_llama.cpp's quantizer, :mod:`.ik_quantize`);
- :mod:`.evaluate`, :mod:`.kld`, :mod:`.basefile` (the baseline and the figures against it);
- :mod:`.sweep` (the one sweep loop and what it drives), :mod:`.inprocess` (this process),
  :mod:`.procs` with :mod:`.children` and :mod:`.runtime_proc` (a runtime process and an agent),
  :mod:`.ray_driver` (Ray workers: :mod:`.ray_worker`, :mod:`.ray_placement`, :mod:`.ray_fleet`);
- :mod:`.results`, :mod:`.suite`, :mod:`.plot` (journal, table, the Tool Suite's files, PNG).

Nothing but the command line imports this package; only the ``ray_*`` modules import ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ggufswap.sweep.errors import (
    BaselineMismatch,
    ChildFailed,
    KldError,
    RecipeError,
    RoundRefused,
    SourceError,
    SweepError,
    SweepLibraryError,
)
from ggufswap.sweep.qtypes import parse_qtype, qtype_name
from ggufswap.sweep.recipe import Recipe, Round, Skip, plan_rounds
from ggufswap.sweep.sources import TensorSet, TensorSources
from ggufswap.sweep.suite_dir import GgufSet, ShardDir, open_source

if TYPE_CHECKING:
    from ggufswap.sweep.inprocess import InProcessTarget, run_sweep
    from ggufswap.sweep.sweep import Sweep, SweepOptions, SweepReport, SweepTarget

# The names whose modules import torch load on first use: importing the package (or its light
# modules, e.g. .children for a parent that only starts processes) imports no torch.
_LAZY = {
    "InProcessTarget": "ggufswap.sweep.inprocess",
    "run_sweep": "ggufswap.sweep.inprocess",
    "Sweep": "ggufswap.sweep.sweep",
    "SweepOptions": "ggufswap.sweep.sweep",
    "SweepReport": "ggufswap.sweep.sweep",
    "SweepTarget": "ggufswap.sweep.sweep",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BaselineMismatch",
    "ChildFailed",
    "GgufSet",
    "InProcessTarget",
    "KldError",
    "Recipe",
    "RecipeError",
    "Round",
    "RoundRefused",
    "ShardDir",
    "Skip",
    "SourceError",
    "Sweep",
    "SweepError",
    "SweepLibraryError",
    "SweepOptions",
    "SweepReport",
    "SweepTarget",
    "TensorSet",
    "TensorSources",
    "open_source",
    "parse_qtype",
    "plan_rounds",
    "qtype_name",
    "run_sweep",
]
