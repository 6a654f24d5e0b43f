"""Deterministic writers of small llama.cpp-compatible GGUF models, for tests and the demo.

A ``ModelSpec`` describes a tiny ``llama`` (dense, or Mixtral-style MoE), ``qwen2`` / ``qwen3``
(dense), ``qwen2moe`` / ``qwen3moe`` or ``gemma3`` model (six gemma3 blocks: 5 local + 1 global);
``write_model`` writes it as one file, as a gguf-split style shard set, or as one shard per tensor.
Tensor names and metadata keys are llama.cpp's (taken from gguf-py's constants), weights are
seeded per tensor name, and the encoder embeds no timestamps: the same spec always gives
byte-identical files. Every file is written atomically (``shards.atomic``).

Every file written is one llama.cpp loads as the architecture it names: a spec that llama.cpp's
loader would refuse (``shards.archs``: qwen3moe with a shared expert, qwen2moe without one or
with a tied output, llama with experts in some blocks only, ...) is refused by ``ModelSpec``
with the reason, and llama MoE files take llama.cpp's (Mixtral) form: ``feed_forward_length`` is
the per-expert width and there is no ``expert_feed_forward_length``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import numpy as np
from gguf import (
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFValueType,
    Keys,
    LlamaFileType,
)

from ggufswap.logs import get_logger
from ggufswap.shards import _synth, ggml_types
from ggufswap.shards._arch_spec import (
    head_lengths,
    llama_cpp_errors,
    plan,
    rope_freqs_errors,
)
from ggufswap.shards._gguf_encode import (
    Hole,
    RawTensor,
    TypedValue,
    encode_metadata,
    write_gguf,
)
from ggufswap.shards._planned import PlannedTensor
from ggufswap.shards._roles import (
    ACCEPTED_TYPES,
    DEFAULT_TYPES,
    F32_ONLY_ROLES,
    F32_ROLES,
    NORM_ROLES,
    WRITABLE_TYPES,
    Role,
    parse_any_type,
    parse_role,
    parse_type,
)
from ggufswap.shards.archs import ExpertWidth, SharedExpert, rules_of
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.keys import Arch

__all__ = [
    "DEFAULT_TYPES",
    "F32_ONLY_ROLES",
    "F32_ROLES",
    "NORM_ROLES",
    "SHARD_NAME_FORMAT",
    "WRITABLE_TYPES",
    "Layout",
    "ModelSpec",
    "PlannedTensor",
    "Role",
    "llama3_rope_factors",
    "model_metadata",
    "parse_any_type",
    "parse_role",
    "parse_type",
    "plan_tensors",
    "shard_paths",
    "tensor_bytes",
    "write_model",
    "write_sparse_model",
]

log = get_logger(__name__)

Q = GGMLQuantizationType
SHARD_NAME_FORMAT: Final = "{}-{:05d}-of-{:05d}.gguf"


class Layout(Enum):
    """How a model's tensors are distributed over files."""

    SINGLE = "single"  # NAME.gguf
    SPLIT = "split"  # NAME-00001-of-0000N.gguf, gguf-split style
    PER_TENSOR = "per-tensor"  # a split with one tensor per shard


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
        if self.moe_layers is not None:
            put("moe_layers", tuple(sorted(set(self.moe_layers))))
        resolved: dict[Role, GGMLQuantizationType | GGMLType] = dict(DEFAULT_TYPES)
        resolved.update({parse_role(r): parse_any_type(t) for r, t in self.types.items()})
        put("types", MappingProxyType(resolved))
        _raise_if_invalid(self)

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


def _raise_if_invalid(spec: ModelSpec) -> None:
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
    if spec.sliding_window <= 0:
        errors.append(f"sliding_window must be > 0, found {spec.sliding_window}")
    if spec.extra_vocab_strings < 0:
        errors.append(f"extra_vocab_strings must be >= 0, found {spec.extra_vocab_strings}")
    unwritable = sorted({t.name for t in spec.types.values() if t not in ACCEPTED_TYPES})
    if unwritable:
        names = ", ".join(t.name for t in ACCEPTED_TYPES)
        errors.append(f"types {unwritable} cannot be written; writable types are: {names}")
    if errors:
        return errors
    misfits: dict[Role, list[PlannedTensor]] = {}
    planned = plan(spec)
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


