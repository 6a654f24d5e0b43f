"""ggufswap.shards.archs: each architecture's torch-free spec, one module per architecture.

``<arch>.py`` holds ``RULES``: what llama.cpp's loader and graph do for it (read by the writer,
which refuses a spec llama.cpp would refuse, and by the runtime's ``HParams``, which reads every
hyper-parameter with llama.cpp's rule), with the writer's hooks for what the shared tensor plan
does not cover. ``ARCH_RULES`` below holds one line per architecture; the runtime's decoders
(``ggufswap.runtime.models``) have their own one-line registry.

The runtime reads only the rules: importing this package imports neither gguf-py nor the writer
(the hooks import the writer's ``Role`` and ``PlannedTensor`` when they run; keys and typed
values come from ``shards.keys`` and ``shards.value_types``), so serving a model does not pay for
them (``tests/test_layout.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from ggufswap.shards.archs import (
    deepseek2,
    deepseek32,
    dots1,
    gemma3,
    gemma4,
    glm4moe,
    glm_dsa,
    gpt_oss,
    llama,
    llama4,
    minimax_m2,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    qwen3next,
    qwen3vlmoe,
    qwen35,
    qwen35moe,
)
from ggufswap.shards.archs._rules import (
    NEUTRAL_VALUES,
    SHARED_LLAMA_CPP_KEYS,
    ArchRules,
    Experts,
    ExpertWidth,
    SharedExpert,
    WriterHooks,
)
from ggufswap.shards.keys import Arch

__all__ = [
    "ARCH_RULES",
    "NEUTRAL_VALUES",
    "SHARED_LLAMA_CPP_KEYS",
    "ArchRules",
    "ExpertWidth",
    "Experts",
    "SharedExpert",
    "WriterHooks",
    "rules_of",
]

ARCH_RULES: Final[Mapping[Arch, ArchRules]] = MappingProxyType(
    {
        Arch.LLAMA: llama.RULES,
        Arch.QWEN2: qwen2.RULES,
        Arch.QWEN2MOE: qwen2moe.RULES,
        Arch.QWEN3: qwen3.RULES,
        Arch.QWEN3MOE: qwen3moe.RULES,
        Arch.GPT_OSS: gpt_oss.RULES,
        Arch.GEMMA3: gemma3.RULES,
        Arch.QWEN3VLMOE: qwen3vlmoe.RULES,
        Arch.MINIMAX_M2: minimax_m2.RULES,
        Arch.LLAMA4: llama4.RULES,
        Arch.GEMMA4: gemma4.RULES,
        Arch.DOTS1: dots1.RULES,
        Arch.DEEPSEEK2: deepseek2.RULES,
        Arch.GLM4MOE: glm4moe.RULES,
        Arch.QWEN35: qwen35.RULES,
        Arch.QWEN35MOE: qwen35moe.RULES,
        Arch.QWEN3NEXT: qwen3next.RULES,
        Arch.DEEPSEEK32: deepseek32.RULES,
        Arch.GLM_DSA: glm_dsa.RULES,
    }
)


def rules_of(arch: Arch | str) -> ArchRules:
    """The rules of ``arch`` (a ``general.architecture`` value)."""
    return ARCH_RULES[Arch(arch)]
