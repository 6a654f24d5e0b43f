"""qwen3vlmoe (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B: the text tower): qwen3moe's blocks with
interleaved multimodal RoPE over the whole head (``rope.dimension_sections``, required).

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer adds to qwen3moe's
plan: its refusals and its two keys. ``n_deepstack_layers`` is written as Qwen3-VL's converter
writes it (the vision tower's deepstack indexes: 3); for text its inputs are zeros.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from ggufswap.shards.archs._common import u32
from ggufswap.shards.archs._rules import Experts, ExpertWidth, WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import GGUFValueType, TypedValue

if TYPE_CHECKING:
    from ggufswap.shards.writer import ModelSpec

SOURCE = "llama_model_qwen3vlmoe::load_arch_hparams/load_arch_tensors (src/models/qwen3vlmoe.cpp)"
# len(vision_config.deepstack_visual_indexes) of Qwen3-VL's released configs.
DEEPSTACK_LAYERS: Final = 3


def errors(spec: ModelSpec, why: str) -> list[str]:
    """The graph rotates the whole head (GGML_ASSERT(n_embd_head == n_rot)) by four sections."""
    out = []
    if spec.n_rot != spec.n_embd_head:
        out.append(f"qwen3vlmoe rotates the whole head: rope_dim must be unset or head_dim {why}")
    if len(spec.rope_sections) != 4 or sum(spec.rope_sections) > spec.n_embd_head:
        out.append(
            f"rope_sections {list(spec.rope_sections)}: four values summing to at most head_dim "
            f"({spec.n_embd_head}) {why}"
        )
    return out


def metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """``rope.dimension_sections`` and ``n_deepstack_layers`` as the converter writes them."""
    a = spec.arch_name
    sections = TypedValue(GGUFValueType.ARRAY, list(spec.rope_sections), GGUFValueType.INT32)
    return [
        (Keys.LLM.ROPE_DIMENSION_SECTIONS.format(a), sections),
        (Keys.LLM.NUM_DEEPSTACK_LAYERS.format(a), u32(DEEPSTACK_LAYERS)),
    ]


RULES = rules(
    Arch.QWEN3VLMOE,
    SOURCE,
    experts=Experts.ALL,
    expert_width=ExpertWidth.EXPERT_KEY_OR_SPLIT,
    qk_norm=True,
    rope_sections=True,
    writer=WriterHooks(errors=errors, metadata=metadata),
    llama_cpp_keys=(
        Keys.LLM.ROPE_DIMENSION_SECTIONS,
        Keys.LLM.NUM_DEEPSTACK_LAYERS,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    ),
)
