"""qwen35 (Qwen3.5 / 3.6 dense): gated delta-net blocks beside gated full attention.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer does for it: its
refusals, keys and blocks. qwen35moe and qwen3next (``shards.archs.qwen35moe`` /
``qwen3next``) share the hooks: only the FFN, the beta/alpha tensors and the RoPE differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.shards.archs._common import u32
from ggufswap.shards.archs._rules import WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import GGUFValueType, TypedValue

if TYPE_CHECKING:
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards._roles import Role
    from ggufswap.shards.writer import ModelSpec

SOURCE = "llama_model_qwen35::load_arch_hparams/load_arch_tensors (src/models/qwen35.cpp)"
# What the three hybrid loaders read (load_arch_hparams) that changes what they compute.
HYBRID_LLAMA_CPP_KEYS = (
    Keys.LLM.SSM_CONV_KERNEL,
    Keys.LLM.SSM_INNER_SIZE,
    Keys.LLM.SSM_STATE_SIZE,
    Keys.LLM.SSM_TIME_STEP_RANK,
    Keys.LLM.SSM_GROUP_COUNT,
    Keys.LLM.ATTENTION_RECURRENT_LAYERS,
    Keys.LLM.FULL_ATTENTION_INTERVAL,
)


def is_recurrent(spec: ModelSpec, block: int) -> bool:
    """Whether ``block`` is a delta-net block: llama.cpp's default pattern (every
    ``full_attention_interval``-th block is full attention), which the writer writes."""
    return block < spec.n_layers and (block + 1) % spec.full_attention_interval != 0


def hybrid_errors(spec: ModelSpec, why: str) -> list[str]:
    """What llama.cpp's hybrid loaders and graphs refuse (delta-net and attention shapes)."""
    a, errors = spec.arch_name, []
    if min(spec.ssm_conv_kernel, spec.ssm_state_size, spec.ssm_k_heads, spec.ssm_v_heads) <= 0:
        errors.append(f"{a} needs ssm_conv_kernel, ssm_state_size and the head counts > 0 {why}")
    elif spec.ssm_v_heads % spec.ssm_k_heads:
        errors.append(
            f"{a}: ssm_v_heads ({spec.ssm_v_heads}) must be a multiple of ssm_k_heads "
            f"({spec.ssm_k_heads}) (GGML_ASSERT(num_v_heads % num_k_heads == 0)) {why}"
        )
    if spec.n_rot % 2 or not 0 < spec.n_rot <= spec.n_embd_head:
        errors.append(f"rope_dim {spec.n_rot} must be even and in (0, head_dim] {why}")
    if spec.full_attention_interval < 1:
        errors.append(f"full_attention_interval must be >= 1 {why}")
    if spec.n_nextn:
        errors.append(f"{a}: the writer writes no MTP blocks (n_nextn) {why}")
    return errors


def qwen35_errors(spec: ModelSpec, why: str) -> list[str]:
    """qwen35 / qwen35moe: the hybrid rules and the required multimodal RoPE sections, whose
    sum ggml asserts to be at most the head width."""
    errors = hybrid_errors(spec, why)
    if len(spec.rope_sections) != 4 or sum(spec.rope_sections) > spec.n_embd_head:
        errors.append(
            f"rope_sections {list(spec.rope_sections)}: four values summing to at most head_dim "
            f"({spec.n_embd_head}) (GGML_ASSERT(sect_dims <= ne0)) {why}"
        )
    return errors


def hybrid_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """The delta-net keys as llama.cpp's converter writes them (conversion/qwen.py,
    Qwen3NextModel.set_gguf_parameters)."""
    a, k = spec.arch_name, Keys.LLM
    return [
        (k.SSM_CONV_KERNEL.format(a), u32(spec.ssm_conv_kernel)),
        (k.SSM_STATE_SIZE.format(a), u32(spec.ssm_state_size)),
        (k.SSM_GROUP_COUNT.format(a), u32(spec.ssm_k_heads)),
        (k.SSM_TIME_STEP_RANK.format(a), u32(spec.ssm_v_heads)),
        (k.SSM_INNER_SIZE.format(a), u32(spec.ssm_state_size * spec.ssm_v_heads)),
        (k.FULL_ATTENTION_INTERVAL.format(a), u32(spec.full_attention_interval)),
        (k.ROPE_DIMENSION_COUNT.format(a), u32(spec.n_rot)),
    ]


