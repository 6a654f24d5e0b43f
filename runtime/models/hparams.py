"""Hyper-parameters of the reference decoder, read from GGUF metadata the way llama.cpp reads them.

Every rule is llama.cpp's (llama-cpp-python 0.3.36's vendored copy): the shared keys as
``llama_model_base::load_hparams`` (``src/llama-model.cpp``) reads them, each architecture's own
as its ``load_arch_hparams`` / ``load_arch_tensors`` (``src/models/<arch>.cpp``) do, and what a
file must hold from ``shards.archs`` (the table the writer obeys too). Where the project's old
rule differed (for example llama MoE expert width), llama.cpp's wins, so files laid out as
llama.cpp's converter writes them load.

Supported architectures (``general.architecture``):

- ``llama``: dense, or Mixtral-style MoE in every block when ``llama.expert_count`` > 0, experts
  sized by ``feed_forward_length`` (softmax over all experts, top-k, renormalised). RoPE NORM.
- ``qwen2moe``: softmax over all experts then top-k, *not* renormalised; a shared expert with a
  sigmoid gate in every block. RoPE NEOX.
- ``qwen3moe``: softmax over all experts then top-k, renormalised; per-head RMS norms on Q and
  K; no shared expert. RoPE NEOX.
- ``qwen2`` / ``qwen3``: the dense qwen decoders (Q/K/V biases when the file has them for qwen2,
  per-head Q/K norms for qwen3). RoPE NEOX.
- ``deepseek2``: multi-head latent attention (``MLAShape``) in either file form, leading dense
  blocks then MoE blocks with ungated shared experts, softmax or sigmoid gating with the optional
  ``exp_probs_b`` selection bias, group-limited routing, ``expert_weights_norm`` / ``_scale``, and
  linear or YaRN RoPE scaling with deepseek2's attention-scale adjustment. RoPE NORM on the
  decoupled rope dims only.
- ``gemma3``: GeGLU (tanh GELU), Q/K norms, post-attention and post-FFN norms, embeddings scaled
  by ``sqrt(n_embd)``; with ``attention.sliding_window`` > 0, sliding-window attention on the
  layers of llama.cpp's pattern (five of every six by default; local RoPE base
  ``rope.freq_base_swa``, 10000 by default), the others global with ``rope.freq_base`` and linear
  ``rope.scaling.factor``. RoPE NEOX.
- ``deepseek32`` / ``glm-dsa``: deepseek2's blocks (the attn_k_b/attn_v_b form) behind the DSA
  lightning indexer's top-k selection (``DSAShape``; glm-dsa's shared indexer blocks).
- ``gpt-oss``: attention sinks and biases, sliding-window attention on even layers (llama.cpp's
  pattern of 2), a biased router with softmax over the top-k logits, biased experts of the
  required ``expert_feed_forward_length`` with clamped SwiGLU, YaRN RoPE scaling. RoPE NEOX.

``docs/models.md`` lists every key and tensor each architecture reads.

Size: being reworked by issue 25; split there.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ggufswap.runtime.models._hybrid_hparams import SSMShape, hybrid_problems
from ggufswap.runtime.models._moe_hparams import (
    DSAShape,
    Gating,
    MLAShape,
    deepseek2_problems,
    dsa_problems,
    lead_problems,
)
from ggufswap.runtime.models.errors import HParamsError
from ggufswap.shards.archs import (
    NEUTRAL_VALUES,
    SHARED_LLAMA_CPP_KEYS,
    ArchRules,
    Experts,
    ExpertWidth,
    SharedExpert,
    rules_of,
)
from ggufswap.shards.keys import Arch, Keys

__all__ = [
    "ROPE_SCALING_LINEAR",
    "ROPE_SCALING_NONE",
    "ROPE_SCALING_YARN",
    "Activation",
    "Arch",
    "DSAShape",
    "Gating",
    "HParams",
    "KeyReader",
    "MLAShape",
    "RopeType",
    "SSMShape",
    "expert_width",
    "unimplemented_keys",
]


class RopeType(enum.IntEnum):
    """llama.cpp's rope modes (``LLAMA_ROPE_TYPE_*``): which pairs of a head are rotated."""

    NORM = 0  # adjacent pairs (x[2i], x[2i+1]); GGUF conversion permutes llama's Q/K for this
    NEOX = 2  # halves (x[i], x[i + n_rot/2])


