"""Reference llama-style decoder (dense and MoE) that reads every weight through a provider.

The modules own no weights: each ``forward`` asks the ``WeightProvider`` for the tensors it needs,
so a swap committed between two batches is what the next batch computes with. Weights may live on
different devices (mixed pools); activations move to a weight's device for each matmul and come
back (llama.cpp's hybrid CPU/GPU style). The residual stream is float32 on the device of the input
tokens; matmuls run in the weight's dtype.

The maths follows llama.cpp's graph for each architecture (see ``hparams``): RMS norms,
RoPE NORM (adjacent pairs) for ``llama`` and NEOX (halves) for the qwen MoE families, grouped-query
causal attention with scale ``1/sqrt(head_dim)``, SwiGLU FFNs, softmax top-k routing.

Size: being reworked by issue 25; split there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import ClassVar, Final, Protocol, TypeAlias

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor, nn

from ggufswap.runtime import QuantizedMatrix
from ggufswap.runtime.models.errors import HParamsError, MissingWeightError
from ggufswap.runtime.models.ggml_numerics import GgmlMatrix, gelu, ggml_norms_active
from ggufswap.runtime.models.ggml_numerics import rms_norm as ggml_rms_norm
from ggufswap.runtime.models.hparams import Activation, Arch, HParams
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.runtime.models.rope import RopeTables, RotaryEmbedding
from ggufswap.shards.keys import TensorNames


class ExpertStack(Protocol):
    """Stacked experts ``[E, ...]`` read one expert at a time: a tensor, or the store's view of
    a stack whose expert ranges live on different devices, or whose experts stay in their GGUF
    blocks (``[e]`` is then a :class:`~ggufswap.runtime.QuantizedMatrix`, which ``linear``
    multiplies from)."""

    @property
    def shape(self) -> torch.Size: ...

    def __getitem__(self, e: int, /) -> Tensor | QuantizedMatrix | GgmlMatrix: ...


class WeightProvider(Protocol):
    """Where the model reads its weights from at forward time (the runtime's tensor store)."""

    def weight(self, name: str) -> Tensor:
        """The tensor in logical torch shape (reversed ggml ``ne``), compute dtype, own device."""
        ...

    def experts(self, name: str) -> ExpertStack:
        """A stacked expert tensor; ``[e]`` is expert ``e`` on the device that holds it."""
        ...

    def matrix(self, name: str) -> Tensor | QuantizedMatrix | GgmlMatrix:
        """A weight ``linear`` multiplies by: the tensor, or (native storage) its GGUF blocks
        where multiplying from them is the cheaper way, or (numerics "ggml") its blocks to
        multiply as ggml does."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's logical torch shape, without reading its data."""
        ...

    def rows(self, name: str, ids: Tensor) -> Tensor:
        """Rows ``ids`` (any shape of int64) of a 2-D tensor: ``[*ids.shape, ne[0]]`` in the
        compute dtype, on the tensor's device (an embedding lookup)."""
        ...

    def has(self, name: str) -> bool:
        """Whether the model file holds a tensor of this name."""
        ...


class DictWeightProvider:
    """A provider over a plain dict: for tests, tools and models loaded without the store."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self._tensors = dict(tensors)

    def weight(self, name: str) -> Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise MissingWeightError(f"no tensor named {name!r} in this provider") from None

    def experts(self, name: str) -> Tensor:
        return self.weight(name)

    def matrix(self, name: str) -> Tensor:
        return self.weight(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weight(name).shape)

    def rows(self, name: str, ids: Tensor) -> Tensor:
        w = self.weight(name)
        return F.embedding(ids.to(w.device), w)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def set(self, name: str, tensor: Tensor) -> None:
        """Replace (or add) one tensor; the next forward sees it."""
        self._tensors[name] = tensor

    def names(self) -> Iterator[str]:
        return iter(self._tensors)


def linear(x: Tensor, w: Tensor | QuantizedMatrix | GgmlMatrix, b: Tensor | None = None) -> Tensor:
    """``x @ w.T (+ b)`` on ``w``'s device and dtype; the result returns to ``x``'s device/dtype.

    ``w`` may be a matrix still in its GGUF blocks (native storage's experts): it multiplies
    from them (:class:`~ggufswap.runtime.QuantizedMatrix`); or a weight of a decoder with ggml's
    numerics: the activations are rounded as ggml's CPU matmul rounds them (:mod:`.ggml_numerics`).
    """
    if isinstance(w, GgmlMatrix):
        return w.linear(x, b)
    if isinstance(w, QuantizedMatrix):
        y = w.linear(x, dtype=x.dtype if x.is_floating_point() else torch.float32)
        if b is not None:
            y = y + b.to(device=y.device, dtype=y.dtype)
        return y.to(device=x.device, dtype=x.dtype)
    xw = x.to(device=w.device, dtype=w.dtype)
    bw = None if b is None else b.to(device=w.device, dtype=w.dtype)
    return F.linear(xw, w, bw).to(device=x.device, dtype=x.dtype)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """llama.cpp's RMS norm over the last dim, in float32, scaled by ``w`` (in a forward of a
    decoder with ggml's numerics: ggml's own rounding, :func:`.ggml_numerics.rms_norm`)."""
    if ggml_norms_active():
        return ggml_rms_norm(x, w, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.to(device=x.device, dtype=torch.float32)).to(x.dtype)


class _Spec:
    """Expected shapes of the tensors a module reads, checked once at construction."""

    def __init__(self) -> None:
        self.required: dict[str, tuple[int, ...]] = {}
        self.unexpected: list[str] = []  # tensors the architecture does not have

    def need(self, name: str, shape: tuple[int, ...]) -> str:
        self.required[name] = shape
        return name

    def need_experts(self, name: str, shape: tuple[int, ...]) -> str:
        """A stacked expert tensor (read per expert, through ``experts``)."""
        return self.need(name, shape)

    def maybe(self, weights: WeightProvider, name: str, shape: tuple[int, ...]) -> str | None:
        return self.need(name, shape) if weights.has(name) else None

    def refuse(self, weights: WeightProvider, names: Iterable[str], reason: str) -> None:
        """Record tensors present that llama.cpp's loader would refuse for this architecture."""
        self.unexpected += [
            f"{name}: {reason} (llama.cpp refuses the file: wrong number of tensors)"
            for name in names
            if weights.has(name)
        ]


class Attention(nn.Module):
    """Grouped-query causal self-attention with optional Q/K biases and per-head Q/K norms."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.config, self.weights, self.layer = config, weights, layer
        d, hd = config.n_embd, config.head_dim
        q_dim, kv_dim = config.n_head * hd, config.n_head_kv * hd
        tn = TensorNames
        self.wq = spec.need(tn.ATTN_Q.format(layer, "weight"), (q_dim, d))
        self.wk = spec.need(tn.ATTN_K.format(layer, "weight"), (kv_dim, d))
        self.wv = spec.need(tn.ATTN_V.format(layer, "weight"), (kv_dim, d))
        self.wo = spec.need(tn.ATTN_OUT.format(layer, "weight"), (d, q_dim))
        self.bq = spec.maybe(weights, tn.ATTN_Q.format(layer, "bias"), (q_dim,))
        self.bk = spec.maybe(weights, tn.ATTN_K.format(layer, "bias"), (kv_dim,))
        self.bv = spec.maybe(weights, tn.ATTN_V.format(layer, "bias"), (kv_dim,))
        self.bo = spec.maybe(weights, tn.ATTN_OUT.format(layer, "bias"), (d,))
        self.q_norm = spec.maybe(weights, tn.ATTN_Q_NORM.format(layer), (hd,))
        self.k_norm = spec.maybe(weights, tn.ATTN_K_NORM.format(layer), (hd,))

    def _proj(self, x: Tensor, w: str, b: str | None) -> Tensor:
        return linear(x, self.weights.matrix(w), None if b is None else self.weights.weight(b))

    def _norm(self, x: Tensor, name: str | None) -> Tensor:
        return x if name is None else rms_norm(x, self.weights.weight(name), self.config.norm_eps)

    def forward(
        self,
        x: Tensor,
        rope: RopeTables,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Causal attention, or attention under ``mask`` ([T, S] bool, True = may attend). With
        ``cache`` the keys are the cached ones then this forward's (S = cache.length + T)."""
        # x: [B, T, D]
        c, (bsz, seq, _) = self.config, x.shape
        q = self._proj(x, self.wq, self.bq).view(bsz, seq, c.n_head, c.head_dim)  # [B, T, H, hd]
        k = self._proj(x, self.wk, self.bk).view(bsz, seq, c.n_head_kv, c.head_dim)  # [B,T,Hkv,hd]
        v = self._proj(x, self.wv, self.bv).view(bsz, seq, c.n_head_kv, c.head_dim)
        q = rope.rotate(self._norm(q, self.q_norm))
        k = rope.rotate(self._norm(k, self.k_norm))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H(kv), T, hd]
        if cache is not None:  # the rope tables already carry start_pos = cache.length
            k, v = cache.update(self.layer, k, v)  # [B, Hkv, S, hd]
        k = k.repeat_interleave(c.q_per_kv, dim=1)  # query head h reads kv head h // q_per_kv
        v = v.repeat_interleave(c.q_per_kv, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=c.attn_scale
        )
        y = y.transpose(1, 2).reshape(bsz, seq, c.n_head * c.head_dim)  # [B, T, H*hd]
        return self._proj(y, self.wo, self.bo)  # [B, T, D]


