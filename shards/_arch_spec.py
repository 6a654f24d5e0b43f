"""The per-architecture part of the writer: what llama.cpp's loader accepts of a spec
(``shards.archs``), the tensors a spec implies (``plan``), deepseek2's and glm4moe's keys.

``shards.writer`` calls these; its ``plan_tensors`` is ``plan`` after checking the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from gguf import GGMLQuantizationType, GGUFValueType, Keys

from ggufswap.shards import ggml_types
from ggufswap.shards._gguf_encode import TypedValue
from ggufswap.shards._roles import Role
from ggufswap.shards.archs import Experts, SharedExpert, rules_of
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.keys import TensorNames, tensor_template

if TYPE_CHECKING:
    from ggufswap.shards._model_spec import ModelSpec


Q = GGMLQuantizationType


def _u32(v: int) -> TypedValue:
    return TypedValue(GGUFValueType.UINT32, v)


def _f32(v: float) -> TypedValue:
    return TypedValue(GGUFValueType.FLOAT32, v)


def mla_errors(spec: ModelSpec, why: str) -> list[str]:
    """deepseek2's latent attention and routing as llama.cpp's loader and graph accept them."""
    a, errors = spec.arch_name, []
    if spec.kv_lora_rank <= 0 or spec.q_lora_rank < 0:
        errors.append(f"{a} needs kv_lora_rank > 0 and q_lora_rank >= 0 {why}")
    if spec.n_rot % 2 or not 0 < spec.n_rot < spec.n_embd_head or spec.head_v <= 0:
        errors.append(
            f"{a} needs even rope dims below head_dim (non-rope dims >= 1) and v_head_dim > 0: "
            f"rope_dim {spec.n_rot}, head_dim {spec.n_embd_head}, v_head_dim {spec.head_v} {why}"
        )
    if spec.mla_split and spec.n_head_kv != 1:
        errors.append(
            f"{a} with attn_k_b/attn_v_b has one key/value head: n_head_kv must be 1 {why}"
        )
    if not spec.mla_split and spec.n_head_kv != spec.n_head:
        errors.append(f"{a} with attn_kv_b is multi-head: n_head_kv must equal n_head {why}")
    if spec.expert_gating_func not in (0, 1, 2):
        errors.append(f"expert_gating_func must be 0 (unset), 1 (softmax) or 2 (sigmoid) {why}")
    g, used = spec.n_expert_groups, spec.n_group_used
    if g > 1 and not (spec.n_expert % g == 0 and spec.n_expert // g >= 2 and 0 < used < g):
        errors.append(
            f"expert groups: n_expert ({spec.n_expert}) must split into {g} groups of >= 2 and "
            f"0 < n_group_used ({used}) < {g} {why}"
        )
    if spec.n_expert > 0 and spec.n_expert_shared <= 0:
        errors.append(f"{a} needs n_expert_shared > 0 in an MoE model {why}")
    return errors


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


def head_lengths(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """``attention.key_length`` / ``value_length``: the head width, or deepseek2's as its
    converter writes them (attn_k_b/attn_v_b: the latent head, kv_lora_rank + rope dims and
    kv_lora_rank; attn_kv_b: the decompressed heads)."""
    a, att = spec.arch_name, Keys.Attention
    key, value = spec.n_embd_head, spec.n_embd_head
    if rules_of(spec.arch).mla:
        if spec.mla_split:
            key, value = spec.kv_lora_rank + spec.n_rot, spec.kv_lora_rank
        else:
            value = spec.head_v
    return [
        (att.KEY_LENGTH.format(arch=a), _u32(key)),
        (att.VALUE_LENGTH.format(arch=a), _u32(value)),
    ]


def mla_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """deepseek2's keys, as llama.cpp's converter writes them (conversion/deepseek.py)."""
    a, llm, att, rope = spec.arch_name, Keys.LLM, Keys.Attention, Keys.Rope
    kv = [
        (llm.LEADING_DENSE_BLOCK_COUNT.format(arch=a), _u32(spec.n_dense_lead)),
        (att.Q_LORA_RANK.format(arch=a), _u32(spec.q_lora_rank)),
        (att.KV_LORA_RANK.format(arch=a), _u32(spec.kv_lora_rank)),
    ]
    if spec.mla_split:
        kv += [
            (att.KEY_LENGTH_MLA.format(arch=a), _u32(spec.n_embd_head)),
            (att.VALUE_LENGTH_MLA.format(arch=a), _u32(spec.head_v)),
        ]
    kv.append((rope.DIMENSION_COUNT.format(arch=a), _u32(spec.n_rot)))
    kv += _routing_metadata(spec)
    if spec.rope_scaling is not None:
        kv += [
            (rope.SCALING_TYPE.format(arch=a), TypedValue(GGUFValueType.STRING, spec.rope_scaling)),
            (rope.SCALING_FACTOR.format(arch=a), _f32(spec.rope_scaling_factor)),
        ]
    if spec.rope_orig_ctx:
        kv.append((rope.SCALING_ORIG_CTX_LEN.format(arch=a), _u32(spec.rope_orig_ctx)))
    if spec.yarn_log_mul:
        kv.append((rope.SCALING_YARN_LOG_MUL.format(arch=a), _f32(spec.yarn_log_mul)))
    return kv


def glm_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """glm4moe's keys, as llama.cpp's converter writes them (conversion/glm.py)."""
    a, llm = spec.arch_name, Keys.LLM
    kv = [
        (llm.LEADING_DENSE_BLOCK_COUNT.format(arch=a), _u32(spec.n_dense_lead)),
        (Keys.Rope.DIMENSION_COUNT.format(arch=a), _u32(spec.n_rot)),
        *_routing_metadata(spec),
    ]
    if spec.n_nextn:
        kv.append((llm.NEXTN_PREDICT_LAYERS.format(arch=a), _u32(spec.n_nextn)))
    return kv


def _routing_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """The expert keys deepseek2's and glm4moe's loaders read."""
    a, llm, kv = spec.arch_name, Keys.LLM, []
    # Both required by load_arch_hparams, dense models included (the converter writes 0 shared).
    if spec.n_expert == 0:
        kv.append((llm.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), _u32(spec.n_ff_expert)))
    shared = spec.n_expert_shared if spec.n_expert > 0 else 0
    kv.append((llm.EXPERT_SHARED_COUNT.format(arch=a), _u32(shared)))
    if spec.n_expert > 0:
        if spec.expert_weights_scale:
            kv.append((llm.EXPERT_WEIGHTS_SCALE.format(arch=a), _f32(spec.expert_weights_scale)))
        if spec.expert_weights_norm:
            kv.append(
                (llm.EXPERT_WEIGHTS_NORM.format(arch=a), TypedValue(GGUFValueType.BOOL, True))
            )
        if spec.expert_gating_func:
            kv.append((llm.EXPERT_GATING_FUNC.format(arch=a), _u32(spec.expert_gating_func)))
        if spec.n_expert_groups:
            kv += [
                (llm.EXPERT_GROUP_COUNT.format(arch=a), _u32(spec.n_expert_groups)),
                (llm.EXPERT_GROUP_USED_COUNT.format(arch=a), _u32(spec.n_group_used)),
            ]
    return kv


def llama_cpp_errors(spec: ModelSpec) -> list[str]:
    """What llama.cpp's loader would refuse in a file of this spec (``shards.archs``)."""
    rules, a = rules_of(spec.arch), spec.arch_name
    why = f"(llama.cpp: {rules.source})"
    errors = []
    if rules.experts is Experts.NONE and spec.n_expert:
        errors.append(f"{a} is dense: n_expert must be 0, found {spec.n_expert} {why}")
    if rules.experts is Experts.ALL and spec.n_expert <= 0:
        errors.append(f"{a} needs n_expert > 0: every {a} block is MoE {why}")
    lead = rules.experts is Experts.AFTER_DENSE_LEAD
    if (
        lead
        and spec.n_expert > 0
        and spec.moe_blocks != tuple(range(spec.n_dense_lead, spec.n_blocks))
    ):
        errors.append(
            f"{a} has experts in blocks n_dense_lead.. only: moe_layers {list(spec.moe_blocks)} "
            f"would be refused {why}"
        )
    if not lead and spec.n_dense_lead:
        errors.append(f"{a} has no leading dense blocks: n_dense_lead must be 0 {why}")
    if rules.mla:
        errors += mla_errors(spec, why)
    if rules.glm:
        errors += glm_errors(spec, why)
    elif spec.n_nextn or spec.attn_bias or spec.attn_qk_norm:
        errors.append(f"n_nextn / attn_bias / attn_qk_norm are glm4moe's {why}")
    if not lead and spec.n_expert > 0 and len(spec.moe_blocks) != spec.n_layers:
        errors.append(
            f"{a} has experts in every block or in none: moe_layers {list(spec.moe_blocks)} "
            f"of {spec.n_layers} blocks would be refused {why}"
        )
    if spec.n_expert > 0 and rules.shared_expert is SharedExpert.NONE and spec.shared_expert:
        errors.append(
            f"{a} has no shared expert: llama.cpp refuses the ffn_*_shexp tensors "
            f"(wrong number of tensors) {why}"
        )
    counted = rules.shared_expert is SharedExpert.COUNTED and spec.n_expert > 0
    if (rules.shared_expert is SharedExpert.REQUIRED or counted) and not spec.shared_expert:
        errors.append(f"{a} needs shared_expert: llama.cpp requires ffn_*_shexp tensors {why}")
    if spec.tied_output and not rules.tied_output:
        errors.append(f"{a} cannot tie its output: llama.cpp requires output.weight {why}")
    fixed_head = spec.n_head > 0 and not rules.free_head_dim
    if fixed_head and (spec.n_embd % spec.n_head or spec.n_embd_head * spec.n_head != spec.n_embd):
        errors.append(
            f"{a} needs head_dim = n_embd / n_head ({spec.n_embd} / {spec.n_head}): llama.cpp "
            f"sizes attn_q as {{n_embd, n_embd}}, found head_dim {spec.n_embd_head} {why}"
        )
    return errors


