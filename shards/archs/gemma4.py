"""gemma4 (Gemma 4 31B, 26B-A4B): sliding-window and full-attention layers of different head
widths and key/value head counts, Q/K/V norms, "proportional" RoPE on the full layers (by
``rope_freqs`` factors), GeGLU, and in MoE models routed experts beside the dense MLP.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer does for it: its
refusals, keys and block. Gemma 4's per-layer embeddings and shared key/value layers (E2B, E4B)
are not written (the runtime refuses them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from ggufswap.shards.archs._common import f32, u32
from ggufswap.shards.archs._rules import Experts, ExpertWidth, WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import GGUFValueType, TypedValue

if TYPE_CHECKING:
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards._roles import Role
    from ggufswap.shards.writer import ModelSpec

SOURCE = "llama_model_gemma4::load_arch_hparams/load_arch_tensors (src/models/gemma4.cpp)"
ROPE_BASE_SWA: Final = 10000.0  # Gemma 4's sliding layers' rope_theta, as the converter writes it
UNROTATED: Final = 1e30  # the converter's rope_freqs factor for a pair that does not rotate


def is_swa(spec: ModelSpec, block: int) -> bool:
    """Every ``full_attention_interval``-th block is full attention (Gemma 4: 6th)."""
    return (block + 1) % spec.full_attention_interval != 0


def head_swa(spec: ModelSpec) -> int:
    return spec.head_dim_swa if spec.head_dim_swa is not None else spec.n_embd_head


def kv_full(spec: ModelSpec) -> int:
    return spec.n_head_kv_full if spec.n_head_kv_full is not None else spec.n_head_kv


def rope_factors(spec: ModelSpec) -> list[float]:
    """``rope_freqs``: 1 for the ``rope_dim / 2`` rotating pairs of a full head, 1e30 for the
    others (Gemma4Model.generate_extra_tensors' "proportional" RoPE)."""
    pairs = spec.n_embd_head // 2
    return [1.0] * (spec.n_rot // 2) + [UNROTATED] * (pairs - spec.n_rot // 2)


def errors(spec: ModelSpec, why: str) -> list[str]:
    """Head shapes the graph divides, and the writer's one pattern."""
    out = []
    if spec.full_attention_interval < 1:
        out.append(f"full_attention_interval must be >= 1 {why}")
    if spec.n_rot % 2 or not 0 < spec.n_rot <= spec.n_embd_head:
        out.append(f"rope_dim {spec.n_rot} must be even and in (0, head_dim] {why}")
    if head_swa(spec) % 2 or spec.n_head % spec.n_head_kv or spec.n_head % kv_full(spec):
        out.append(f"head_dim_swa must be even and both kv head counts divide n_head {why}")
    if spec.moe_layers is not None or spec.shared_expert:
        out.append(f"gemma4 has experts in every block with the dense MLP beside them {why}")
    return out


def metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """The keys Gemma4Model.set_gguf_parameters writes (no per-layer embeddings, no shared KV
    layers): the layer pattern, both head widths and rotated dims, the key/value heads per
    layer, the local RoPE base, the window and the soft-capping."""
    a, k = spec.arch_name, Keys.LLM
    blocks = range(spec.n_blocks)
    pattern = [is_swa(spec, b) for b in blocks]
    kv_heads = [spec.n_head_kv if swa else kv_full(spec) for swa in pattern]
    out = [
        (k.SLIDING_WINDOW.format(a), u32(spec.sliding_window)),
        (
            k.SLIDING_WINDOW_PATTERN.format(a),
            TypedValue(GGUFValueType.ARRAY, pattern, GGUFValueType.BOOL),
        ),
        (k.SHARED_KV_LAYERS.format(a), u32(0)),
        (k.EMBEDDING_LENGTH_PER_LAYER.format(a), u32(0)),
        (k.KEY_LENGTH_SWA.format(a), u32(head_swa(spec))),
        (k.VALUE_LENGTH_SWA.format(a), u32(head_swa(spec))),
        (k.ROPE_DIMENSION_COUNT.format(a), u32(spec.n_embd_head)),
        (k.ROPE_DIMENSION_COUNT_SWA.format(a), u32(head_swa(spec))),
        (k.ROPE_FREQ_BASE_SWA.format(a), f32(ROPE_BASE_SWA)),
    ]
    if kv_full(spec) != spec.n_head_kv:
        array = TypedValue(GGUFValueType.ARRAY, kv_heads, GGUFValueType.INT32)
        out.append((k.HEAD_COUNT_KV.format(a), array))
    if spec.final_logit_softcap:
        out.append((k.FINAL_LOGIT_SOFTCAPPING.format(a), f32(spec.final_logit_softcap)))
    return out


def plan_block(spec: ModelSpec, b: int) -> list[PlannedTensor]:
    """One block as load_arch_tensors creates it (``rope_freqs`` before the first block)."""
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards._roles import Role

    e, swa = spec.n_embd, is_swa(spec, b)
    hd = head_swa(spec) if swa else spec.n_embd_head
    kv = (spec.n_head_kv if swa else kv_full(spec)) * hd
    shapes: list[tuple[Role, tuple[int, ...]]] = []
    if b == 0:
        shapes.append((Role.ROPE_FREQS, (spec.n_embd_head // 2,)))
    shapes += [(Role.ATTN_NORM, (e,)), (Role.ATTN_Q, (e, spec.n_head * hd)), (Role.ATTN_K, (e, kv))]
    if swa or not spec.attn_k_eq_v:
        shapes.append((Role.ATTN_V, (e, kv)))
    shapes += [
        (Role.ATTN_O, (spec.n_head * hd, e)),
        (Role.ATTN_Q_NORM, (hd,)),
        (Role.ATTN_K_NORM, (hd,)),
        (Role.ATTN_POST_NORM, (e,)),
        (Role.LAYER_OUT_SCALE, (1,)),
        (Role.FFN_NORM, (e,)),
        (Role.FFN_GATE, (e, spec.n_ff)),
        (Role.FFN_UP, (e, spec.n_ff)),
        (Role.FFN_DOWN, (spec.n_ff, e)),
        (Role.FFN_POST_NORM, (e,)),
    ]
    if spec.n_expert > 0:
        f, x = spec.n_ff_expert, spec.n_expert
        shapes += [
            (Role.FFN_GATE_INP, (e, x)),
            (Role.FFN_GATE_INP_SCALE, (e,)),
            (Role.FFN_PRE_NORM_2, (e,)),
            (Role.FFN_POST_NORM_1, (e,)),
            (Role.FFN_POST_NORM_2, (e,)),
            (Role.FFN_GATE_EXPS, (e, f, x)),
            (Role.FFN_UP_EXPS, (e, f, x)),
            (Role.FFN_DOWN_EXPS, (f, e, x)),
            (Role.FFN_DOWN_EXPS_SCALE, (x,)),
        ]
    return [PlannedTensor(r.tensor_name(b), r, spec.type_of(r), ne, b) for r, ne in shapes]


RULES = rules(
    Arch.GEMMA4,
    SOURCE,
    experts=Experts.ALL_OR_NONE,
    expert_width=ExpertWidth.EXPERT_KEY,
    qk_norm=True,
    post_norms=True,
    gemma=True,
    rope_freqs=True,
    writer=WriterHooks(
        errors=errors, metadata=metadata, block=plan_block, rope_factors=rope_factors
    ),
    per_layer_keys=(Keys.LLM.HEAD_COUNT_KV,),
    llama_cpp_keys=(
        Keys.LLM.SLIDING_WINDOW,
        Keys.LLM.SLIDING_WINDOW_PATTERN,
        Keys.LLM.SHARED_KV_LAYERS,
        Keys.LLM.EMBEDDING_LENGTH_PER_LAYER,
        Keys.LLM.ROPE_FREQ_BASE_SWA,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.FINAL_LOGIT_SOFTCAPPING,
    ),
)
