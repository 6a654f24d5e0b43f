"""What each tensor of a written model is (``Role``), the GGML type it gets by default, and the
parsing of role and type names; ``shards.writer`` re-exports all of it."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Final

from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType

from ggufswap.shards import _synth
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.ggml_types import ggml_type as ggml_type_of

Q = GGMLQuantizationType
WRITABLE_TYPES: Final = _synth.WRITABLE_TYPES
# What the writer accepts: also ik_llama.cpp's types (files only this project and ik read).
ACCEPTED_TYPES: Final = WRITABLE_TYPES + _synth.IK_TYPES


def tensor_template(tensor: MODEL_TENSOR, suffix: str = "weight") -> str:
    """llama.cpp's name of ``tensor`` (gguf-py's ``TENSOR_NAMES``) as a positional template:
    ``blk.{}.ffn_up_exps.weight``, formatted with the block index (``suffix=""``: none, as
    ``blk.{}.ssm_a``)."""
    name = TENSOR_NAMES[tensor].replace("{bid}", "{}")
    return name + "." + suffix if suffix else name


class Role(Enum):
    """What a tensor is in the model; ``ModelSpec.types`` maps roles to GGML types."""

    TOKEN_EMBD = MODEL_TENSOR.TOKEN_EMBD
    OUTPUT_NORM = MODEL_TENSOR.OUTPUT_NORM
    OUTPUT = MODEL_TENSOR.OUTPUT
    ATTN_NORM = MODEL_TENSOR.ATTN_NORM
    ATTN_Q = MODEL_TENSOR.ATTN_Q
    ATTN_K = MODEL_TENSOR.ATTN_K
    ATTN_V = MODEL_TENSOR.ATTN_V
    ATTN_O = MODEL_TENSOR.ATTN_OUT
    ATTN_Q_NORM = MODEL_TENSOR.ATTN_Q_NORM
    ATTN_K_NORM = MODEL_TENSOR.ATTN_K_NORM
    FFN_NORM = MODEL_TENSOR.FFN_NORM
    FFN_GATE = MODEL_TENSOR.FFN_GATE
    FFN_UP = MODEL_TENSOR.FFN_UP
    FFN_DOWN = MODEL_TENSOR.FFN_DOWN
    FFN_GATE_INP = MODEL_TENSOR.FFN_GATE_INP
    FFN_GATE_EXPS = MODEL_TENSOR.FFN_GATE_EXP
    FFN_UP_EXPS = MODEL_TENSOR.FFN_UP_EXP
    FFN_DOWN_EXPS = MODEL_TENSOR.FFN_DOWN_EXP
    FFN_GATE_SHEXP = MODEL_TENSOR.FFN_GATE_SHEXP
    FFN_UP_SHEXP = MODEL_TENSOR.FFN_UP_SHEXP
    FFN_DOWN_SHEXP = MODEL_TENSOR.FFN_DOWN_SHEXP
    FFN_GATE_INP_SHEXP = MODEL_TENSOR.FFN_GATE_INP_SHEXP
    ATTN_POST_NORM = MODEL_TENSOR.ATTN_POST_NORM  # gemma3
    FFN_POST_NORM = MODEL_TENSOR.FFN_POST_NORM  # gemma3
    # gemma4: the MoE blocks' second pre/post norms, router and per-expert scales, layer scale
    FFN_PRE_NORM_2 = MODEL_TENSOR.FFN_PRE_NORM_2
    FFN_POST_NORM_1 = MODEL_TENSOR.FFN_POST_NORM_1
    FFN_POST_NORM_2 = MODEL_TENSOR.FFN_POST_NORM_2
    FFN_GATE_INP_SCALE = (MODEL_TENSOR.FFN_GATE_INP, "scale")
    FFN_DOWN_EXPS_SCALE = (MODEL_TENSOR.FFN_DOWN_EXP, "scale")
    LAYER_OUT_SCALE = MODEL_TENSOR.LAYER_OUT_SCALE
    # deepseek2: latent attention and the routers' selection bias
    ATTN_Q_A = MODEL_TENSOR.ATTN_Q_A
    ATTN_Q_B = MODEL_TENSOR.ATTN_Q_B
    ATTN_Q_A_NORM = MODEL_TENSOR.ATTN_Q_A_NORM
    ATTN_KV_A_MQA = MODEL_TENSOR.ATTN_KV_A_MQA
    ATTN_KV_A_NORM = MODEL_TENSOR.ATTN_KV_A_NORM
    ATTN_KV_B = MODEL_TENSOR.ATTN_KV_B
    ATTN_K_B = MODEL_TENSOR.ATTN_K_B
    ATTN_V_B = MODEL_TENSOR.ATTN_V_B
    FFN_EXP_PROBS_B = MODEL_TENSOR.FFN_EXP_PROBS_B
    # glm4moe's NextN/MTP blocks (besides a whole block's tensors)
    NEXTN_EH_PROJ = MODEL_TENSOR.NEXTN_EH_PROJ
    NEXTN_ENORM = MODEL_TENSOR.NEXTN_ENORM
    NEXTN_HNORM = MODEL_TENSOR.NEXTN_HNORM
    NEXTN_SHARED_HEAD_NORM = MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM

    ROPE_FREQS = MODEL_TENSOR.ROPE_FREQS  # llama 3.1+ RoPE frequency factors
    # gpt-oss: attention sinks, and biases (the value names the tensor and its suffix)
    ATTN_SINKS = MODEL_TENSOR.ATTN_SINKS
    ATTN_Q_BIAS = (MODEL_TENSOR.ATTN_Q, "bias")
    ATTN_K_BIAS = (MODEL_TENSOR.ATTN_K, "bias")
    ATTN_V_BIAS = (MODEL_TENSOR.ATTN_V, "bias")
    ATTN_O_BIAS = (MODEL_TENSOR.ATTN_OUT, "bias")
    FFN_GATE_INP_BIAS = (MODEL_TENSOR.FFN_GATE_INP, "bias")
    FFN_GATE_EXPS_BIAS = (MODEL_TENSOR.FFN_GATE_EXP, "bias")
    FFN_UP_EXPS_BIAS = (MODEL_TENSOR.FFN_UP_EXP, "bias")
    FFN_DOWN_EXPS_BIAS = (MODEL_TENSOR.FFN_DOWN_EXP, "bias")
    # qwen35 / qwen35moe / qwen3next: gated delta-net layers (ssm_a has no suffix)
    ATTN_QKV = MODEL_TENSOR.ATTN_QKV
    ATTN_GATE = MODEL_TENSOR.ATTN_GATE
    SSM_CONV1D = MODEL_TENSOR.SSM_CONV1D
    SSM_DT_BIAS = (MODEL_TENSOR.SSM_DT, "bias")
    SSM_A = (MODEL_TENSOR.SSM_A, "")
    SSM_BETA = MODEL_TENSOR.SSM_BETA
    SSM_ALPHA = MODEL_TENSOR.SSM_ALPHA
    SSM_BETA_ALPHA = MODEL_TENSOR.SSM_BETA_ALPHA
    SSM_NORM = MODEL_TENSOR.SSM_NORM
    SSM_OUT = MODEL_TENSOR.SSM_OUT
    # deepseek32 / glm-dsa: the DSA lightning indexer (literal names: gguf-py before 0.19 lacks
    # these tensors)
    INDEXER_K_NORM = "blk.{}.indexer.k_norm.weight"
    INDEXER_K_NORM_BIAS = "blk.{}.indexer.k_norm.bias"
    INDEXER_PROJ = "blk.{}.indexer.proj.weight"
    INDEXER_ATTN_K = "blk.{}.indexer.attn_k.weight"
    INDEXER_ATTN_Q_B = "blk.{}.indexer.attn_q_b.weight"

    def tensor_name(self, block: int | None = None) -> str:
        """The llama.cpp tensor name, e.g. ``blk.3.ffn_up_exps.weight``."""
        return _role_template(self).format(block)


@functools.cache
def _role_template(role: Role) -> str:
    """A role's name template (``blk.{}.ffn_up_exps.weight``), made once per role: a model's
    plan names every tensor, and a test session plans thousands of small models."""
    if isinstance(role.value, str):  # a literal template
        return role.value
    if isinstance(role.value, tuple):
        tensor, suffix = role.value
    else:
        tensor, suffix = role.value, "bias" if role is Role.FFN_EXP_PROBS_B else "weight"
    return tensor_template(tensor, suffix)


NORM_ROLES: Final = frozenset(
    {
        Role.OUTPUT_NORM,
        Role.ATTN_NORM,
        Role.FFN_NORM,
        Role.ATTN_Q_NORM,
        Role.ATTN_K_NORM,
        Role.ATTN_POST_NORM,
        Role.FFN_POST_NORM,
        Role.FFN_PRE_NORM_2,
        Role.FFN_POST_NORM_1,
        Role.FFN_POST_NORM_2,
        Role.FFN_GATE_INP_SCALE,  # scales near 1, read as floats: like norms
        Role.FFN_DOWN_EXPS_SCALE,
        Role.LAYER_OUT_SCALE,
        Role.ATTN_Q_A_NORM,
        Role.ATTN_KV_A_NORM,
        Role.NEXTN_ENORM,
        Role.NEXTN_HNORM,
        Role.NEXTN_SHARED_HEAD_NORM,
        Role.SSM_NORM,
        Role.INDEXER_K_NORM,
    }
)
# 1-D or routing tensors stay F32, as llama.cpp's quantizer leaves them.
# Tensors ggml reads as plain floats (ggml_rope's freq_factors, ggml_soft_max's sinks) and the
# gpt-oss biases (F32 in the converter's files): F32 only.
F32_ONLY_ROLES: Final = frozenset(
    {
        Role.ROPE_FREQS,
        Role.ATTN_SINKS,
        Role.ATTN_Q_BIAS,
        Role.ATTN_K_BIAS,
        Role.ATTN_V_BIAS,
        Role.ATTN_O_BIAS,
        Role.FFN_GATE_INP_BIAS,
        Role.FFN_GATE_EXPS_BIAS,
        Role.FFN_UP_EXPS_BIAS,
        Role.FFN_DOWN_EXPS_BIAS,
        # ggml_ssm_conv's kernel and the delta net's per-head vectors: floats
        Role.SSM_CONV1D,
        Role.SSM_A,
        Role.SSM_DT_BIAS,
        Role.INDEXER_K_NORM_BIAS,  # ggml_add's float operand, F32 in the converter's files
    }
)
F32_ROLES: Final = (
    NORM_ROLES | {Role.FFN_GATE_INP, Role.FFN_GATE_INP_SHEXP, Role.FFN_EXP_PROBS_B} | F32_ONLY_ROLES
)
DEFAULT_TYPES: Final[Mapping[Role, GGMLQuantizationType]] = MappingProxyType(
    {role: Q.F32 if role in F32_ROLES else Q.Q8_0 for role in Role}
)


def parse_role(text: str | Role) -> Role:
    """A role from its name, case-insensitive (``"ffn_up_exps"``)."""
    if isinstance(text, Role):
        return text
    try:
        return Role[text.strip().upper()]
    except KeyError:
        names = ", ".join(r.name for r in Role)
        raise ValueError(f"unknown tensor role {text!r}; roles are: {names}") from None


def parse_any_type(text: str | int | GGMLQuantizationType) -> GGMLQuantizationType | GGMLType:
    """:func:`parse_type`, or else an ik_llama.cpp type of the project's table (``"iq4_ks"``)."""
    try:
        return parse_type(text)
    except ValueError:
        if isinstance(text, str):
            known = GGMLType.__members__.get(text.strip().upper())
        else:
            known = ggml_type_of(text)
        if known is None:
            raise
        return known


def parse_type(text: str | int | GGMLQuantizationType) -> GGMLQuantizationType:
    """A GGML type from its name (``"q4_k"``) or code."""
    if isinstance(text, GGMLQuantizationType):
        return text
    try:
        if isinstance(text, int):
            return GGMLQuantizationType(text)
        return GGMLQuantizationType[text.strip().upper()]
    except (KeyError, ValueError):
        names = ", ".join(t.name for t in WRITABLE_TYPES)
        raise ValueError(f"unknown GGML type {text!r}; writable types are: {names}") from None