class Activation(str, enum.Enum):
    """The gated FFN's activation: llama.cpp's LLM_FFN_SILU (SwiGLU) or LLM_FFN_GELU (GeGLU)."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"


# The keys every architecture shares that from_metadata reads (llama_model_base::load_hparams).
SHARED_KEYS: Final = (
    Keys.LLM.EMBEDDING_LENGTH,
    Keys.LLM.BLOCK_COUNT,
    Keys.LLM.FEED_FORWARD_LENGTH,
    Keys.LLM.HEAD_COUNT,
    Keys.LLM.HEAD_COUNT_KV,
    Keys.LLM.KEY_LENGTH,
    Keys.LLM.VALUE_LENGTH,
    Keys.LLM.RMS_EPS,
    Keys.LLM.EXPERT_COUNT,
    Keys.LLM.EXPERT_USED_COUNT,
    Keys.LLM.ROPE_FREQ_BASE,
    Keys.LLM.ROPE_DIMENSION_COUNT,
    Keys.LLM.ROPE_SCALING_TYPE,
    Keys.LLM.ROPE_SCALING_FACTOR,
    Keys.LLM.ROPE_SCALE_LINEAR,
    Keys.LLM.CONTEXT_LENGTH,
    Keys.LLM.VOCAB_SIZE,
)
ROPE_SCALING_LINEAR: Final = "linear"
ROPE_SCALING_NONE: Final = "none"
ROPE_SCALING_YARN: Final = "yarn"


@dataclass(frozen=True)
class HParams:
    """What the decoder needs to know about a model; derived fields are set in ``__post_init__``.

    ``from_metadata`` applies llama.cpp's rules; built directly, 0 / None fields fall back to the
    same rules (``n_ff_exp`` and ``n_ff_shexp`` through the architecture's ``shards.archs`` row).
    """

    arch: Arch
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_ff: int = 0  # {arch}.feed_forward_length (llama MoE: the per-expert width)
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    context_length: int = 2048
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0  # routed expert width; 0 = the architecture's rule (see expert_width)
    n_ff_shexp: int = 0  # shared expert width (qwen2moe); 0 = the architecture's rule
    key_length: int | None = None  # per-head dim when it is not n_embd / n_head (qwen3)
    rope_dim: int | None = None  # rotated dims per head; None = the whole head
    expert_weights_norm: bool | None = None  # None = the architecture's default
    expert_weights_scale: float = 1.0
    sliding_window: int = 0  # tokens a local layer sees (itself included); 0 = no local layers
    swa_period: int = 0  # llama.cpp's n_pattern: layer i is local iff i % n < n - 1 (0 = all)
    swa_layers: tuple[bool, ...] | None = None  # an explicit per-layer pattern (overrides period)
    rope_base_local: float | None = None  # RoPE base of local layers; None = rope_base
    rope_freq_scale: float = 1.0  # linear RoPE scaling (1 / scaling.factor); local layers: none
    final_logit_softcap: float = 0.0  # 0 = none; else logits = c * tanh(logits / c)
    attention_scale: float | None = None  # softmax scale of Q.K; None = 1/sqrt(head_dim)
    # deepseek2 (shards.archs: mla): blocks, routing, latent attention; YaRN (deepseek2,
    # gpt-oss: llama_context's cparams, ext_factor 1 for yarn scaling, attn_factor after its
    # adjustments, rope.scaling.attn_factor included, and the original context).
    n_layer_dense_lead: int = 0
    n_expert_shared: int = 0
    gating: Gating = Gating.SOFTMAX
    n_expert_groups: int = 0  # 0 or 1: no group-limited routing
    n_group_used: int = 0
    moe_layer_step: int = 1  # llama4: blocks (i + 1) % step == 0 route, the others are dense
    # gemma4: the sliding-window layers' head width and rotated dims (the fields above describe
    # the full-attention layers), and each layer's key/value heads
    head_dim_swa: int | None = None
    rope_dim_swa: int | None = None
    n_head_kv_layers: tuple[int, ...] | None = None
    mla: MLAShape | None = None
    dsa: DSAShape | None = None  # deepseek32 / glm-dsa: the lightning indexer
    rope_ext_factor: float = 0.0
    rope_attn_factor: float = 1.0
    rope_ctx_orig: int = 0  # YaRN's original context (0 = context_length)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    n_layer_nextn: int = 0  # trailing NextN/MTP blocks (nextn_predict_layers): loaded, not run
    # Qwen3.5 / Qwen3-Next (shards.archs: hybrid): the delta net, which blocks are recurrent,
    # and the interleaved multimodal RoPE sections.
    ssm: SSMShape | None = None
    recurrent_layers: tuple[bool, ...] | None = None
    rope_sections: tuple[int, ...] | None = None

    # Derived.
    rules: ArchRules = field(init=False)
    head_dim: int = field(init=False)
    n_rot: int = field(init=False)
    rope_type: RopeType = field(init=False)
    norm_topk: bool = field(init=False)
    q_per_kv: int = field(init=False)
    is_moe: bool = field(init=False)
    has_shared_expert: bool = field(init=False)
    attn_scale: float = field(init=False)  # softmax scale of Q.K
    embed_scale: float = field(init=False)  # token embeddings are multiplied by this
    activation: Activation = field(init=False)

    def __post_init__(self) -> None:
        """Size: being reworked by issue 25; split there."""
        problems: list[str] = []
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_vocab"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, found {getattr(self, name)}")
        if problems:
            raise HParamsError(f"{self.arch.value}: " + "; ".join(problems))
        rules = rules_of(self.arch)
        head_dim = self.key_length if self.key_length is not None else self.n_embd // self.n_head
        if self.key_length is None and self.n_embd % self.n_head:
            problems.append(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if not rules.free_head_dim and head_dim * self.n_head != self.n_embd:
            problems.append(
                f"attention.key_length {head_dim} must be n_embd / n_head: llama.cpp's "
                f"{self.arch.value} sizes attn_q as {{n_embd, n_embd}} ({rules.source})"
            )
        if self.n_head % self.n_head_kv:
            problems.append(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        n_rot = self.rope_dim if self.rope_dim is not None else head_dim
        if n_rot % 2 or not 0 < n_rot <= head_dim:
            problems.append(f"rope dims {n_rot} must be even and in (0, head_dim={head_dim}]")
        if rules.rope_dims_equal_head and n_rot != head_dim:
            problems.append(f"invalid n_rot: {n_rot}, expected {head_dim} (llama.cpp's llama)")
        is_moe = self.n_expert > 0
        if is_moe and not 0 < self.n_expert_used <= self.n_expert:
            problems.append(f"expert_used_count {self.n_expert_used} not in [1, {self.n_expert}]")
        if rules.experts is Experts.ALL and not is_moe:
            problems.append(f"{self.arch.value} needs expert_count > 0")
        if rules.experts is Experts.NONE and is_moe:
            problems.append(f"{self.arch.value} is dense; found expert_count {self.n_expert}")
        if not is_moe and self.n_ff <= 0 and rules.experts is not Experts.AFTER_DENSE_LEAD:
            problems.append(f"dense model needs feed_forward_length > 0, found {self.n_ff}")
        shared = is_moe and rules.shared_expert is SharedExpert.REQUIRED
        n_ff_exp = self.n_ff_exp or (
            expert_width(rules, self.n_ff, self.n_expert_used) if is_moe else 0
        )
        n_ff_shexp = self.n_ff_shexp or (self.n_ff if shared else 0)
        if rules.shared_expert in (SharedExpert.COUNTED, SharedExpert.COUNTED_OPTIONAL):
            shared = is_moe and self.n_expert_shared > 0
            n_ff_shexp = n_ff_exp * self.n_expert_shared
        if rules.shared_expert is SharedExpert.EXPERT_WIDTH:
            shared, n_ff_shexp = is_moe, n_ff_exp
        if rules.experts is Experts.AFTER_DENSE_LEAD:
            problems += lead_problems(self, is_moe=is_moe)
        if rules.mla:
            problems += deepseek2_problems(self, head_dim=head_dim)
        if rules.dsa:
            problems += dsa_problems(self)
        if is_moe and n_ff_exp <= 0:
            problems.append(
                f"the expert width must be > 0 ({rules.expert_width}), found {n_ff_exp}"
            )
        if shared and n_ff_shexp <= 0:
            problems.append(f"the shared expert width must be > 0, found {n_ff_shexp}")
        if rules.hybrid:
            problems += hybrid_problems(self, head_dim=head_dim)
        if self.swa_layers is not None and len(self.swa_layers) != self.n_layer:
            problems.append(
                f"swa_layers has {len(self.swa_layers)} entries for {self.n_layer} layers"
            )
        if problems:
            raise HParamsError(f"{self.arch.value}: " + "; ".join(problems))
        norm = self.expert_weights_norm
        put = object.__setattr__
        put(self, "rules", rules)
        put(self, "n_ff_exp", n_ff_exp)
        put(self, "n_ff_shexp", n_ff_shexp)
        put(self, "head_dim", head_dim)
        put(self, "n_rot", n_rot)
        put(self, "rope_type", RopeType.NEOX if rules.rope_neox else RopeType.NORM)
        put(self, "norm_topk", rules.norm_topk if norm is None else norm)
        put(self, "q_per_kv", self.n_head // self.n_head_kv)
        put(self, "is_moe", is_moe)
        put(self, "has_shared_expert", shared)
        scale = self.attention_scale
        put(self, "attn_scale", head_dim**-0.5 if scale is None else scale)
        put(self, "embed_scale", math.sqrt(self.n_embd) if rules.embd_scaled else 1.0)
        put(self, "activation", Activation.GELU_TANH if rules.ffn_gelu else Activation.SILU)

    def is_local_layer(self, layer: int) -> bool:
        """Whether ``layer`` uses sliding-window attention (and the local RoPE base):
        llama.cpp's ``set_swa_pattern`` (``n_pattern == 0 || il % n_pattern < n_pattern - 1``)
        or the file's explicit per-layer pattern."""
        if self.sliding_window <= 0:
            return False
        if self.swa_layers is not None:
            return self.swa_layers[layer]
        n = self.swa_period
        return n == 0 or layer % n < n - 1

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], *, n_vocab: int | None = None, source: str | None = None
    ) -> HParams:
        """Read ``general.architecture`` and its ``{arch}.*`` keys as llama.cpp does; ``n_vocab``
        is the fallback (e.g. ``token_embd.weight``'s row count) when neither the tokenizer's
        token list nor ``{arch}.vocab_size`` is present. A key llama.cpp reads for the
        architecture and that changes what it computes, which neither the shared keys here nor
        the architecture's module read, refuses the file by name (``unimplemented_keys``);
        ``source`` names the file in the message."""
        arch_name = md.get(Keys.General.ARCHITECTURE)
        if arch_name is None:
            raise HParamsError(f"metadata has no {Keys.General.ARCHITECTURE!r} key")
        try:
            arch = Arch(str(arch_name))
        except ValueError:
            supported = ", ".join(a.value for a in Arch)
            raise HParamsError(
                f"unsupported architecture {arch_name!r} ({Keys.General.ARCHITECTURE}); "
                f"the reference decoder implements: {supported}"
            ) from None
        rules = rules_of(arch)
        reader = KeyReader(md, arch.value, per_layer=rules.per_layer_keys)
        # llama_model_base::load_hparams: the keys every architecture shares. feed_forward_length,
        # head_count(_kv) and expert_used_count may be per-layer arrays (get_key_or_arr).
        n_embd = reader.get_int(Keys.LLM.EMBEDDING_LENGTH)
        n_head = reader.get_int(Keys.LLM.HEAD_COUNT)
        n_ff = reader.get_int(Keys.LLM.FEED_FORWARD_LENGTH, 0)
        n_expert = reader.get_int(Keys.LLM.EXPERT_COUNT, 0)
        n_used = reader.get_int(Keys.LLM.EXPERT_USED_COUNT, 0)
        default_head = n_embd // n_head if n_head > 0 else 0
        key_length = reader.get_int(Keys.LLM.KEY_LENGTH, default_head)
        value_length = reader.get_int(Keys.LLM.VALUE_LENGTH, default_head)
        if value_length != key_length and not rules.mla:
            reader.problems.append(
                f"{Keys.LLM.VALUE_LENGTH.format(arch.value)} = {value_length} differs from the key "
                f"length {key_length}: the reference decoder needs equal head widths"
            )
        kwargs: dict[str, Any] = {
            "n_layer": reader.get_int(Keys.LLM.BLOCK_COUNT),
            "n_embd": n_embd,
            "n_head": n_head,
            "n_head_kv": reader.get_int(Keys.LLM.HEAD_COUNT_KV, n_head),
            "n_vocab": reader.vocab(n_vocab),
            "n_ff": n_ff,
            "norm_eps": reader.get_float(Keys.LLM.RMS_EPS),
            "rope_base": reader.get_float(Keys.LLM.ROPE_FREQ_BASE, 10000.0),
            "context_length": reader.get_int(Keys.LLM.CONTEXT_LENGTH),
            "n_expert": n_expert,
            "n_expert_used": n_used,
            "key_length": key_length if key_length != default_head else None,
            "rope_dim": reader.get_optional_int(Keys.LLM.ROPE_DIMENSION_COUNT),
            "rope_freq_scale": _rope_freq_scale(reader, yarn=rules.rope_yarn),
        }
        # The architecture's own keys: its module's read_keys (its load_arch_hparams).
        from ggufswap.runtime.models.registry import architecture

        module = architecture(arch)
        kwargs.update(module.read_keys(reader, kwargs))
        reader.problems += unimplemented_keys(md, arch, module.keys)
        if reader.problems:
            lines = "\n  ".join(reader.problems)
            where = f" from {source}" if source else ""
            raise HParamsError(f"cannot build a {arch.value} model config{where}:\n  {lines}")
        return cls(arch=arch, **kwargs)


