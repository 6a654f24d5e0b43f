"""GLM-5 / GLM-5.1 / GLM-5.2 (``general.architecture = glm-dsa``): llama.cpp's
``llama_model_glm_dsa`` (``src/models/glm-dsa.cpp``), deepseek32's decoder with three differences:

- **Shared indexer blocks** (GLM-5.2): ``attention.indexer.types`` (per-block flags, 1 = full)
  says which blocks run their own indexer; the others reuse the top-k selection of the last full
  block and need no ``indexer.*`` tensors (tensors present there are loaded and never read).
  Without the key, every block is full when ``context_length`` is below 1048576 (GLM-5, 5.1),
  else GLM-5.2's pattern (blocks 0, 1, then every fourth from 2).
- The indexer's RoPE pairs are adjacent (NORM), and its key norm's epsilon is llama.cpp's
  ``f_norm_eps``, which the loader never sets: 0.
- ``expert_gating_func`` is optional (absent: sigmoid); ``rope.scaling.yarn_log_multiplier`` is
  not read (the graph's mscale is YaRN's ``1 + 0.1 ln factor`` alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ggufswap.runtime.models import deepseek2, deepseek32
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.hparams import Arch, DSAShape, Gating, KeyReader
from ggufswap.shards.keys import Keys

# llama_model_glm_dsa::load_arch_hparams: files with this training context or more are GLM-5.2,
# whose default indexer pattern is GLM_5_2_DEFAULT_INDEXER_TYPES (78 blocks).
GLM_5_2_CONTEXT: Final = 1048576
GLM_5_2_LAYERS: Final = 78
KEYS: Final = (
    *(key for key in deepseek2.KEYS if key != Keys.LLM.ROPE_SCALING_YARN_LOG_MUL),
    *deepseek32.INDEXER_KEYS,
    Keys.LLM.INDEXER_TYPES,
)


def glm_5_2_full(layer: int) -> bool:
    """GLM-5.2's default pattern: blocks 0 and 1, then 2, 6, 10, ... below 78."""
    return layer < 2 or (layer < GLM_5_2_LAYERS and (layer - 2) % 4 == 0)


class _WithoutLogMultiplier(KeyReader):
    """The reader without ``rope.scaling.yarn_log_multiplier``, which glm-dsa never reads."""

    def __init__(self, reader: KeyReader) -> None:
        skip = Keys.LLM.ROPE_SCALING_YARN_LOG_MUL.format(reader.arch)
        super().__init__({k: v for k, v in reader.md.items() if k != skip}, reader.arch)
        self.problems = reader.problems


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_glm_dsa::load_arch_hparams: deepseek2's keys but the log multiplier
    (q_lora_rank required, gating sigmoid by default), the indexer's, and its block pattern."""
    k = Keys.LLM
    deepseek32.require(reader, k.Q_LORA_RANK)
    out = deepseek2.read_keys(_WithoutLogMultiplier(reader), common)
    if k.EXPERT_GATING_FUNC.format(reader.arch) not in reader.md:
        out["gating"] = Gating.SIGMOID
    n_trunk = common["n_layer"] - out["n_layer_nextn"]
    flags = reader.md.get(k.INDEXER_TYPES.format(reader.arch))
    if flags is not None:
        full = tuple(bool(f) for f in list(flags)[:n_trunk])
    elif common["context_length"] < GLM_5_2_CONTEXT:
        full = (True,) * n_trunk
    else:
        full = tuple(glm_5_2_full(i) for i in range(n_trunk))
    out["dsa"] = DSAShape(
        **deepseek32.indexer_keys(reader), full_layers=full, rope_neox=False, norm_eps=0.0
    )
    return out


class GlmDsaTransformer(deepseek32.SparseTransformer):
    """glm-dsa: full and shared indexer blocks, NORM indexer RoPE."""

    arch = Arch.GLM_DSA


ARCHITECTURE = Architecture(
    arch=Arch.GLM_DSA, decoder=GlmDsaTransformer, read_keys=read_keys, keys=KEYS
)
