"""``ModelSpec``: a small llama.cpp model to write, and every check that it is one.

A spec names the architecture, its dimensions and a GGML type per tensor role; 0/None fields
resolve through properties (``n_embd_head``...). A spec that llama.cpp's loader would refuse
(``shards.archs``), or whose tensors a type cannot hold (a row length not a multiple of the
block size), is refused at construction with every reason. ``shards/writer.py`` writes it;
``shards/_arch_spec.py`` plans its tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from gguf import GGMLQuantizationType

from ggufswap.shards import ggml_types
from ggufswap.shards._arch_spec import llama_cpp_errors, plan, rope_freqs_errors
from ggufswap.shards._planned import PlannedTensor
from ggufswap.shards._roles import (
    ACCEPTED_TYPES,
    DEFAULT_TYPES,
    F32_ONLY_ROLES,
    Role,
    parse_any_type,
    parse_role,
)
from ggufswap.shards.archs import rules_of
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.keys import Arch

__all__ = ["ModelSpec", "planned_tensors", "raise_if_invalid"]

Q = GGMLQuantizationType
_PLANNED = "_planned_tensors"  # the instance attribute (not a field) planned_tensors fills


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A small model to write; 0/None fields resolve through properties (``n_embd_head``...)."""

    arch: Arch | str = Arch.LLAMA
    name: str = "tiny"
    n_layers: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # None = n_embd // n_head (see n_embd_head)
    n_ff: int = 128  # dense FFN width (dense layers only; llama MoE writes n_ff_expert instead)
    n_vocab: int = 256
    n_expert: int = 0  # 0 = dense model
    n_expert_used: int = 0
    n_ff_expert: int = 64
    moe_layers: tuple[int, ...] | None = None  # None = every block when n_expert > 0
    shared_expert: bool = False
    n_ff_shexp: int = 64
    # Old Mixtral layout (llama MoE only): one blk.N.ffn_{gate,up,down}.M.weight per expert instead
    # of the stacked _exps tensors, holding exactly the stacked tensors' bytes (expert M's slice).
    # llama.cpp 0.3.36 no longer loads it (its llama loader requires ffn_{up,down}_exps); the
    # project does.
    per_expert_tensors: bool = False
    # llama4's interleave_moe_layer_step: blocks i with (i + 1) % step == 0 have experts (and a
    # shared expert), the others a dense FFN of n_ff (Llama 4 Scout: 1, Maverick: 2).
    moe_layer_step: int = 1
    # gemma4: the sliding-window layers' head width (None: head_dim, the full layers'), the full
    # layers' key/value heads (None: n_head_kv), full layers without attn_v (V = K, Gemma 4 31B's
    # attention_k_eq_v), final logit soft-capping (0: none). Its pattern is
    # full_attention_interval, its full layers' rotated dims rope_dim (by rope_freqs factors).
    head_dim_swa: int | None = None
    n_head_kv_full: int | None = None
    attn_k_eq_v: bool = False
    final_logit_softcap: float = 0.0
    tied_output: bool = False
    rope_freq_base: float = 10000.0
    # Llama 3.1 RoPE scaling (rope_scaling.rope_type "llama3"): a factor > 0 writes
    # rope_freqs.weight, the frequency factors llama.cpp's converter computes from the factor,
    # low/high_freq_factor and original_max_position_embeddings (no metadata key: llama.cpp reads
    # only the tensor). See llama3_rope_factors.
    rope_llama3_factor: float = 0.0
    rope_llama3_low_freq_factor: float = 1.0
    rope_llama3_high_freq_factor: float = 4.0
    rope_llama3_original_context: int = 8192
    # YaRN RoPE scaling (gpt-oss): a factor > 0 writes rope.scaling.type "yarn", the factor and
    # rope.scaling.original_context_length (0: context_length).
    rope_yarn_factor: float = 0.0
    rope_yarn_original_context: int = 0
    rms_eps: float = 1e-6
    sliding_window: int = 4  # gemma3's and gpt-oss's local attention window (tokens)
    context_length: int = 256
    seed: int = 0
    types: Mapping[Role, GGMLQuantizationType | GGMLType] = field(default_factory=dict, hash=False)
    # Extra vocabulary entries (the header-parse benchmark): llama.cpp sizes token_embd and output
    # by the tokenizer's token list, so each is a real token with its rows (see vocab_size).
    extra_vocab_strings: int = 0
    # deepseek2 (shards.archs: mla). head_dim is a query/key head (nope + rope dims).
    n_dense_lead: int = 0  # leading_dense_block_count: blocks [0, n) dense, the rest MoE
    n_expert_shared: int = 1  # shared experts, fused: width n_ff_expert * n_expert_shared
    q_lora_rank: int = 0  # 0: attn_q; else attn_q_a -> attn_q_a_norm -> attn_q_b
    kv_lora_rank: int = 32
    rope_dim: int | None = None  # rope.dimension_count: the decoupled rope dims per head
    v_head_dim: int | None = None  # None = head_dim - rope_dim
    mla_split: bool = True  # attn_k_b / attn_v_b (llama.cpp's converter today), else attn_kv_b
    # ik_llama.cpp's form (mla_split False): attn_kv_b *and* 2-D attn_k_b / attn_v_b holding the
    # same matrices split per head, as ik's converter writes them (mainline refuses the file).
    mla_ik: bool = False
    expert_gating_func: int = 0  # 0: key not written (deepseek2: softmax); 1 softmax, 2 sigmoid
    expert_probs_bias: bool = False  # blk.N.exp_probs_b.bias (selection bias)
    n_expert_groups: int = 0  # expert_group_count (0: not written)
    n_group_used: int = 0
    expert_weights_norm: bool = False
    expert_weights_scale: float = 0.0  # 0: not written
    rope_scaling: str | None = None  # rope.scaling.type ("linear", "yarn"); None: not written
    rope_scaling_factor: float = 0.0
    rope_orig_ctx: int = 0  # rope.scaling.original_context_length (0: not written)
    yarn_log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier as written (0.1 x mscale_all_dim)
    # deepseek32 / glm-dsa (shards.archs: dsa): the lightning indexer; also the deepseek2 fields.
    indexer_heads: int = 4  # attention.indexer.head_count
    indexer_head_dim: int = 64  # attention.indexer.key_length (llama.cpp: a power of 2, >= 64)
    indexer_top_k: int = 4  # attention.indexer.top_k: positions each query attends
    indexer_types: tuple[bool, ...] | None = None  # glm-dsa: per-block full (True) / shared
    # glm4moe (shards.archs: glm); also n_dense_lead, n_expert_shared, rope_dim, the routing.
    n_nextn: int = 0  # NextN/MTP blocks after the n_layers trunk blocks (nextn_predict_layers)
    attn_bias: bool = False  # attn_q/k/v biases
    attn_qk_norm: bool = False  # per-head attn_q_norm / attn_k_norm
    # qwen35 / qwen35moe / qwen3next (shards.archs: hybrid): gated delta-net blocks beside full
    # attention; also head_dim, rope_dim (partial rotary), n_ff_shexp.
    ssm_conv_kernel: int = 4  # ssm.conv_kernel
    ssm_state_size: int = 16  # ssm.state_size: the delta net's key and value head width
    ssm_k_heads: int = 2  # ssm.group_count
    ssm_v_heads: int = 4  # ssm.time_step_rank
    full_attention_interval: int = 4  # every Nth block is full attention
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)  # qwen35 / qwen35moe

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("arch", Arch(self.arch))
        if self.indexer_types is not None:
            put("indexer_types", tuple(bool(f) for f in self.indexer_types))
        if self.moe_layers is not None:
            put("moe_layers", tuple(sorted(set(self.moe_layers))))
        resolved: dict[Role, GGMLQuantizationType | GGMLType] = dict(DEFAULT_TYPES)
        resolved.update({parse_role(r): parse_any_type(t) for r, t in self.types.items()})
        put("types", MappingProxyType(resolved))
        raise_if_invalid(self)

    @property
    def arch_name(self) -> str:
        return Arch(self.arch).value

    @property
    def n_embd_head(self) -> int:
        """Per-head width: ``head_dim``, or ``n_embd // n_head`` when unset."""
        if self.head_dim is not None:
            return self.head_dim
        return self.n_embd // self.n_head if self.n_head > 0 else 0

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, extras included: the rows of token_embd and output."""
        return self.n_vocab + self.extra_vocab_strings

    @property
    def moe_blocks(self) -> tuple[int, ...]:
        """The blocks with experts: ``moe_layers``, or every block of an MoE model when unset."""
        if self.moe_layers is not None:
            return self.moe_layers
        return tuple(range(self.n_dense_lead, self.n_blocks)) if self.n_expert > 0 else ()

    @property
    def n_blocks(self) -> int:
        """Blocks in the file: the trunk, then glm4moe's NextN blocks (``block_count``)."""
        return self.n_layers + self.n_nextn

    @property
    def n_rot(self) -> int:
        """Rotated dims per head: ``rope_dim``, or the whole head when unset."""
        return self.rope_dim if self.rope_dim is not None else self.n_embd_head

    @property
    def head_v(self) -> int:
        """deepseek2's value head width: ``v_head_dim``, or the key head's non-rope dims."""
        return self.v_head_dim if self.v_head_dim is not None else self.n_embd_head - self.n_rot

    def type_of(self, role: Role) -> GGMLQuantizationType | GGMLType:
        return self.types[role]

    def with_types(self, **types: str | GGMLQuantizationType | GGMLType) -> ModelSpec:
        """A copy with some role types changed: ``spec.with_types(ffn_up_exps="q4_0")``."""
        merged = {**self.types, **{parse_role(r): parse_any_type(t) for r, t in types.items()}}
        return replace(self, types=merged)