Matrix: TypeAlias = "Tensor | QuantizedMatrix | GgmlMatrix"


def swiglu(x: Tensor, gate: Matrix, up: Matrix, down: Matrix) -> Tensor:
    """``down(silu(gate(x)) * up(x))``: llama.cpp's LLM_FFN_SILU + LLM_FFN_PAR."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def geglu(x: Tensor, gate: Matrix, up: Matrix, down: Matrix) -> Tensor:
    """``down(gelu_tanh(gate(x)) * up(x))``: llama.cpp's LLM_FFN_GELU + LLM_FFN_PAR (gemma); with
    ggml's numerics (a :class:`GgmlMatrix` gate), GELU through ggml's F16 table."""
    g = linear(x, gate)
    act = gelu(g) if isinstance(gate, GgmlMatrix) else F.gelu(g, approximate="tanh")
    return linear(act * linear(x, up), down)


GATED_FFN: Final = {Activation.SILU: swiglu, Activation.GELU_TANH: geglu}
SHARED_EXPERT_TENSORS: Final = (
    TensorNames.FFN_GATE_SHEXP,
    TensorNames.FFN_UP_SHEXP,
    TensorNames.FFN_DOWN_SHEXP,
    TensorNames.FFN_GATE_INP_SHEXP,
)


class FeedForward(nn.Module):
    """Dense gated FFN (SwiGLU, or GeGLU for gemma)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.weights = weights
        self.act = GATED_FFN[config.activation]
        d, ff = config.n_embd, config.n_ff
        self.gate = spec.need(TensorNames.FFN_GATE.format(layer), (ff, d))
        self.up = spec.need(TensorNames.FFN_UP.format(layer), (ff, d))
        self.down = spec.need(TensorNames.FFN_DOWN.format(layer), (d, ff))

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., D]
        w = self.weights.matrix
        return self.act(x, w(self.gate), w(self.up), w(self.down))