def llama3_rope_factors(spec: ModelSpec) -> np.ndarray:
    """``rope_freqs.weight`` of ``spec``: ``[head_dim / 2]`` float32 factors, by the rule of
    llama.cpp's converter (``LlamaModel.generate_extra_tensors``, rope_type "llama3"): 1 for
    wavelengths below ``original_context / high_freq_factor``, ``factor`` above
    ``original_context / low_freq_factor``, a smooth interpolation between; in float32 as it
    computes them."""
    f32 = np.float32
    dim = spec.n_embd_head
    freqs = f32(1.0) / (f32(spec.rope_freq_base) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    factor, context = spec.rope_llama3_factor, spec.rope_llama3_original_context
    low, high = spec.rope_llama3_low_freq_factor, spec.rope_llama3_high_freq_factor
    out = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < context / high:
            out.append(f32(1.0))
        elif wavelen > context / low:
            out.append(f32(factor))
        else:
            smooth = (f32(context) / wavelen - f32(low)) / f32(high - low)
            out.append(f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth))
    return np.asarray(out, dtype=f32)


def plan_tensors(spec: ModelSpec, *, validate: bool = True) -> tuple[PlannedTensor, ...]:
    """The tensors of ``spec`` in file order, with llama.cpp's names and ``ne`` shapes."""
    if validate:
        _raise_if_invalid(spec)
    return plan(spec)


def tensor_bytes(spec: ModelSpec, t: PlannedTensor) -> np.ndarray:
    """The raw bytes of one planned tensor: norms near 1, weights ~ N(0, 1/sqrt(fan_in)). A
    per-expert tensor holds its expert's slice of the stacked tensor's bytes, so both layouts of
    a spec hold the same values."""
    if t.expert is not None:
        name, ne = t.role.tensor_name(t.block), (*t.ne, spec.n_expert)
        raw = tensor_bytes(spec, replace(t, name=name, ne=ne, expert=None))
        size = raw.size // spec.n_expert
        return raw[t.expert * size : (t.expert + 1) * size]
    rng = _synth.tensor_rng(spec.seed, t.name)
    if t.role is Role.SSM_A:  # -exp(A_log) as the converter stores it: every head decays
        a_log = rng.normal(0.0, 0.5, size=t.ne[0]).astype(np.float32)
        return _synth.encode_floats(-np.exp(a_log)[None, :], Q(t.ggml_type))
    if t.role is Role.ROPE_FREQS:
        own = rules_of(spec.arch).writer.rope_factors
        factors = llama3_rope_factors(spec) if own is None else np.asarray(own(spec), np.float32)
        return _synth.encode_floats(np.asarray(factors)[None, :], Q(t.ggml_type))
    if t.role in NORM_ROLES:
        return _synth.synth_tensor(rng, t.ggml_type, t.ne, mean=1.0, std=0.05)
    return _synth.synth_tensor(rng, t.ggml_type, t.ne, mean=0.0, std=1.0 / math.sqrt(t.ne[0]))


# --- metadata ---------------------------------------------------------------------------------


def _u32(v: int) -> TypedValue:
    return TypedValue(GGUFValueType.UINT32, v)


def _f32(v: float) -> TypedValue:
    return TypedValue(GGUFValueType.FLOAT32, v)


def _file_type(tensors: Sequence[PlannedTensor]) -> int:
    """``general.file_type``: the ``MOSTLY_*`` of the type holding most matrix elements."""
    weight: dict[GGMLQuantizationType | GGMLType, int] = {}
    for t in tensors:
        if len(t.ne) >= 2:
            weight[t.ggml_type] = weight.get(t.ggml_type, 0) + math.prod(t.ne)
    main = max(sorted(weight), key=weight.__getitem__)
    for candidate in (f"MOSTLY_{main.name}", f"MOSTLY_{main.name}_M"):
        if candidate in LlamaFileType.__members__:
            return int(LlamaFileType[candidate])
    return int(LlamaFileType.ALL_F32)


