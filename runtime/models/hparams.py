"""Hyper-parameters of the reference decoder, read from GGUF metadata the way llama.cpp reads them.

Supported architectures (``general.architecture``):

- ``llama``: dense, or Mixtral-style MoE when ``llama.expert_count`` > 0 (softmax over the top-k
  router logits, which equals softmax over all then renormalising the top-k). RoPE type NORM.
- ``qwen2moe``: softmax over all experts then top-k, *not* renormalised; a shared expert with a
  sigmoid gate. RoPE type NEOX.
- ``qwen3moe``: softmax over all experts then top-k, renormalised (``expert_weights_norm``);
  per-head RMS norms on Q and K. RoPE type NEOX.
- ``qwen2`` / ``qwen3``: the dense qwen decoders (Q/K/V biases for qwen2, per-head Q/K norms for
  qwen3, both read when the file has them). RoPE type NEOX.
- ``gemma3``: GeGLU (tanh GELU), Q/K norms, post-attention and post-FFN norms, embeddings scaled
  by ``sqrt(n_embd)``, sliding-window attention on five layers of every six (local RoPE base
  10000, global layers use ``rope.freq_base`` and linear ``rope.scaling.factor``). RoPE NEOX.

``docs/models.md`` lists every key and tensor each architecture reads.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ggufswap.runtime.models.errors import HParamsError
from ggufswap.shards.keys import Arch, Keys


class RopeType(enum.IntEnum):
    """llama.cpp's rope modes (``LLAMA_ROPE_TYPE_*``): which pairs of a head are rotated."""

    NORM = 0  # adjacent pairs (x[2i], x[2i+1]); GGUF conversion permutes llama's Q/K for this
    NEOX = 2  # halves (x[i], x[i + n_rot/2])