def rope_freqs_errors(spec: ModelSpec) -> list[str]:
    """A Llama 3.1 RoPE scaling spec llama.cpp would refuse, or that has no factors to write."""
    if spec.rope_llama3_factor <= 0:
        return []
    rules, errors = rules_of(spec.arch), []
    if not rules.rope_freqs:
        errors.append(
            f"{spec.arch_name} has no rope_freqs tensor: llama.cpp refuses the file (wrong "
            f"number of tensors; {rules.source}); rope_llama3_factor needs arch llama"
        )
    if spec.rope_llama3_high_freq_factor <= spec.rope_llama3_low_freq_factor:
        errors.append(
            f"rope_llama3_high_freq_factor {spec.rope_llama3_high_freq_factor} must exceed "
            f"rope_llama3_low_freq_factor {spec.rope_llama3_low_freq_factor}"
        )
    if spec.rope_llama3_original_context <= 0:
        errors.append(
            f"rope_llama3_original_context must be > 0, found {spec.rope_llama3_original_context}"
        )
    return errors


# --- the tensor plan ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One tensor the spec implies: llama.cpp name, role, type, ``ne`` (ggml order)."""

    name: str
    role: Role
    ggml_type: GGMLQuantizationType | GGMLType
    ne: tuple[int, ...]
    block: int | None
    expert: int | None = None  # per-expert tensor (old Mixtral layout): its expert index

    @property
    def nbytes(self) -> int:
        return ggml_types.tensor_nbytes(self.ggml_type, self.ne)


