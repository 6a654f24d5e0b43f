"""The architecture-dependent part of the writer: what llama.cpp's loader accepts of a spec
(``shards.archs``: the shared rules, then each architecture's own ``WriterHooks.errors``), and the
tensors a spec implies (``plan``: the shared block, or an architecture's own attention or block).

``shards.writer`` calls these; its ``plan_tensors`` is ``plan``, computed once per spec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from gguf import GGMLQuantizationType, Keys

from ggufswap.shards._gguf_encode import TypedValue
from ggufswap.shards._planned import PlannedTensor
from ggufswap.shards._roles import Role, tensor_template
from ggufswap.shards.archs import Experts, SharedExpert, rules_of
from ggufswap.shards.archs._common import u32
from ggufswap.shards.keys import TensorNames

if TYPE_CHECKING:
    from ggufswap.shards.writer import ModelSpec


Q = GGMLQuantizationType


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
        (att.KEY_LENGTH.format(arch=a), u32(key)),
        (att.VALUE_LENGTH.format(arch=a), u32(value)),
    ]


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
    errors += rules.writer.errors(spec, why)
    if not rules.glm and (spec.n_nextn or spec.attn_bias or spec.attn_qk_norm):
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


def plan(spec: ModelSpec) -> tuple[PlannedTensor, ...]:
    """The tensors of ``spec`` in file order, with llama.cpp's names and ``ne`` shapes (``spec``
    not checked: ``writer.plan_tensors`` checks it first)."""
    e, hd = spec.n_embd, spec.n_embd_head
    out: list[PlannedTensor] = []

    def add(role: Role, ne: tuple[int, ...], block: int | None = None) -> None:
        out.append(PlannedTensor(role.tensor_name(block), role, spec.type_of(role), ne, block))

    if spec.rope_llama3_factor > 0:  # first, where llama.cpp's converter writes it
        add(Role.ROPE_FREQS, (hd // 2,))
    add(Role.TOKEN_EMBD, (e, spec.vocab_size))
    for b in range(spec.n_blocks):
        _plan_block(spec, add, out, b)
    add(Role.OUTPUT_NORM, (e,))
    if not spec.tied_output:
        add(Role.OUTPUT, (e, spec.vocab_size))
    return tuple(out)


def _plan_block(spec: ModelSpec, add: Any, out: list[PlannedTensor], b: int) -> None:
    """Block ``b``'s tensors: the architecture's own block or attention where it has one, else
    llama's attention, its norms, and the block's FFN (dense, stacked experts or per-expert)."""
    e, hd, rules = spec.n_embd, spec.n_embd_head, rules_of(spec.arch)
    if rules.writer.block is not None:
        out.extend(rules.writer.block(spec, b))
        return
    add(Role.ATTN_NORM, (e,), b)
    if rules.writer.attention is not None:
        rules.writer.attention(spec, add, b)
    else:
        add(Role.ATTN_Q, (e, spec.n_head * hd), b)
        add(Role.ATTN_K, (e, spec.n_head_kv * hd), b)
        add(Role.ATTN_V, (e, spec.n_head_kv * hd), b)
        add(Role.ATTN_O, (spec.n_head * hd, e), b)
    if spec.attn_bias:  # glm4moe
        for role, width in (
            (Role.ATTN_Q, spec.n_head * hd),
            (Role.ATTN_K, spec.n_head_kv * hd),
            (Role.ATTN_V, spec.n_head_kv * hd),
        ):
            name = tensor_template(role.value, "bias").format(b)
            out.append(PlannedTensor(name, role, Q.F32, (width,), b))
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