def _feed_forward_length(spec: ModelSpec) -> int:
    """``{arch}.feed_forward_length``: the dense width, or for an MoE architecture whose experts
    are sized by it (llama, as llama.cpp's converter writes Mixtral) the per-expert width."""
    rules = rules_of(spec.arch)
    if spec.n_expert > 0 and rules.expert_width is ExpertWidth.FEED_FORWARD_LENGTH:
        return spec.n_ff_expert
    if rules.gpt_oss:  # the converter writes intermediate_size to both keys
        return spec.n_ff_expert
    return spec.n_ff


def model_metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """The key/value metadata of ``spec``, in file order (llama.cpp's keys)."""
    a = spec.arch_name
    LLM = Keys.LLM  # noqa: N806
    ATT = Keys.Attention  # noqa: N806
    S = GGUFValueType.STRING  # noqa: N806
    tensors = plan_tensors(spec)
    kv: list[tuple[str, TypedValue]] = [
        (Keys.General.ARCHITECTURE, TypedValue(S, a)),
        (Keys.General.NAME, TypedValue(S, spec.name)),
        (Keys.General.FILE_TYPE, _u32(_file_type(tensors))),
        (Keys.General.QUANTIZATION_VERSION, _u32(GGML_QUANT_VERSION)),
        (LLM.BLOCK_COUNT.format(arch=a), _u32(spec.n_blocks)),
        (LLM.CONTEXT_LENGTH.format(arch=a), _u32(spec.context_length)),
        (LLM.EMBEDDING_LENGTH.format(arch=a), _u32(spec.n_embd)),
        (LLM.FEED_FORWARD_LENGTH.format(arch=a), _u32(_feed_forward_length(spec))),
        (ATT.HEAD_COUNT.format(arch=a), _u32(spec.n_head)),
        (ATT.HEAD_COUNT_KV.format(arch=a), _u32(spec.n_head_kv)),
        *head_lengths(spec),
        (ATT.LAYERNORM_RMS_EPS.format(arch=a), _f32(spec.rms_eps)),
        (Keys.Rope.FREQ_BASE.format(arch=a), _f32(spec.rope_freq_base)),
        (LLM.VOCAB_SIZE.format(arch=a), _u32(spec.vocab_size)),
    ]
    rules = rules_of(spec.arch)
    if spec.arch is Arch.GEMMA3 or rules.gpt_oss:
        kv.append((ATT.SLIDING_WINDOW.format(arch=a), _u32(spec.sliding_window)))
    if spec.rope_yarn_factor > 0:
        orig = spec.rope_yarn_original_context or spec.context_length
        kv += [
            (Keys.Rope.SCALING_TYPE.format(arch=a), TypedValue(S, "yarn")),
            (Keys.Rope.SCALING_FACTOR.format(arch=a), _f32(spec.rope_yarn_factor)),
            (Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=a), _u32(orig)),
        ]
    if spec.n_expert > 0:
        kv += [
            (LLM.EXPERT_COUNT.format(arch=a), _u32(spec.n_expert)),
            (LLM.EXPERT_USED_COUNT.format(arch=a), _u32(spec.n_expert_used)),
        ]
        if rules.expert_width in (ExpertWidth.EXPERT_KEY_OR_SPLIT, ExpertWidth.EXPERT_KEY):
            kv.append((LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), _u32(spec.n_ff_expert)))
        if spec.shared_expert and rules.shared_expert is not SharedExpert.COUNTED:
            key = LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=a)
            kv.append((key, _u32(spec.n_ff_shexp)))
    kv += rules.writer.metadata(spec)
    kv = list(dict(kv).items())  # an architecture's own value of a key replaces the shared one
    tokens, scores, token_types = _synth.vocabulary(spec.n_vocab, extra=spec.extra_vocab_strings)
    A = GGUFValueType.ARRAY  # noqa: N806
    kv += [
        (Keys.Tokenizer.MODEL, TypedValue(S, "llama")),
        (Keys.Tokenizer.LIST, TypedValue(A, tokens, S)),
        (Keys.Tokenizer.SCORES, TypedValue(A, scores, GGUFValueType.FLOAT32)),
        (Keys.Tokenizer.TOKEN_TYPE, TypedValue(A, token_types, GGUFValueType.INT32)),
        (Keys.Tokenizer.UNK_ID, _u32(0)),
        (Keys.Tokenizer.BOS_ID, _u32(1)),
        (Keys.Tokenizer.EOS_ID, _u32(2)),
    ]
    return kv