def planned_tensors(spec: ModelSpec) -> tuple[PlannedTensor, ...]:
    """``plan(spec)``, computed once per spec: a spec is frozen, and the check at its
    construction plans it first (a test suite builds thousands of specs, a write plans each)."""
    cached: tuple[PlannedTensor, ...] | None = spec.__dict__.get(_PLANNED)
    if cached is None:
        cached = plan(spec)
        object.__setattr__(spec, _PLANNED, cached)
    return cached


def raise_if_invalid(spec: ModelSpec) -> None:
    """ValueError naming every inconsistency of ``spec`` (none: returns)."""
    errors = _spec_errors(spec)
    if errors:
        raise ValueError(f"invalid ModelSpec {spec.name!r}:\n  " + "\n  ".join(errors))


def _spec_errors(spec: ModelSpec) -> list[str]:
    """Every inconsistency of a spec, including type block sizes (checked on the tensor plan)."""
    errors = []
    for name in ("n_layers", "n_embd", "n_head", "n_head_kv", "n_embd_head", "n_vocab", "n_ff"):
        if getattr(spec, name) <= 0:
            errors.append(f"{name} must be > 0, found {getattr(spec, name)}")
    if spec.n_head > 0 and spec.n_head_kv > 0 and spec.n_head % spec.n_head_kv:
        errors.append(f"n_head ({spec.n_head}) must be a multiple of n_head_kv ({spec.n_head_kv})")
    if spec.n_expert > 0 and not 0 < spec.n_expert_used <= spec.n_expert:
        errors.append(
            f"n_expert_used must be in 1..n_expert ({spec.n_expert}), found {spec.n_expert_used}"
        )
    if spec.n_expert == 0 and (spec.moe_layers or spec.shared_expert):
        errors.append("moe_layers / shared_expert need n_expert > 0")
    if spec.n_expert > 0 and min(spec.n_ff_expert, spec.n_ff_shexp) <= 0:
        errors.append("n_ff_expert / n_ff_shexp must be > 0 in an MoE model")
    bad = [b for b in spec.moe_blocks if not 0 <= b < spec.n_blocks]
    if bad:
        errors.append(f"moe_layers {bad} outside 0..{spec.n_blocks - 1}")
    errors += llama_cpp_errors(spec)
    errors += rope_freqs_errors(spec)
    if spec.rope_yarn_factor > 0 and not rules_of(spec.arch).gpt_oss:
        errors.append(
            f"rope_yarn_factor: the writer writes YaRN scaling for gpt-oss only, not "
            f"{spec.arch_name}"
        )
    if spec.per_expert_tensors and (spec.arch is not Arch.LLAMA or spec.n_expert <= 0):
        errors.append(
            f"per_expert_tensors is the old Mixtral layout: it needs arch llama with experts, "
            f"found {spec.arch_name} with n_expert {spec.n_expert}"
        )
    if spec.mla_ik and spec.arch is not Arch.DEEPSEEK2:
        errors.append(f"mla_ik is ik_llama.cpp's deepseek2 form, not {spec.arch_name}'s")
    if spec.sliding_window <= 0:
        errors.append(f"sliding_window must be > 0, found {spec.sliding_window}")
    if spec.extra_vocab_strings < 0:
        errors.append(f"extra_vocab_strings must be >= 0, found {spec.extra_vocab_strings}")
    unwritable = sorted({t.name for t in spec.types.values() if t not in ACCEPTED_TYPES})
    if unwritable:
        names = ", ".join(t.name for t in ACCEPTED_TYPES)
        errors.append(f"types {unwritable} cannot be written; writable types are: {names}")
    return errors or _plan_errors(spec)


