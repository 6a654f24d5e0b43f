"""Deterministic writers of small llama.cpp-compatible GGUF models, for tests and the demo.

A ``ModelSpec`` describes a tiny model of any architecture of ``shards.archs`` (the tensors its
loader creates: the shared plan of ``_arch_spec``, or the architecture's own ``WriterHooks``);
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
from collections.abc import Sequence
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Final

import numpy as np
from gguf import (
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    Keys,
    LlamaFileType,
)

from ggufswap.logs import get_logger
from ggufswap.shards import _synth
from ggufswap.shards._arch_spec import head_lengths
from ggufswap.shards._gguf_encode import (
    Hole,
    RawTensor,
    TypedValue,
    encode_metadata,
    write_gguf,
)
from ggufswap.shards._model_spec import ModelSpec, planned_tensors
from ggufswap.shards._planned import PlannedTensor
from ggufswap.shards._roles import (
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
from ggufswap.shards.value_types import GGUFValueType

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


def llama3_rope_factors(spec: ModelSpec) -> np.ndarray:
    """``rope_freqs.weight`` of ``spec``: ``[head_dim / 2]`` float32 factors, by the rule of
    llama.cpp's converter (``LlamaModel.generate_extra_tensors``, rope_type "llama3"): 1 for
    wavelengths below ``original_context / high_freq_factor``, ``factor`` above
    ``original_context / low_freq_factor``, a smooth interpolation between; in float32 as it
    computes them. The powers come from Python's ``math.pow`` rounded to float32, not numpy's
    ``power``, whose AVX-512 path (SVML) rounds differently from its others: the written bytes
    must not depend on the CPU that writes them (the golden fixtures record them)."""
    f32 = np.float32
    dim = spec.n_embd_head
    base = float(f32(spec.rope_freq_base))
    powers = [f32(math.pow(base, float(f32(i) / f32(dim)))) for i in range(0, dim, 2)]
    freqs = f32(1.0) / np.asarray(powers, dtype=f32)
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


def plan_tensors(spec: ModelSpec) -> tuple[PlannedTensor, ...]:
    """The tensors of ``spec`` in file order, with llama.cpp's names and ``ne`` shapes (a spec
    is checked at its construction, which plans it: this returns that plan)."""
    return planned_tensors(spec)


def tensor_bytes(spec: ModelSpec, t: PlannedTensor) -> np.ndarray:
    """The raw bytes of one planned tensor: norms near 1, weights ~ N(0, 1/sqrt(fan_in)). A
    per-expert tensor holds its expert's slice of the stacked tensor's bytes, so both layouts of
    a spec hold the same values."""
    if t.expert is not None:
        name, ne = t.role.tensor_name(t.block), (*t.ne, spec.n_expert)
        raw = tensor_bytes(spec, replace(t, name=name, ne=ne, expert=None))
        size = raw.size // spec.n_expert
        return raw[t.expert * size : (t.expert + 1) * size]
    split_types = (t.ggml_type, spec.type_of(Role.ATTN_KV_B))
    if (
        spec.mla_ik
        and t.role in (Role.ATTN_K_B, Role.ATTN_V_B)
        and all(x in _synth.QUANTIZABLE_TYPES for x in split_types)
    ):  # ik's own types are synthesized blocks, which gguf-py can neither decode nor encode
        return _synth.encode_floats(ik_mla_split(spec, t), Q(t.ggml_type))
    rng = _synth.tensor_rng(spec.seed, t.name)
    if t.role is Role.SSM_A:  # -exp(A_log) as the converter stores it: every head decays
        a_log = rng.normal(0.0, 0.5, size=t.ne[0]).astype(np.float32)
        # math.exp, not numpy's: numpy's float32 exp takes the CPU's SIMD path (AVX2, AVX-512),
        # whose rounding differs from one path to another (tests/test_crosscheck.py).
        a = np.array([-math.exp(float(x)) for x in a_log], np.float32)
        return _synth.encode_floats(a[None, :], Q(t.ggml_type))
    if t.role is Role.ROPE_FREQS:
        own = rules_of(spec.arch).writer.rope_factors
        factors = llama3_rope_factors(spec) if own is None else np.asarray(own(spec), np.float32)
        return _synth.encode_floats(np.asarray(factors)[None, :], Q(t.ggml_type))
    if t.role in NORM_ROLES:
        return _synth.synth_tensor(rng, t.ggml_type, t.ne, mean=1.0, std=0.05)
    return _synth.synth_tensor(rng, t.ggml_type, t.ne, mean=0.0, std=1.0 / math.sqrt(t.ne[0]))


def ik_mla_split(spec: ModelSpec, t: PlannedTensor) -> np.ndarray:
    """ik_llama.cpp's 2-D ``attn_k_b`` / ``attn_v_b`` of ``t``'s block as its converter derives
    them from ``attn_kv_b`` (``[H, nope + v, rank]`` split per head, ``k_b`` transposed):
    ``[H * rank, nope]`` / ``[H * v, rank]`` floats, the block's ``attn_kv_b`` as written (its
    dequantized values). In ik's own types (random valid blocks, which gguf-py cannot decode)
    the three are synthesized each on its own instead."""
    h, rank, nope, v = spec.n_head, spec.kv_lora_rank, spec.n_embd_head - spec.n_rot, spec.head_v
    role = Role.ATTN_KV_B
    kv_b = PlannedTensor(
        role.tensor_name(t.block), role, spec.type_of(role), (rank, h * (nope + v)), t.block
    )
    values = _synth.decode_floats(tensor_bytes(spec, kv_b), kv_b.ggml_type, rank)
    heads = values.reshape(h, nope + v, rank)
    if t.role is Role.ATTN_K_B:
        return np.ascontiguousarray(heads[:, :nope].transpose(0, 2, 1).reshape(h * rank, nope))
    return np.ascontiguousarray(heads[:, nope:].reshape(h * v, rank))


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