def unimplemented_keys(md: Mapping[str, Any], arch: Arch, own_keys: Iterable[str]) -> list[str]:
    """One line for each key of ``md`` that llama.cpp reads for ``arch`` and that changes what
    it computes (``shards.archs``: the shared keys and the architecture's ``llama_cpp_keys``),
    which neither ``HParams.from_metadata`` nor the architecture's module (``own_keys``) reads,
    unless it holds llama.cpp's no-op default."""
    implemented = {*SHARED_KEYS, *own_keys}
    lines = []
    for template in (*SHARED_LLAMA_CPP_KEYS, *rules_of(arch).llama_cpp_keys):
        key = template.format(arch.value)
        if key not in md or template in implemented:
            continue
        value = md[key]
        scalar = isinstance(value, (bool, int, float, str))
        if scalar and value in NEUTRAL_VALUES.get(template, ()):
            continue
        lines.append(
            f"{key} = {value!r}: llama.cpp's {arch.value} uses this key and it changes what the "
            "model computes; the reference decoder does not implement it, so the file is refused"
        )
    return lines


def expert_width(rules: ArchRules, n_ff: int, n_expert_used: int) -> int:
    """The routed experts' width when the file has no ``expert_feed_forward_length``: llama's
    ``feed_forward_length`` (llama_model_llama::load_arch_tensors), else the qwen MoE loaders'
    ``n_ff / n_expert_used``."""
    if rules.expert_width is ExpertWidth.FEED_FORWARD_LENGTH:
        return n_ff
    if rules.expert_width is ExpertWidth.EXPERT_KEY:
        return 0  # only expert_feed_forward_length sizes them (required)
    return n_ff // n_expert_used if n_expert_used > 0 else 0