class Activation(str, enum.Enum):
    """The gated FFN's activation: llama.cpp's LLM_FFN_SILU (SwiGLU) or LLM_FFN_GELU (GeGLU)."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"


EXPERT_GATING_SOFTMAX: Final = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX

_ROPE_TYPE: Final = {arch: RopeType.NORM if arch is Arch.LLAMA else RopeType.NEOX for arch in Arch}
# Whether the top-k routing weights are renormalised to sum to one (llama.cpp's ``norm_w``).
_NORM_TOPK: Final = {arch: arch is not Arch.QWEN2MOE for arch in Arch}
_MOE_ONLY: Final = frozenset({Arch.QWEN2MOE, Arch.QWEN3MOE})
_DENSE_ONLY: Final = frozenset({Arch.QWEN2, Arch.QWEN3, Arch.GEMMA3})
# gemma3 (llama.cpp's hparams for LLM_ARCH_GEMMA3): every 6th layer is global, the others slide;
# local layers use RoPE base 10000 without scaling.
GEMMA3_SWA_PERIOD: Final = 6
GEMMA3_ROPE_BASE_LOCAL: Final = 10000.0
ROPE_SCALING_LINEAR: Final = "linear"


@dataclass(frozen=True)
class HParams:
    """What the decoder needs to know about a model; derived fields are set in ``__post_init__``."""

    arch: Arch
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_ff: int = 0  # dense FFN width; 0 for MoE-only models
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    context_length: int = 2048
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0  # expert FFN width; 0 = llama.cpp's default n_ff / n_expert_used
    key_length: int | None = None  # per-head dim when it is not n_embd / n_head (qwen3)
    rope_dim: int | None = None  # rotated dims per head; None = the whole head
    expert_weights_norm: bool | None = None  # None = the architecture's default
    expert_weights_scale: float = 1.0
    sliding_window: int = 0  # tokens a local layer sees (itself included); 0 = no local layers
    swa_period: int = 0  # layer i is local iff i % swa_period < swa_period - 1; 0 = none
    rope_base_local: float | None = None  # RoPE base of local layers; None = rope_base
    rope_freq_scale: float = 1.0  # linear RoPE scaling of global layers (1 / scaling.factor)
    final_logit_softcap: float = 0.0  # 0 = none; else logits = c * tanh(logits / c)

    # Derived.
    head_dim: int = field(init=False)
    n_rot: int = field(init=False)
    rope_type: RopeType = field(init=False)
    norm_topk: bool = field(init=False)
    q_per_kv: int = field(init=False)
    is_moe: bool = field(init=False)
    attn_scale: float = field(init=False)  # softmax scale of Q.K
    embed_scale: float = field(init=False)  # token embeddings are multiplied by this
    activation: Activation = field(init=False)

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_vocab"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, found {getattr(self, name)}")
        if problems:
            raise HParamsError(f"{self.arch.value}: " + "; ".join(problems))
        head_dim = self.key_length if self.key_length is not None else self.n_embd // self.n_head
        if self.key_length is None and self.n_embd % self.n_head:
            problems.append(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.n_head_kv:
            problems.append(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        n_rot = self.rope_dim if self.rope_dim is not None else head_dim
        if n_rot % 2 or not 0 < n_rot <= head_dim:
            problems.append(f"rope dims {n_rot} must be even and in (0, head_dim={head_dim}]")
        is_moe = self.n_expert > 0
        if is_moe and not 0 < self.n_expert_used <= self.n_expert:
            problems.append(f"expert_used_count {self.n_expert_used} not in [1, {self.n_expert}]")
        if self.arch in _MOE_ONLY and not is_moe:
            problems.append(f"{self.arch.value} needs expert_count > 0")
        if self.arch in _DENSE_ONLY and is_moe:
            problems.append(f"{self.arch.value} is dense; found expert_count {self.n_expert}")
        if self.swa_period and self.sliding_window <= 0:
            problems.append(f"sliding_window must be > 0, found {self.sliding_window}")
        if not is_moe and self.n_ff <= 0:
            problems.append(f"dense model needs feed_forward_length > 0, found {self.n_ff}")
        if problems:
            raise HParamsError(f"{self.arch.value}: " + "; ".join(problems))
        norm = self.expert_weights_norm
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "n_rot", n_rot)
        object.__setattr__(self, "rope_type", _ROPE_TYPE[self.arch])
        object.__setattr__(self, "norm_topk", _NORM_TOPK[self.arch] if norm is None else norm)
        object.__setattr__(self, "q_per_kv", self.n_head // self.n_head_kv)
        object.__setattr__(self, "is_moe", is_moe)
        # llama.cpp scales by 1/sqrt(n_embd_head_k) for gemma3 too (all sizes but 27B, whose
        # query_pre_attn_scalar is n_embd / n_head: key_length covers both).
        object.__setattr__(self, "attn_scale", head_dim**-0.5)
        gemma = self.arch is Arch.GEMMA3
        object.__setattr__(self, "embed_scale", math.sqrt(self.n_embd) if gemma else 1.0)
        object.__setattr__(self, "activation", Activation.GELU_TANH if gemma else Activation.SILU)

    def is_local_layer(self, layer: int) -> bool:
        """Whether ``layer`` uses sliding-window attention (and the local RoPE base)."""
        return self.swa_period > 0 and layer % self.swa_period < self.swa_period - 1

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], *, n_vocab: int | None = None) -> HParams:
        """Read ``general.architecture`` and its ``{arch}.*`` keys; ``n_vocab`` is the fallback
        (e.g. ``token_embd.weight``'s row count) when neither ``{arch}.vocab_size`` nor the
        tokenizer's token list is present."""
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
        reader = _KeyReader(md, arch.value)
        n_head = reader.get_int(Keys.LLM.HEAD_COUNT)
        gating = reader.get_int(Keys.LLM.EXPERT_GATING_FUNC, EXPERT_GATING_SOFTMAX)
        if gating != EXPERT_GATING_SOFTMAX:
            reader.problems.append(
                f"{Keys.LLM.EXPERT_GATING_FUNC.format(arch.value)} = {gating}: only softmax "
                f"gating ({EXPERT_GATING_SOFTMAX}) is implemented"
            )
        scale = reader.get_float(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0)
        norm_key = Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch.value)
        kwargs: dict[str, Any] = {
            "n_layer": reader.get_int(Keys.LLM.BLOCK_COUNT),
            "n_embd": reader.get_int(Keys.LLM.EMBEDDING_LENGTH),
            "n_head": n_head,
            "n_head_kv": reader.get_int(Keys.LLM.HEAD_COUNT_KV, n_head),
            "n_vocab": reader.vocab(n_vocab),
            "n_ff": reader.get_int(Keys.LLM.FEED_FORWARD_LENGTH, 0),
            "norm_eps": reader.get_float(Keys.LLM.RMS_EPS),
            "rope_base": reader.get_float(Keys.LLM.ROPE_FREQ_BASE, 10000.0),
            "context_length": reader.get_int(Keys.LLM.CONTEXT_LENGTH),
            "n_expert": reader.get_int(Keys.LLM.EXPERT_COUNT, 0),
            "n_expert_used": reader.get_int(Keys.LLM.EXPERT_USED_COUNT, 0),
            "n_ff_exp": reader.get_int(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0),
            "key_length": reader.get_optional_int(Keys.LLM.KEY_LENGTH),
            "rope_dim": reader.get_optional_int(Keys.LLM.ROPE_DIMENSION_COUNT),
            "expert_weights_norm": bool(md[norm_key]) if norm_key in md else None,
            "expert_weights_scale": scale if scale != 0.0 else 1.0,  # llama.cpp: 0 = unset
            "final_logit_softcap": reader.get_float(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0),
            "rope_freq_scale": _rope_freq_scale(reader),
        }
        if arch is Arch.GEMMA3:
            kwargs.update(
                sliding_window=reader.get_int(Keys.LLM.SLIDING_WINDOW),
                swa_period=GEMMA3_SWA_PERIOD,
                rope_base_local=GEMMA3_ROPE_BASE_LOCAL,
            )
        if reader.problems:
            lines = "\n  ".join(reader.problems)
            raise HParamsError(f"cannot build a {arch.value} model config:\n  {lines}")
        return cls(arch=arch, **kwargs)


