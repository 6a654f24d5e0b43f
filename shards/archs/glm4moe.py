"""glm4moe: leading dense blocks, routed experts with a required selection bias,
optional Q/K/V biases and Q/K norms, NextN blocks.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer does for it: its
refusals and keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.shards.archs._common import routing_metadata, u32
from ggufswap.shards.archs._rules import Experts, ExpertWidth, SharedExpert, WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import TypedValue

if TYPE_CHECKING:
    from ggufswap.shards.writer import ModelSpec


def glm_errors(spec: ModelSpec, why: str) -> list[str]:
    """glm4moe's blocks as llama.cpp's loader and graph accept them."""
    a, errors = spec.arch_name, []
    if spec.n_expert <= 0:
        errors.append(f"{a} needs n_expert > 0 (llama.cpp asserts it) {why}")
    if spec.n_expert > 0 and not spec.expert_probs_bias:
        errors.append(f"{a} needs expert_probs_bias: exp_probs_b is required in MoE blocks {why}")
    if spec.n_rot % 2 or not 0 < spec.n_rot <= spec.n_embd_head:
        errors.append(f"rope_dim {spec.n_rot} must be even and in (0, head_dim] {why}")
    if spec.shared_expert != (spec.n_expert_shared > 0):
        errors.append(
            f"{a}: shared_expert ({spec.shared_expert}) must match n_expert_shared > 0 "
            f"({spec.n_expert_shared}) {why}"
        )
    if spec.expert_gating_func not in (0, 1, 2):
        errors.append(f"expert_gating_func must be 0 (unset), 1 (softmax) or 2 (sigmoid) {why}")
    return errors


def glm_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """glm4moe's keys, as llama.cpp's converter writes them (conversion/glm.py)."""
    a, llm = spec.arch_name, Keys.LLM
    kv = [
        (llm.LEADING_DENSE_BLOCK_COUNT.format(a), u32(spec.n_dense_lead)),
        (llm.ROPE_DIMENSION_COUNT.format(a), u32(spec.n_rot)),
        *routing_metadata(spec),
    ]
    if spec.n_nextn:
        kv.append((llm.NEXTN_PREDICT_LAYERS.format(a), u32(spec.n_nextn)))
    return kv


RULES = rules(
    Arch.GLM4MOE,
    "llama_model_glm4_moe::load_arch_hparams/load_arch_tensors (src/models/glm4-moe.cpp)",
    experts=Experts.AFTER_DENSE_LEAD,
    expert_width=ExpertWidth.EXPERT_KEY,
    shared_expert=SharedExpert.COUNTED_OPTIONAL,
    glm=True,
    norm_topk=False,
    writer=WriterHooks(errors=glm_errors, metadata=glm_metadata),
    llama_cpp_keys=(
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.EXPERT_GATING_FUNC,
        Keys.LLM.EXPERT_SHARED_COUNT,
        Keys.LLM.EXPERT_WEIGHTS_NORM,
        Keys.LLM.EXPERT_WEIGHTS_SCALE,
        Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
        Keys.LLM.ROPE_DIMENSION_SECTIONS,
    ),
)