_MISSING: Final = object()


def _rope_freq_scale(reader: KeyReader, *, yarn: bool = False) -> float:
    """llama_model_base::load_hparams: ``rope.scaling.type`` defaults to ``linear``; the factor is
    ``rope.scaling.factor`` (or the old ``rope.scale_linear``), 0 meaning none, and the frequency
    scale its inverse; type ``none`` never scales (llama_context). Other types are refused, but
    ``yarn`` where the decoder implements it (``yarn=True``)."""
    kind = str(reader.md.get(Keys.LLM.ROPE_SCALING_TYPE.format(reader.arch), ROPE_SCALING_LINEAR))
    has_factor = Keys.LLM.ROPE_SCALING_FACTOR.format(reader.arch) in reader.md
    factor_key = Keys.LLM.ROPE_SCALING_FACTOR if has_factor else Keys.LLM.ROPE_SCALE_LINEAR
    factor = reader.get_float(factor_key, 0.0)
    if kind == ROPE_SCALING_NONE or factor in (0.0, 1.0):
        return 1.0
    if kind != ROPE_SCALING_LINEAR and not (yarn and kind == ROPE_SCALING_YARN):
        reader.problems.append(
            f"{Keys.LLM.ROPE_SCALING_TYPE.format(reader.arch)} = {kind!r}: only "
            f"{ROPE_SCALING_LINEAR!r} RoPE scaling is implemented"
            + (
                f" and {ROPE_SCALING_YARN!r}"
                if yarn
                else f" ({ROPE_SCALING_YARN!r} for deepseek2 and gpt-oss)"
            )
        )
        return 1.0
    return 1.0 / factor