_MISSING: Final = object()


def _rope_freq_scale(reader: _KeyReader) -> float:
    """``1 / {arch}.rope.scaling.factor`` for linear scaling; 1.0 without scaling."""
    kind = str(reader.md.get(Keys.LLM.ROPE_SCALING_TYPE.format(reader.arch), "none"))
    factor = reader.get_float(Keys.LLM.ROPE_SCALING_FACTOR, 0.0)
    if kind == "none" or factor in (0.0, 1.0):
        return 1.0
    if kind != ROPE_SCALING_LINEAR:
        reader.problems.append(
            f"{Keys.LLM.ROPE_SCALING_TYPE.format(reader.arch)} = {kind!r}: only "
            f"{ROPE_SCALING_LINEAR!r} RoPE scaling is implemented"
        )
        return 1.0
    return 1.0 / factor


class _KeyReader:
    """Reads ``{arch}.*`` keys, collecting every problem instead of stopping at the first."""

    def __init__(self, md: Mapping[str, Any], arch: str) -> None:
        self.md = md
        self.arch = arch
        self.problems: list[str] = []

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
        key = Keys.LLM.VOCAB_SIZE.format(self.arch)
        if key in self.md:
            return self.get_int(Keys.LLM.VOCAB_SIZE)
        tokens = self.md.get(Keys.Tokenizer.TOKENS)
        if tokens is not None and hasattr(tokens, "__len__"):
            return len(tokens)
        count = getattr(tokens, "count", None)  # an array the header left on disk (ArrayRef)
        if isinstance(count, int):
            return count
        if fallback is not None:
            return fallback
        self.problems.append(
            f"missing {key!r} and {Keys.Tokenizer.TOKENS!r}; pass n_vocab= "
            "(the row count of token_embd.weight)"
        )
        return 0
