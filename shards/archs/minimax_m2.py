"""minimax-m2 (MiniMax-M2, M2.1, M2.5): routed experts in every block (sigmoid gating with the
``exp_probs_b`` selection bias, renormalised), Q/K RMS norms over all heads at once, partial
NEOX RoPE.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer does for it: its
refusals, keys and block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.shards.archs._common import u32
from ggufswap.shards.archs._rules import Experts, ExpertWidth, WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import TypedValue

if TYPE_CHECKING:
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards.writer import ModelSpec

SOURCE = "llama_model_minimax_m2::load_arch_hparams/load_arch_tensors (src/models/minimax-m2.cpp)"
# build_moe_ffn's gating functions the decoder implements (llama_expert_gating_func_type).
GATING_SOFTMAX, GATING_SIGMOID = 1, 2


def errors(spec: ModelSpec, why: str) -> list[str]:
    """The selection bias is created without TENSOR_NOT_REQUIRED, and build_moe_ffn aborts on a
    gating function it does not know (0: the key absent)."""
    out = []
    if not spec.expert_probs_bias:
        out.append(f"minimax-m2 needs expert_probs_bias: blk.N.exp_probs_b is required {why}")
    if spec.expert_gating_func not in (GATING_SOFTMAX, GATING_SIGMOID):
        out.append(
            f"minimax-m2 needs expert_gating_func 1 (softmax) or 2 (sigmoid), found "
            f"{spec.expert_gating_func} (build_moe_ffn aborts without one) {why}"
        )
    if spec.n_expert_groups:
        out.append(f"minimax-m2 has no expert groups (n_expert_groups) {why}")
    if spec.n_rot % 2 or not 0 < spec.n_rot <= spec.n_embd_head:
        out.append(f"rope_dim {spec.n_rot} must be even and in (0, head_dim] {why}")
    return out


def metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """As MiniMaxM2Model writes them: the experts' width under both keys (llama.cpp sizes the
    experts by feed_forward_length and requires expert_feed_forward_length), the gating function
    and the rotated dims."""
    a, k = spec.arch_name, Keys.LLM
    return [
        (k.EXPERT_FEED_FORWARD_LENGTH.format(a), u32(spec.n_ff_expert)),
        (k.EXPERT_GATING_FUNC.format(a), u32(spec.expert_gating_func)),
        (k.ROPE_DIMENSION_COUNT.format(a), u32(spec.n_rot)),
    ]


def plan_block(spec: ModelSpec, b: int) -> list[PlannedTensor]:
    """One block as load_arch_tensors creates it: Q/K norms as wide as all query / key heads."""
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards._roles import Role

    e, hd, f, x = spec.n_embd, spec.n_embd_head, spec.n_ff_expert, spec.n_expert
    q, kv = spec.n_head * hd, spec.n_head_kv * hd
    shapes = (
        (Role.ATTN_NORM, (e,)),
        (Role.ATTN_Q, (e, q)),
        (Role.ATTN_K, (e, kv)),
        (Role.ATTN_V, (e, kv)),
        (Role.ATTN_O, (q, e)),
        (Role.ATTN_Q_NORM, (q,)),
        (Role.ATTN_K_NORM, (kv,)),
        (Role.FFN_NORM, (e,)),
        (Role.FFN_GATE_INP, (e, x)),
        (Role.FFN_EXP_PROBS_B, (x,)),
        (Role.FFN_GATE_EXPS, (e, f, x)),
        (Role.FFN_UP_EXPS, (e, f, x)),
        (Role.FFN_DOWN_EXPS, (f, e, x)),
    )
    return [PlannedTensor(r.tensor_name(b), r, spec.type_of(r), ne, b) for r, ne in shapes]


RULES = rules(
    Arch.MINIMAX_M2,
    SOURCE,
    experts=Experts.ALL,
    expert_width=ExpertWidth.FEED_FORWARD_LENGTH,
    tied_output=False,
    writer=WriterHooks(errors=errors, metadata=metadata, block=plan_block),
    llama_cpp_keys=(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, Keys.LLM.EXPERT_GATING_FUNC),
)