class KeyReader:
    """Reads ``{arch}.*`` keys, collecting every problem instead of stopping at the first."""

    def __init__(self, md: Mapping[str, Any], arch: str, *, per_layer: Iterable[str] = ()) -> None:
        self.md = md
        self.arch = arch
        self.problems: list[str] = []
        # Templates whose per-layer arrays the architecture's module reads (the first value here)
        self.per_layer = frozenset(per_layer)

    def _get(self, template: str, default: object) -> object:
        key = template.format(self.arch)
        if key in self.md:
            return self.md[key]
        if default is _MISSING:
            self.problems.append(f"missing required key {key!r}")
        return default

    def get_int(self, template: str, default: object = _MISSING) -> int:
        value = self._get(template, default)
        if value is _MISSING:
            return 0
        if isinstance(value, (list, tuple)):  # a per-layer array (llama.cpp's get_key_or_arr)
            if len(set(value)) > 1 and template not in self.per_layer:
                self.problems.append(
                    f"{template.format(self.arch)}: per-layer values {list(value)} differ; the "
                    "reference decoder implements one value for every layer"
                )
                return 0
            value = value[0] if value else 0
        try:
            return int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            self.problems.append(
                f"{template.format(self.arch)}: expected an integer, found {value!r}"
            )
            return 0

    def get_optional_int(self, template: str) -> int | None:
        return None if template.format(self.arch) not in self.md else self.get_int(template)

    def get_float(self, template: str, default: object = _MISSING) -> float:
        value = self._get(template, default)
        if value is _MISSING:
            return 0.0
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            self.problems.append(
                f"{template.format(self.arch)}: expected a number, found {value!r}"
            )
            return 0.0

    def vocab(self, fallback: int | None) -> int:
        """llama.cpp sizes token_embd and output by the tokenizer's token list
        (``vocab.n_tokens()``; ``{arch}.vocab_size`` only names the model size), so the list
        comes first, then ``{arch}.vocab_size``, then ``fallback``."""
        key = Keys.LLM.VOCAB_SIZE.format(self.arch)
        tokens = self.md.get(Keys.Tokenizer.TOKENS)
        if tokens is not None and hasattr(tokens, "__len__"):
            return len(tokens)
        count = getattr(tokens, "count", None)  # an array the header left on disk (ArrayRef)
        if isinstance(count, int):
            return count
        if key in self.md:
            return self.get_int(Keys.LLM.VOCAB_SIZE)
        if fallback is not None:
            return fallback
        self.problems.append(
            f"missing {Keys.Tokenizer.TOKENS!r} and {key!r}; pass n_vocab= "
            "(the row count of token_embd.weight)"
        )
        return 0