def _plan_errors(spec: ModelSpec) -> list[str]:
    """What the tensor plan of a spec otherwise valid cannot hold: a role ggml reads as floats
    in another type, a row length that is not a multiple of its type's block size."""
    errors = []
    misfits: dict[Role, list[PlannedTensor]] = {}
    planned = planned_tensors(spec)
    for role in sorted({t.role for t in planned} & F32_ONLY_ROLES, key=lambda r: r.name):
        if spec.type_of(role) != Q.F32:
            found = spec.type_of(role).name
            errors.append(f"{role.name} must be F32 (ggml reads it as floats), found {found}")
    for t in planned:
        if t.ne[0] % ggml_types.LAYOUTS[GGMLType(t.ggml_type)].block_size:
            misfits.setdefault(t.role, []).append(t)
    for role, bad_tensors in misfits.items():
        t, more = bad_tensors[0], len(bad_tensors) - 1
        block_size = ggml_types.LAYOUTS[GGMLType(t.ggml_type)].block_size
        also = f" (and {more} more {role.name} tensors)" if more else ""
        errors.append(
            f"{t.name}{also}: row length ne[0]={t.ne[0]} is not a multiple of the "
            f"{t.ggml_type.name} block size {block_size}; choose another type for role "
            f"{role.name} or a dimension divisible by {block_size}"
        )
    return errors
