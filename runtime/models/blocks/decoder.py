"""What every decoder shares: the pre-norm block and the stack (embedding -> blocks -> final
norm -> head), with the KV cache threaded through the blocks.

An architecture's module subclasses :class:`TransformerBlock` and :class:`DecoderStack` and names
only what differs (the FFN's norm tensor, the attention and the FFN of each layer, its RoPE and
masks); ``forward(tokens [B, T]) -> logits [B, T, V]`` (float32).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, TypeAlias, TypeVar

import torch
from torch import Tensor, nn

from ggufswap.runtime.models.blocks.attention import Attention, decode_keys
from ggufswap.runtime.models.blocks.ffn import FeedForward
from ggufswap.runtime.models.blocks.ggml_decode import stack_step
from ggufswap.runtime.models.blocks.ggml_steps import StepLayer, block_moe_layer, step_moe_layer
from ggufswap.runtime.models.blocks.moe import MoEFeedForward
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables, RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import (
    Matrix,
    TensorSpec,
    WeightProvider,
    check_weights,
    linear,
)
from ggufswap.runtime.models.errors import HParamsError
from ggufswap.runtime.models.hparams import Arch, HParams
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.shards.keys import TensorNames


class TransformerBlock(nn.Module):
    """Pre-norm attention and FFN with residuals: ``h = x + attn(attn_norm(x))``, then
    ``h + ffn(ffn_norm(h))``. The other decoders' blocks of this shape subclass it and name
    only what differs: the FFN's norm tensor, the attention and the FFN of each layer."""

    ffn_norm_name: ClassVar[str] = TensorNames.FFN_NORM
    attention_cls: ClassVar[type[nn.Module]] = Attention

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights = config, weights
        self.attn_norm = spec.need(TensorNames.ATTN_NORM.format(layer), (config.n_embd,))
        self.ffn_norm = spec.need(self.ffn_norm_name.format(layer), (config.n_embd,))
        self.attention = self.attention_cls_for(layer)(config, weights, layer, spec)
        self.feed_forward = self.ffn_cls(layer)(config, weights, layer, spec)

    def attention_cls_for(self, layer: int) -> type[nn.Module]:
        """The attention of ``layer`` (hybrid models mix kinds): ``attention_cls``."""
        return self.attention_cls

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        """The FFN of ``layer``: llama.cpp's loaders of the llama and qwen families give experts
        to every block or to none."""
        return MoEFeedForward if self.config.is_moe else FeedForward

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        # x: [B, T, D]
        w, eps = self.weights.weight, self.config.norm_eps
        y = self._moe_step(x, rope, mask, cache)
        if y is not None:  # ggml's numerics: a MoE block's decode step in one compiled call
            return y
        if type(self.attention) is Attention:  # its norm and products in one call where it can
            a = self.attention.normed_heads(x, self.attn_norm, rope, mask, cache)
            h = x + self.attention.project(a)
        else:
            h = x + self.attention(rms_norm(x, w(self.attn_norm), eps), rope, mask, cache)
        return h + self.feed_forward(rms_norm(h, w(self.ffn_norm), eps))

    def step_layer(self, kind: int) -> StepLayer | None:
        """This block's part of a one-call decode step in ggml's numerics (of ``kind``: which
        RoPE and keys it reads): a block with MoE experts (:func:`~.ggml_steps.step_moe_layer`);
        None for the others."""
        ffn = self.feed_forward
        if type(self.attention) is not Attention or not isinstance(ffn, MoEFeedForward):
            return None
        norms = (self.attn_norm, self.ffn_norm)
        return step_moe_layer(self.weights, (self.attention, ffn), norms, kind)

    def _moe_step(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor | None:
        """A decode step of a block with MoE experts in one compiled call
        (:func:`~.ggml_steps.block_moe_layer`), or None (the caller steps)."""
        ffn = self.feed_forward
        if cache is None or x.shape[1] != 1 or type(self.attention) is not Attention:
            return None
        if not isinstance(ffn, MoEFeedForward):
            return None
        keys = decode_keys(mask, cache.length + 1)
        parts = (self.attention, ffn)
        norms = (self.attn_norm, self.ffn_norm)
        eps = self.config.norm_eps
        return block_moe_layer(
            self.weights, x, parts, norms, rope=rope, keys=keys, cache=cache, eps=eps
        )


# A block's RoPE tables and attention mask ([T, S] bool, True = may attend; None = causal within
# this forward).
LayerInputs: TypeAlias = "tuple[RopeTables, Tensor | None]"
# A block's RoPE and sliding window (0: none) in a one-token step (DecoderStack.step_kinds).
StepKind: TypeAlias = "tuple[RotaryEmbedding, int]"
_T = TypeVar("_T")


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
        spec = TensorSpec()
        self.rope_freqs = rope_freqs_of(config, weights, spec)
        self.tok_embd = spec.need(TensorNames.TOKEN_EMBD, (config.n_vocab, config.n_embd))
        self.norm = spec.need(TensorNames.OUTPUT_NORM, (config.n_embd,))
        self.output = spec.need(output_name(config, weights), (config.n_vocab, config.n_embd))
        self.layers = nn.ModuleList(
            self.block(config, weights, i, spec) for i in range(self.n_trunk)
        )
        self.required = dict(spec.required)  # every tensor a forward reads, with its shape
        check_weights(weights, spec, shapes=check_shapes)

    def forward(
        self,
        tokens: Tensor,
        *,
        start_pos: int = 0,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """Logits of ``tokens`` at positions ``start_pos ..``; with ``cache`` they also attend to
        the cached positions (``start_pos`` must be ``cache.length``) and are appended to it.
        ``last_only``: the last position's logits alone, ``[B, 1, V]`` (:meth:`logits`)."""
        # tokens: [B, T] int64 -> logits: [B, T, V] float32
        seq = tokens.shape[1]
        if cache is not None:
            logits = stack_step(self, tokens, start_pos, cache)  # ggml's numerics: one call
            if logits is not None:
                return logits
            cache.check_continues(start_pos, seq)
        x = self.embedding(tokens)  # [B, T, D]
        inputs = self.layer_inputs(start_pos, seq, tokens.device, cached=cache is not None)
        for layer, (rope, mask) in zip(self.layers, inputs, strict=True):
            x = layer(x, rope, mask, cache)
        if cache is not None:
            cache.advance(seq)
        return self.logits(x, last_only=last_only)

    def logits(self, x: Tensor, *, last_only: bool = False) -> Tensor:
        """The final norm and the output head over the hidden states ``x [B, T, D]``: float32
        ``[B, T, V]``, or with ``last_only`` the last position's, ``[B, 1, V]``: what a
        generation step reads, as llama.cpp outputs only the rows it is asked for (the head of
        a 262k vocabulary is most of a long prompt's prefill). The row is bit-identical to the
        full head's last where the products go row by row (native storage); torch's product of
        one row instead of all (dequantized) moves it within float rounding."""
        if last_only:
            x = x[:, -1:]
        x = rms_norm(x, self.weights.weight(self.norm), self.config.norm_eps)
        return lm_head(x, self.weights.matrix(self.output), self.config.final_logit_softcap)

    def embedding(self, tokens: Tensor) -> Tensor:
        """``[B, T, D]`` float32: the embedding rows of ``tokens [B, T]``, scaled."""
        return embed(tokens, self.weights, self.tok_embd, self.config.embed_scale)

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

    def step_kinds(self) -> list[StepKind] | None:
        """Per block, the RoPE and window (0: every earlier key) a one-token step at any
        position reads: what :meth:`layer_inputs` gives such a step, told without its tables and
        masks (a compiled step reads the tables' rows itself). None where a subclass's
        ``layer_inputs`` says otherwise and it does not override this too, or the RoPE factors
        are a tensor (the step then reads ``layer_inputs``)."""
        if type(self).layer_inputs is not DecoderStack.layer_inputs or self.rope_freqs is not None:
            return None
        rope = self.rope
        return [(rope, 0)] * self.n_trunk if isinstance(rope, RotaryEmbedding) else None

    def by_kind(self, *, local: _T, global_: _T) -> list[_T]:
        """``local`` for the sliding-window blocks, ``global_`` for the others."""
        return [local if self.config.is_local_layer(i) else global_ for i in range(self.n_trunk)]

    def unused(self, names: Iterable[str]) -> list[str]:
        """The tensors among ``names`` no forward reads (NextN blocks'), sorted."""
        return sorted(set(names) - set(self.required))

    def new_cache(self, *, max_len: int) -> KVCache:
        """An empty cache for one sequence of up to ``max_len`` positions (it grows past them)."""
        return KVCache(n_layer=self.n_trunk, max_len=max_len)


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


def rope_freqs_of(config: HParams, weights: WeightProvider, spec: TensorSpec) -> str | None:
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
