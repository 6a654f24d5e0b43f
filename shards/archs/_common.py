"""What the writer shares between architectures' specs: typed values and the routing keys."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.shards.keys import Keys
from ggufswap.shards.value_types import GGUFValueType, TypedValue

if TYPE_CHECKING:
    from ggufswap.shards.writer import ModelSpec


def u32(v: int) -> TypedValue:
    return TypedValue(GGUFValueType.UINT32, v)


def f32(v: float) -> TypedValue:
    return TypedValue(GGUFValueType.FLOAT32, v)


def routing_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """The expert keys deepseek2's and glm4moe's loaders read."""
    a, llm, kv = spec.arch_name, Keys.LLM, []
    # Both required by load_arch_hparams, dense models included (the converter writes 0 shared).
    if spec.n_expert == 0:
        kv.append((llm.EXPERT_FEED_FORWARD_LENGTH.format(a), u32(spec.n_ff_expert)))
    shared = spec.n_expert_shared if spec.n_expert > 0 else 0
    kv.append((llm.EXPERT_SHARED_COUNT.format(a), u32(shared)))
    if spec.n_expert > 0:
        if spec.expert_weights_scale:
            kv.append((llm.EXPERT_WEIGHTS_SCALE.format(a), f32(spec.expert_weights_scale)))
        if spec.expert_weights_norm:
            kv.append((llm.EXPERT_WEIGHTS_NORM.format(a), TypedValue(GGUFValueType.BOOL, True)))
        if spec.expert_gating_func:
            kv.append((llm.EXPERT_GATING_FUNC.format(a), u32(spec.expert_gating_func)))
        if spec.n_expert_groups:
            kv += [
                (llm.EXPERT_GROUP_COUNT.format(a), u32(spec.n_expert_groups)),
                (llm.EXPERT_GROUP_USED_COUNT.format(a), u32(spec.n_group_used)),
            ]
    return kv