# --- models -----------------------------------------------------------------------------------


def shard_paths(
    spec: ModelSpec, out_dir: str | Path, *, layout: Layout, n_shards: int
) -> list[Path]:
    """The file names of a model: ``NAME.gguf`` or ``NAME-0000i-of-0000N.gguf``."""
    out_dir = Path(out_dir)
    if layout is Layout.SINGLE:
        return [out_dir / f"{spec.name}.gguf"]
    return [out_dir / SHARD_NAME_FORMAT.format(spec.name, i + 1, n_shards) for i in range(n_shards)]


def _group(
    tensors: Sequence[PlannedTensor], *, layout: Layout, max_tensors_per_shard: int | None
) -> list[list[PlannedTensor]]:
    if layout is Layout.SINGLE:
        if max_tensors_per_shard is not None:
            raise ValueError("max_tensors_per_shard applies to Layout.SPLIT only")
        return [list(tensors)]
    if layout is Layout.PER_TENSOR:
        if max_tensors_per_shard not in (None, 1):
            raise ValueError(
                f"Layout.PER_TENSOR means 1 tensor per shard, not {max_tensors_per_shard}"
            )
        per = 1
    else:
        per = max_tensors_per_shard or -(-len(tensors) // 4)  # default: about four shards
        if per < 1:
            raise ValueError(f"max_tensors_per_shard must be >= 1, found {per}")
    return [list(tensors[i : i + per]) for i in range(0, len(tensors), per)]


def write_model(
    spec: ModelSpec,
    out_dir: str | Path,
    *,
    layout: Layout = Layout.SINGLE,
    max_tensors_per_shard: int | None = None,
) -> list[Path]:
    """Write ``spec`` into ``out_dir``; returns the files, the first one being the file to load.

    Split shards follow gguf-split: the first holds every metadata key plus ``split.*``, the
    others only ``split.no``, ``split.count`` and ``split.tensors.count``. Shards are written last
    to first, so the file to load appears only when the rest of the set is in place.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    planned = plan_tensors(spec)
    groups = _group(planned, layout=layout, max_tensors_per_shard=max_tensors_per_shard)
    paths = shard_paths(spec, out_dir, layout=layout, n_shards=len(groups))
    metadata = model_metadata(spec)
    for i in reversed(range(len(groups))):
        kv = metadata if i == 0 else []
        if layout is not Layout.SINGLE:
            kv = [
                *kv,
                (Keys.Split.LLM_KV_SPLIT_NO, TypedValue(GGUFValueType.UINT16, i)),
                (Keys.Split.LLM_KV_SPLIT_COUNT, TypedValue(GGUFValueType.UINT16, len(groups))),
                (
                    Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
                    TypedValue(GGUFValueType.INT32, len(planned)),
                ),
            ]
        raws = [RawTensor(t.name, t.ggml_type, t.ne, tensor_bytes(spec, t)) for t in groups[i]]
        write_gguf(paths[i], n_kv=len(kv), kv_bytes=encode_metadata(kv), tensors=raws)
    log.info("model_written", model=spec.name, layout=layout.value, files=len(paths))
    return paths


def write_sparse_model(spec: ModelSpec, out_dir: str | Path) -> Path:
    """Write ``spec`` as one file whose tensor data is a hole: a real header for a model of any
    size, taking only the header's space on disk (its data reads as zeros)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kv = model_metadata(spec)
    raws = [RawTensor(t.name, t.ggml_type, t.ne, Hole(t.nbytes)) for t in plan_tensors(spec)]
    (path,) = shard_paths(spec, out_dir, layout=Layout.SINGLE, n_shards=1)
    return write_gguf(path, n_kv=len(kv), kv_bytes=encode_metadata(kv), tensors=raws)