def qwen35_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """The hybrid keys and ``rope.dimension_sections`` (required by qwen35 / qwen35moe)."""
    sections = Keys.LLM.ROPE_DIMENSION_SECTIONS.format(spec.arch_name)
    array = TypedValue(GGUFValueType.ARRAY, list(spec.rope_sections), GGUFValueType.INT32)
    return [*hybrid_metadata(spec), (sections, array)]


def plan_block(spec: ModelSpec, b: int) -> list[PlannedTensor]:
    """One block as llama_model_qwen35(moe)::load_arch_tensors / llama_model_qwen3next create
    it: the delta-net or gated-attention tensors, then the dense or routed FFN."""
    from ggufswap.shards._planned import PlannedTensor
    from ggufswap.shards._roles import Role

    e, hd = spec.n_embd, spec.n_embd_head
    shapes: list[tuple[Role, tuple[int, ...]]] = [(Role.ATTN_NORM, (e,))]
    if is_recurrent(spec, b):
        key_dim, value_dim = (
            spec.ssm_state_size * spec.ssm_k_heads,
            spec.ssm_state_size * spec.ssm_v_heads,
        )
        heads = spec.ssm_v_heads
        shapes += [
            (Role.ATTN_QKV, (e, 2 * key_dim + value_dim)),
            (Role.ATTN_GATE, (e, value_dim)),
            (Role.SSM_CONV1D, (spec.ssm_conv_kernel, 2 * key_dim + value_dim)),
            (Role.SSM_DT_BIAS, (heads,)),
            (Role.SSM_A, (heads,)),
        ]
        if spec.arch is Arch.QWEN3NEXT:
            shapes.append((Role.SSM_BETA_ALPHA, (e, 2 * heads)))
        else:
            shapes += [(Role.SSM_BETA, (e, heads)), (Role.SSM_ALPHA, (e, heads))]
        shapes += [(Role.SSM_NORM, (spec.ssm_state_size,)), (Role.SSM_OUT, (value_dim, e))]
    else:
        q, kv = spec.n_head * hd, spec.n_head_kv * hd
        shapes += [
            (Role.ATTN_Q, (e, 2 * q)),  # each head's query, then its output gate
            (Role.ATTN_K, (e, kv)),
            (Role.ATTN_V, (e, kv)),
            (Role.ATTN_O, (q, e)),
            (Role.ATTN_Q_NORM, (hd,)),
            (Role.ATTN_K_NORM, (hd,)),
        ]
    shapes.append((Role.ATTN_POST_NORM, (e,)))
    if spec.n_expert > 0:
        f, x, s = spec.n_ff_expert, spec.n_expert, spec.n_ff_shexp
        shapes += [
            (Role.FFN_GATE_INP, (e, x)),
            (Role.FFN_GATE_EXPS, (e, f, x)),
            (Role.FFN_UP_EXPS, (e, f, x)),
            (Role.FFN_DOWN_EXPS, (f, e, x)),
            (Role.FFN_GATE_INP_SHEXP, (e,)),
            (Role.FFN_GATE_SHEXP, (e, s)),
            (Role.FFN_UP_SHEXP, (e, s)),
            (Role.FFN_DOWN_SHEXP, (s, e)),
        ]
    else:
        f = spec.n_ff
        shapes += [(Role.FFN_GATE, (e, f)), (Role.FFN_UP, (e, f)), (Role.FFN_DOWN, (f, e))]
    return [PlannedTensor(r.tensor_name(b), r, spec.type_of(r), ne, b) for r, ne in shapes]


WRITER = WriterHooks(errors=qwen35_errors, metadata=qwen35_metadata, block=plan_block)

RULES = rules(
    Arch.QWEN35,
    SOURCE,
    qk_norm=True,
    rope_sections=True,
    hybrid=True,
    writer=WRITER,
    llama_cpp_keys=(*HYBRID_LLAMA_CPP_KEYS, Keys.LLM.ROPE_DIMENSION_SECTIONS),
)