class MoEFeedForward(nn.Module):
    """Router -> top-k experts (each run over the tokens routed to it) + optional shared expert."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.config, self.weights = config, weights
        tn, d, n_exp, ff = TensorNames, config.n_embd, config.n_expert, config.n_ff_exp
        self.router = spec.need(tn.FFN_GATE_INP.format(layer), (n_exp, d))
        # Old Mixtral files (llama only) hold one tensor per expert instead of the stacks.
        self.per_expert: tuple[tuple[str, str, str], ...] | None = None
        stacked = tn.FFN_UP_EXPS.format(layer)
        old_form = not weights.has(stacked) and weights.has(tn.FFN_UP_EXPERT.format(layer, 0))
        if config.arch is Arch.LLAMA and old_form:
            self.per_expert = tuple(
                (
                    spec.need(tn.FFN_GATE_EXPERT.format(layer, e), (ff, d)),
                    spec.need(tn.FFN_UP_EXPERT.format(layer, e), (ff, d)),
                    spec.need(tn.FFN_DOWN_EXPERT.format(layer, e), (d, ff)),
                )
                for e in range(n_exp)
            )
        if self.per_expert is None:
            self.gate_exps = spec.need_experts(tn.FFN_GATE_EXPS.format(layer), (n_exp, ff, d))
            self.up_exps = spec.need_experts(stacked, (n_exp, ff, d))
            self.down_exps = spec.need_experts(tn.FFN_DOWN_EXPS.format(layer), (n_exp, d, ff))
        self.shared: tuple[str, str, str] | None = None
        self.shared_gate: str | None = None
        names = [t.format(layer) for t in SHARED_EXPERT_TENSORS]
        if config.has_shared_expert:  # qwen2moe: all four in every block, as llama.cpp loads them
            sh = config.n_ff_shexp
            self.shared = (
                spec.need(names[0], (sh, d)),
                spec.need(names[1], (sh, d)),
                spec.need(names[2], (d, sh)),
            )
            self.shared_gate = spec.need(names[3], (d,))
        else:
            spec.refuse(weights, names, f"{config.arch.value} has no shared expert")

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k expert weights and ids per token: ``([N, k] float32, [N, k] int64)``."""
        # x: [N, D]
        c = self.config
        probs = linear(x, self.weights.weight(self.router)).float().softmax(dim=-1)  # [N, E]
        top_w, top_i = probs.topk(c.n_expert_used, dim=-1)  # [N, k]
        if c.norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w * c.expert_weights_scale, top_i

    def expert(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` applied to rows ``x`` (the stacked tensors index by expert; an old
        Mixtral file's per-expert tensors are plain matrices)."""
        if self.per_expert is not None:
            return swiglu(x, *(self.weights.matrix(name) for name in self.per_expert[e]))
        w = self.weights.experts
        return swiglu(x, w(self.gate_exps)[e], w(self.up_exps)[e], w(self.down_exps)[e])

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, T, D]
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        top_w, top_i = self.route(flat)  # [N, k]
        out = torch.zeros_like(flat)
        for e in top_i.unique().tolist():  # ascending expert order: deterministic sums
            rows, slot = (top_i == e).nonzero(as_tuple=True)  # tokens routed to e, and which slot
            y = self.expert(flat[rows], e) * top_w[rows, slot, None].to(flat.dtype)
            out.index_add_(0, rows, y)
        return (out + self._shared(flat)).view_as(x)

    def _shared(self, x: Tensor) -> Tensor | float:
        # x: [N, D]
        if self.shared is None:
            return 0.0
        w = self.weights.weight
        y = swiglu(x, *(self.weights.matrix(name) for name in self.shared))  # [N, D]
        assert self.shared_gate is not None, "a shared expert always has its gate (qwen2moe)"
        return y * torch.sigmoid(linear(x, w(self.shared_gate).unsqueeze(0)))  # gate: [N, 1]


class TransformerBlock(nn.Module):
    """Pre-norm attention and FFN with residuals: ``h = x + attn(attn_norm(x))``, then
    ``h + ffn(ffn_norm(h))``. The other decoders' blocks of this shape subclass it and name
    only what differs: the FFN's norm tensor, the attention and the FFN of each layer."""

    ffn_norm_name: ClassVar[str] = TensorNames.FFN_NORM
    attention_cls: ClassVar[type[nn.Module]] = Attention

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: _Spec):
        super().__init__()
        self.config, self.weights = config, weights
        self.attn_norm = spec.need(TensorNames.ATTN_NORM.format(layer), (config.n_embd,))
        self.ffn_norm = spec.need(self.ffn_norm_name.format(layer), (config.n_embd,))
        self.attention = self.attention_cls(config, weights, layer, spec)
        self.feed_forward = self.ffn_cls(layer)(config, weights, layer, spec)

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        """The FFN of ``layer``: llama.cpp's loaders of the llama and qwen families give experts
        to every block or to none."""
        return MoEFeedForward if self.config.is_moe else FeedForward

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        w, eps = self.weights.weight, self.config.norm_eps
        h = x + self.attention(rms_norm(x, w(self.attn_norm), eps), rope, mask, cache)
        return h + self.feed_forward(rms_norm(h, w(self.ffn_norm), eps))


# A block's RoPE tables and attention mask ([T, S] bool, True = may attend; None = causal within
# this forward).
LayerInputs: TypeAlias = "tuple[RopeTables, Tensor | None]"


class DecoderStack(nn.Module):
    """What every decoder shares: embedding -> blocks -> final RMS norm -> head.

    ``forward(tokens [B, T]) -> logits [B, T, V]`` (float32). A subclass names its ``block``
    and builds its RoPE (``self.rope``) after this constructor; one whose layers differ in RoPE
    or mask (sliding windows) overrides ``layer_inputs``. The ``n_layer_nextn`` trailing NextN/MTP
    blocks (glm4moe, deepseek2) are loaded as llama.cpp loads them and never run.
    """

    arch: ClassVar[Arch | None] = None  # the one architecture it runs (None: the registry's)
    block: ClassVar[type[nn.Module]] = TransformerBlock  # (config, weights, layer, spec)
    rope: nn.Module

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__()
        if self.arch is not None and config.arch is not self.arch:
            name, runs = type(self).__name__, self.arch.value
            raise HParamsError(f"{name} runs {runs}, not {config.arch.value}")
        self.config, self.weights = config, weights
        self.n_trunk = config.n_layer - config.n_layer_nextn  # NextN blocks are not run
        spec = _Spec()
        self.rope_freqs = rope_freqs_of(config, weights, spec)
        self.tok_embd = spec.need(TensorNames.TOKEN_EMBD, (config.n_vocab, config.n_embd))
        self.norm = spec.need(TensorNames.OUTPUT_NORM, (config.n_embd,))
        self.output = spec.need(output_name(config, weights), (config.n_vocab, config.n_embd))
        self.layers = nn.ModuleList(
            self.block(config, weights, i, spec) for i in range(self.n_trunk)
        )
        self.required = dict(spec.required)  # every tensor a forward reads, with its shape
        _check(weights, spec, shapes=check_shapes)

    def forward(
        self, tokens: Tensor, *, start_pos: int = 0, cache: KVCache | None = None
    ) -> Tensor:
        """Logits of ``tokens`` at positions ``start_pos ..``; with ``cache`` they also attend to
        the cached positions (``start_pos`` must be ``cache.length``) and are appended to it."""
        # tokens: [B, T] int64 -> logits: [B, T, V] float32
        c, seq = self.config, tokens.shape[1]
        if cache is not None:
            cache.check_continues(start_pos, seq)
        x = embed(tokens, self.weights, self.tok_embd, c.embed_scale)  # [B, T, D]
        inputs = self.layer_inputs(start_pos, seq, tokens.device, cached=cache is not None)
        for layer, (rope, mask) in zip(self.layers, inputs, strict=True):
            x = layer(x, rope, mask, cache)
        if cache is not None:
            cache.advance(seq)
        x = rms_norm(x, self.weights.weight(self.norm), c.norm_eps)
        return lm_head(x, self.weights.matrix(self.output), c.final_logit_softcap)  # [B, T, V]

    def layer_inputs(
        self, start: int, seq: int, device: torch.device, *, cached: bool
    ) -> list[LayerInputs]:
        """Each block's RoPE tables and mask for positions ``start .. start + seq - 1`` (with
        ``cached``, over the cached keys too): here one RoPE and causal attention for all."""
        if self.rope_freqs is None:
            rope = self.rope(start, seq, device)
        else:  # llama 3.1+ scaling: the factors as they are at this forward
            rope = self.rope(start, seq, device, factors=self.weights.weight(self.rope_freqs))
        mask = attention_mask(start, seq, device=device) if cached else None
        return [(rope, mask)] * self.n_trunk

    def by_kind(self, *, local: LayerInputs, global_: LayerInputs) -> list[LayerInputs]:
        """``local`` for the sliding-window blocks, ``global_`` for the others."""
        return [local if self.config.is_local_layer(i) else global_ for i in range(self.n_trunk)]

    def unused(self, names: Iterable[str]) -> list[str]:
        """The tensors among ``names`` no forward reads (NextN blocks'), sorted."""
        return sorted(set(names) - set(self.required))

    def new_cache(self, *, max_len: int) -> KVCache:
        """An empty cache for one sequence of up to ``max_len`` positions (it grows past them)."""
        return KVCache(n_layer=self.n_trunk, max_len=max_len)


class Transformer(DecoderStack):
    """The llama-family decoder (llama, qwen2, qwen3, qwen2moe, qwen3moe)."""

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        self.rope = RotaryEmbedding(config, freq_scale=config.rope_freq_scale)


def embed(tokens: Tensor, weights: WeightProvider, name: str, scale: float = 1.0) -> Tensor:
    """Rows of the embedding ``name`` for ``tokens`` as float32 on the tokens' device, times
    ``scale`` (only the rows looked up are read: native storage decodes just those)."""
    # tokens: [B, T] -> [B, T, D]
    x = weights.rows(name, tokens).to(tokens.device, torch.float32)
    return x if scale == 1.0 else x * scale


def lm_head(x: Tensor, output: Matrix, softcap: float = 0.0) -> Tensor:
    """float32 logits ``x @ output.T``, soft-capped to ``(-softcap, softcap)`` when set."""
    # x: [B, T, D] -> [B, T, V]
    logits = linear(x, output).float()
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


def rope_freqs_of(config: HParams, weights: WeightProvider, spec: _Spec) -> str | None:
    """``rope_freqs.weight`` (``[n_rot/2]`` RoPE frequency factors: llama 3.1+ scaling, which
    divide each pair's frequency as ggml_rope's ``freq_factors``) when the file has it and the
    architecture's loader reads it (llama); a file of another architecture holding it is refused,
    as llama.cpp refuses it."""
    name = TensorNames.ROPE_FREQS
    if not config.rules.rope_freqs:
        spec.refuse(weights, [name], f"{config.arch.value} has no RoPE frequency factors")
        return None
    return spec.maybe(weights, name, (config.n_rot // 2,))


def output_name(config: HParams, weights: WeightProvider) -> str:
    """``output.weight``, or ``token_embd.weight`` (a tied head) when the file has no output and
    the architecture's loader allows that (not qwen2moe: there output.weight is required)."""
    if weights.has(TensorNames.OUTPUT) or not config.rules.tied_output:
        return TensorNames.OUTPUT
    return TensorNames.TOKEN_EMBD


def _check(weights: WeightProvider, spec: _Spec, *, shapes: bool) -> None:
    """Raise one error listing every missing, misshapen and unexpected tensor."""
    problems = [f"{name}: missing" for name in spec.required if not weights.has(name)]
    problems += spec.unexpected
    if shapes and not problems:
        for name, expected in spec.required.items():
            found = weights.shape(name)
            if found != expected:
                problems.append(f"{name}: expected shape {list(expected)}, found {list(found)}")
    if problems:
        lines = "\n  ".join(problems)
        raise MissingWeightError(f"the weights do not fit the model config:\n  {lines}")
