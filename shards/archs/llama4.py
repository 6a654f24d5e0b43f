"""llama4 (Llama 4 Scout / Maverick): chunked attention with NoPE layers (llama.cpp's iSWA
graph), routed experts with sigmoid weights applied before the expert and an ungated shared
expert in every ``interleave_moe_layer_step``-th block, dense SwiGLU in the others.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer does for it: its
refusals, keys and block. The writer writes no ``attention.sliding_window`` (llama.cpp then
attends in chunks of 8192 positions, as the converter's Llama 4 files do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.shards.archs._common import u32
from ggufswap.shards.archs._rules import (
    Experts,
    ExpertWidth,
    SharedExpert,
    WriterHooks,
    rules,
)
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import TypedValue

if TYPE_CHECKING:
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards._roles import Role
    from ggufswap.shards.writer import ModelSpec

SOURCE = "llama_model_llama4::load_arch_hparams/load_arch_tensors (src/models/llama4.cpp)"


def is_moe_block(spec: ModelSpec, block: int) -> bool:
    """load_arch_tensors: ``(i + 1) % interleave_moe_layer_step == 0``."""
    return (block + 1) % spec.moe_layer_step == 0


def errors(spec: ModelSpec, why: str) -> list[str]:
    """What the loader and graph refuse, and what the writer does not write."""
    out = []
    if spec.moe_layer_step < 1:
        out.append(f"moe_layer_step must be >= 1, found {spec.moe_layer_step} {why}")
    if spec.moe_layers is not None:
        out.append(f"llama4 places its experts by moe_layer_step, not moe_layers {why}")
    if spec.n_rot != spec.n_embd_head:
        out.append(f"llama4 rotates the whole head (GGML_ASSERT(n_embd_head == n_rot)) {why}")
    if spec.shared_expert:
        out.append(f"llama4's shared expert is always written: leave shared_expert unset {why}")
    return out


def metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """``interleave_moe_layer_step`` (required); the expert width is the shared writer's."""
    return [(Keys.LLM.INTERLEAVE_MOE_LAYER_STEP.format(spec.arch_name), u32(spec.moe_layer_step))]


def plan_block(spec: ModelSpec, b: int) -> list[PlannedTensor]:
    """One block as load_arch_tensors creates it: plain attention, then routed experts with a
    shared expert of their width, or a dense SwiGLU of ``n_ff``."""
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards._roles import Role

    e, hd = spec.n_embd, spec.n_embd_head
    q, kv = spec.n_head * hd, spec.n_head_kv * hd
    shapes: list[tuple[Role, tuple[int, ...]]] = [
        (Role.ATTN_NORM, (e,)),
        (Role.ATTN_Q, (e, q)),
        (Role.ATTN_K, (e, kv)),
        (Role.ATTN_V, (e, kv)),
        (Role.ATTN_O, (q, e)),
        (Role.FFN_NORM, (e,)),
    ]
    if is_moe_block(spec, b):
        f, x = spec.n_ff_expert, spec.n_expert
        shapes += [
            (Role.FFN_GATE_INP, (e, x)),
            (Role.FFN_GATE_EXPS, (e, f, x)),
            (Role.FFN_UP_EXPS, (e, f, x)),
            (Role.FFN_DOWN_EXPS, (f, e, x)),
            (Role.FFN_GATE_SHEXP, (e, f)),
            (Role.FFN_UP_SHEXP, (e, f)),
            (Role.FFN_DOWN_SHEXP, (f, e)),
        ]
    else:
        f = spec.n_ff
        shapes += [(Role.FFN_GATE, (e, f)), (Role.FFN_UP, (e, f)), (Role.FFN_DOWN, (f, e))]
    return [PlannedTensor(r.tensor_name(b), r, spec.type_of(r), ne, b) for r, ne in shapes]


RULES = rules(
    Arch.LLAMA4,
    SOURCE,
    experts=Experts.ALL,
    expert_width=ExpertWidth.EXPERT_KEY,
    shared_expert=SharedExpert.EXPERT_WIDTH,
    rope_freqs=True,
    rope_neox=False,
    rope_dims_equal_head=True,
    writer=WriterHooks(errors=errors, metadata=metadata, block=plan_block),
    llama_cpp_keys=(
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.INTERLEAVE_MOE_LAYER_STEP,
        Keys.LLM.SLIDING_WINDOW,
        Keys.LLM.SLIDING_WINDOW_PATTERN,
        Keys.LLM.ROPE_FREQ_BASE_SWA,
    ),
)