def plan(spec: ModelSpec) -> tuple[PlannedTensor, ...]:
    """The tensors of ``spec`` in file order, with llama.cpp's names and ``ne`` shapes (``spec``
    not checked: ``writer.plan_tensors`` checks it first)."""
    e, hd, rules = spec.n_embd, spec.n_embd_head, rules_of(spec.arch)
    out: list[PlannedTensor] = []

    def add(role: Role, ne: tuple[int, ...], block: int | None = None) -> None:
        out.append(PlannedTensor(role.tensor_name(block), role, spec.type_of(role), ne, block))

    def add_bias(role: Role, ne: tuple[int, ...], block: int) -> None:
        name = tensor_template(role.value, "bias").format(block)
        out.append(PlannedTensor(name, role, Q.F32, ne, block))

    if spec.rope_llama3_factor > 0:  # first, where llama.cpp's converter writes it
        add(Role.ROPE_FREQS, (hd // 2,))
    add(Role.TOKEN_EMBD, (e, spec.vocab_size))
    for b in range(spec.n_blocks):
        if rules.gpt_oss:
            out.extend(_gpt_oss_block(spec, b))
            continue
        add(Role.ATTN_NORM, (e,), b)
        if rules.mla:
            _plan_mla(spec, add, b)
        else:
            add(Role.ATTN_Q, (e, spec.n_head * hd), b)
            add(Role.ATTN_K, (e, spec.n_head_kv * hd), b)
            add(Role.ATTN_V, (e, spec.n_head_kv * hd), b)
            add(Role.ATTN_O, (spec.n_head * hd, e), b)
        if spec.attn_bias:  # glm4moe
            add_bias(Role.ATTN_Q, (spec.n_head * hd,), b)
            add_bias(Role.ATTN_K, (spec.n_head_kv * hd,), b)
            add_bias(Role.ATTN_V, (spec.n_head_kv * hd,), b)
        if rules.qk_norm or spec.attn_qk_norm:
            add(Role.ATTN_Q_NORM, (hd,), b)
            add(Role.ATTN_K_NORM, (hd,), b)
        if rules.post_norms:
            add(Role.ATTN_POST_NORM, (e,), b)
            add(Role.FFN_POST_NORM, (e,), b)
        # glm4moe: attn_post_norm is the FFN's pre-norm
        add(Role.ATTN_POST_NORM if rules.glm else Role.FFN_NORM, (e,), b)
        if b >= spec.n_layers:  # glm4moe's NextN/MTP block
            add(Role.NEXTN_EH_PROJ, (2 * e, e), b)
            add(Role.NEXTN_ENORM, (e,), b)
            add(Role.NEXTN_HNORM, (e,), b)
            add(Role.NEXTN_SHARED_HEAD_NORM, (e,), b)
        if b in spec.moe_blocks and spec.per_expert_tensors:
            add(Role.FFN_GATE_INP, (e, spec.n_expert), b)
            out.extend(_per_expert_tensors(spec, b))
        elif b in spec.moe_blocks:
            _plan_moe_ffn(spec, add, b)
        else:
            add(Role.FFN_GATE, (e, spec.n_ff), b)
            add(Role.FFN_UP, (e, spec.n_ff), b)
            add(Role.FFN_DOWN, (spec.n_ff, e), b)
    add(Role.OUTPUT_NORM, (e,))
    if not spec.tied_output:
        add(Role.OUTPUT, (e, spec.vocab_size))
    return tuple(out)


def _plan_moe_ffn(spec: ModelSpec, add: Any, b: int) -> None:
    """The routed experts (stacked) of block ``b``, with their shared experts if any."""
    e, f, x = spec.n_embd, spec.n_ff_expert, spec.n_expert
    add(Role.FFN_GATE_INP, (e, x), b)
    if spec.expert_probs_bias:
        add(Role.FFN_EXP_PROBS_B, (x,), b)
    add(Role.FFN_GATE_EXPS, (e, f, x), b)
    add(Role.FFN_UP_EXPS, (e, f, x), b)
    add(Role.FFN_DOWN_EXPS, (f, e, x), b)
    counted = (SharedExpert.COUNTED, SharedExpert.COUNTED_OPTIONAL)
    if spec.shared_expert and rules_of(spec.arch).shared_expert in counted:
        s = f * spec.n_expert_shared  # ungated, fused shared experts
        add(Role.FFN_GATE_SHEXP, (e, s), b)
        add(Role.FFN_UP_SHEXP, (e, s), b)
        add(Role.FFN_DOWN_SHEXP, (s, e), b)
    elif spec.shared_expert:
        s = spec.n_ff_shexp
        add(Role.FFN_GATE_INP_SHEXP, (e,), b)
        add(Role.FFN_GATE_SHEXP, (e, s), b)
        add(Role.FFN_UP_SHEXP, (e, s), b)
        add(Role.FFN_DOWN_SHEXP, (s, e), b)


def _plan_mla(spec: ModelSpec, add: Any, b: int) -> None:
    """deepseek2's attention tensors of block ``b`` (llama_model_deepseek2::load_arch_tensors)."""
    e, h, rank, rot = spec.n_embd, spec.n_head, spec.kv_lora_rank, spec.n_rot
    nope, v = spec.n_embd_head - rot, spec.head_v
    if spec.q_lora_rank > 0:
        add(Role.ATTN_Q_A_NORM, (spec.q_lora_rank,), b)
    add(Role.ATTN_KV_A_NORM, (rank,), b)
    if spec.q_lora_rank > 0:
        add(Role.ATTN_Q_A, (e, spec.q_lora_rank), b)
        add(Role.ATTN_Q_B, (spec.q_lora_rank, h * spec.n_embd_head), b)
    else:
        add(Role.ATTN_Q, (e, h * spec.n_embd_head), b)
    add(Role.ATTN_KV_A_MQA, (e, rank + rot), b)
    if spec.mla_split:
        add(Role.ATTN_K_B, (nope, rank, h), b)
        add(Role.ATTN_V_B, (rank, v, h), b)
    else:
        add(Role.ATTN_KV_B, (rank, h * (nope + v)), b)
    add(Role.ATTN_O, (h * v, e), b)


def _gpt_oss_block(spec: ModelSpec, b: int) -> list[PlannedTensor]:
    """One gpt-oss block as llama_model_openai_moe::load_arch_tensors creates it: biased
    attention with sinks, post_attention_norm (the FFN's input norm), a biased router and biased
    experts."""
    e, hd, f, x = spec.n_embd, spec.n_embd_head, spec.n_ff_expert, spec.n_expert
    q, kv = spec.n_head * hd, spec.n_head_kv * hd
    shapes = (
        (Role.ATTN_NORM, (e,)),
        (Role.ATTN_Q, (e, q)),
        (Role.ATTN_Q_BIAS, (q,)),
        (Role.ATTN_K, (e, kv)),
        (Role.ATTN_K_BIAS, (kv,)),
        (Role.ATTN_V, (e, kv)),
        (Role.ATTN_V_BIAS, (kv,)),
        (Role.ATTN_O, (q, e)),
        (Role.ATTN_O_BIAS, (e,)),
        (Role.ATTN_SINKS, (spec.n_head,)),
        (Role.ATTN_POST_NORM, (e,)),
        (Role.FFN_GATE_INP, (e, x)),
        (Role.FFN_GATE_INP_BIAS, (x,)),
        (Role.FFN_GATE_EXPS, (e, f, x)),
        (Role.FFN_GATE_EXPS_BIAS, (f, x)),
        (Role.FFN_UP_EXPS, (e, f, x)),
        (Role.FFN_UP_EXPS_BIAS, (f, x)),
        (Role.FFN_DOWN_EXPS, (f, e, x)),
        (Role.FFN_DOWN_EXPS_BIAS, (e, x)),
    )
    return [PlannedTensor(r.tensor_name(b), r, spec.type_of(r), ne, b) for r, ne in shapes]


# Old Mixtral layout: per-expert tensor names by the stacked role they slice.
_PER_EXPERT_NAMES: Final = {
    Role.FFN_GATE_EXPS: TensorNames.FFN_GATE_EXPERT,
    Role.FFN_UP_EXPS: TensorNames.FFN_UP_EXPERT,
    Role.FFN_DOWN_EXPS: TensorNames.FFN_DOWN_EXPERT,
}


def _per_expert_tensors(spec: ModelSpec, block: int) -> list[PlannedTensor]:
    """Block ``block``'s experts as one tensor each, in the old Mixtral order (by expert, then
    gate, down, up as llama.cpp's old converter wrote them)."""
    e, f = spec.n_embd, spec.n_ff_expert
    shapes = {Role.FFN_GATE_EXPS: (e, f), Role.FFN_DOWN_EXPS: (f, e), Role.FFN_UP_EXPS: (e, f)}
    return [
        PlannedTensor(
            _PER_EXPERT_NAMES[role].format(block, x), role, spec.type_of(role), ne, block, x
        )
        for x in range(spec.n_expert)
        for role, ne in shapes.items()
    ]
