"""Llama 4 (``general.architecture = llama4``): llama.cpp's ``llama_model_llama4``
(``src/models/llama4.cpp``, its iSWA graph).

- Layers ``i`` with ``i % 4 < 3`` (or as ``attention.sliding_window_pattern`` says) attend in
  chunks: a query sees the earlier keys of its own chunk of 8192 positions (llama.cpp sets the
  chunk itself, whatever ``attention.sliding_window`` holds, except 0, which it cannot run:
  refused); they rotate by RoPE NORM (base ``rope.freq_base_swa``, default ``rope.freq_base``;
  optional ``rope_freqs`` factors) and then RMS-normalise Q and K per head without a weight
  (unless the model has 128 experts: Maverick, as llama.cpp decides).
- Layers ``i`` with ``(i + 1) % 4 == 0`` attend to every earlier position without RoPE (NoPE),
  their queries scaled by the attention temperature ``log(floor((p + 1) / 8192) + 1) * 0.1 + 1``.
- Blocks ``(i + 1) % interleave_moe_layer_step == 0`` route: the ``expert_used_count`` largest
  router logits choose, each chosen expert sees its input times ``sigmoid(logit)`` (the weight
  is applied before the expert), and an ungated shared expert of the same width is added; the
  other blocks are dense SwiGLU of ``feed_forward_length``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import numpy as np
import torch
from torch import Tensor, nn

from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.attention import Attention, attend
from ggufswap.runtime.models.blocks.decoder import DecoderStack, LayerInputs, TransformerBlock
from ggufswap.runtime.models.blocks.ffn import FeedForward, swiglu
from ggufswap.runtime.models.blocks.moe import combine_experts
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables, RotaryEmbedding
from ggufswap.runtime.models.blocks.weights import (
    TensorSpec,
    WeightProvider,
    linear,
    refuse_weight_scales,
)
from ggufswap.runtime.models.hparams import Arch, HParams, KeyReader
from ggufswap.runtime.models.kv_cache import KVCache, attention_mask
from ggufswap.shards.keys import Keys, TensorNames

# llama_model_llama4::load_arch_hparams sets these itself (hparams.n_swa and the temperature).
CHUNK: Final = 8192
SWA_PERIOD: Final = 4  # load_swa_pattern(ml, 4): three chunked layers, then a global one
NO_ROPE_STEP: Final = 4  # hparams.n_no_rope_layer_step
TEMP_FLOOR_SCALE: Final = 8192
TEMP_SCALE: Final = 0.1
TEMP_OFFSET: Final = 1.0
MAVERICK_EXPERTS: Final = 128  # LLM_TYPE_17B_128E: no Q/K norm
KEYS: Final = (
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    Keys.LLM.INTERLEAVE_MOE_LAYER_STEP,
    Keys.LLM.SLIDING_WINDOW,
    Keys.LLM.SLIDING_WINDOW_PATTERN,
    Keys.LLM.ROPE_FREQ_BASE_SWA,
)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_llama4::load_arch_hparams: the experts' width and step (both required), the
    chunked layers' pattern and RoPE base."""
    k = Keys.LLM
    step = reader.get_int(k.INTERLEAVE_MOE_LAYER_STEP)
    if step < 1:
        reader.problems.append(f"{k.INTERLEAVE_MOE_LAYER_STEP.format(reader.arch)} must be >= 1")
    window_key = k.SLIDING_WINDOW.format(reader.arch)
    if window_key in reader.md and reader.get_int(k.SLIDING_WINDOW) == 0:
        reader.problems.append(
            f"{window_key} = 0 (no chunked layers, MobileLLM): llama.cpp 0.3.36 builds its "
            "attention-temperature input without a temperature and aborts "
            "(GGML_ASSERT(f_attn_temp_scale != 0.0f)); the reference decoder does not run it"
        )
    out: dict[str, Any] = {
        "n_ff_exp": reader.get_int(k.EXPERT_FEED_FORWARD_LENGTH),
        "moe_layer_step": max(step, 1),
        "sliding_window": CHUNK,
        "rope_base_local": reader.get_float(k.ROPE_FREQ_BASE_SWA, common["rope_base"]),
    }
    pattern = reader.md.get(k.SLIDING_WINDOW_PATTERN.format(reader.arch), SWA_PERIOD)
    if isinstance(pattern, (list, tuple)):
        out["swa_layers"] = tuple(bool(v) for v in pattern)[: common["n_layer"]]
    else:
        out["swa_period"] = reader.get_int(k.SLIDING_WINDOW_PATTERN, SWA_PERIOD)
    return out


@dataclass(frozen=True)
class NoRope(RopeTables):
    """A NoPE layer's inputs: no rotation, and each query position's attention temperature."""

    temperature: Tensor  # [T] float32

    def rotate(self, x: Tensor) -> Tensor:
        return x


def temperature(start: int, length: int, device: torch.device) -> Tensor:
    """``[T]`` llm_graph_input_attn_temp: ``log(floor((p + 1) / 8192) + 1) * 0.1 + 1`` with
    the float position and float division, the rest in double, stored as float."""
    pos = np.arange(start, start + length, dtype=np.float32)
    floor = np.floor((pos + np.float32(TEMP_OFFSET)) / np.float32(TEMP_FLOOR_SCALE))
    scale = np.log(floor.astype(np.float64) + 1.0) * np.float64(np.float32(TEMP_SCALE)) + 1.0
    return torch.from_numpy(scale.astype(np.float32)).to(device)


def chunked_mask(start: int, length: int, *, cached: bool, device: torch.device) -> Tensor | None:
    """``[T, S]`` bool (S = ``start + T`` keys with a cache, else this forward's ``T``): the query
    at ``p`` sees keys ``k <= p`` of its own chunk (``k >= (p // 8192) * 8192``,
    llama_hparams::is_masked_swa CHUNKED). None where that is plain causal attention."""
    first = 0 if cached else start
    if first == start and start // CHUNK == (start + length - 1) // CHUNK:
        return None if not cached or start == 0 else attention_mask(start, length, device=device)
    query = torch.arange(start, start + length, device=device)[:, None]
    key = torch.arange(first, start + length, device=device)[None, :]
    return (key <= query) & (key >= (query // CHUNK) * CHUNK)


class Llama4Attention(Attention):
    """Attention with RoPE and weightless per-head Q/K RMS norms, or (NoPE layers) without
    RoPE and with the queries' temperature."""

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        # x: [B, T, D]
        c, (bsz, seq, _) = self.config, x.shape
        q = self._proj(x, self.wq, self.bq).view(bsz, seq, c.n_head, c.head_dim)
        k = self._proj(x, self.wk, self.bk).view(bsz, seq, c.n_head_kv, c.head_dim)
        v = self._proj(x, self.wv, self.bv).view(bsz, seq, c.n_head_kv, c.head_dim)
        if isinstance(rope, NoRope):
            q = q * rope.temperature[None, :, None, None].to(q.dtype)
        else:
            q, k = rope.rotate(q), rope.rotate(k)
            if c.n_expert != MAVERICK_EXPERTS:  # hparams.use_kq_norm (Llama4TextL2Norm)
                ones = torch.ones(c.head_dim)
                q, k = rms_norm(q, ones, c.norm_eps), rms_norm(k, ones, c.norm_eps)
        y = attend(q, k, v, layer=self.layer, scale=c.attn_scale, mask=mask, cache=cache)
        return self._proj(y, self.wo, self.bo)  # [B, T, D]


class Llama4Experts(nn.Module):
    """build_moe_ffn as llama4 calls it (sigmoid weights before the experts) + the shared
    expert."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        self.config, self.weights = config, weights
        tn, d, n_exp, ff = TensorNames, config.n_embd, config.n_expert, config.n_ff_exp
        self.router = spec.need(tn.FFN_GATE_INP.format(layer), (n_exp, d))
        self.gate_exps = spec.need_experts(tn.FFN_GATE_EXPS.format(layer), (n_exp, ff, d))
        self.up_exps = spec.need_experts(tn.FFN_UP_EXPS.format(layer), (n_exp, ff, d))
        self.down_exps = spec.need_experts(tn.FFN_DOWN_EXPS.format(layer), (n_exp, d, ff))
        shared = (tn.FFN_GATE_SHEXP, tn.FFN_UP_SHEXP, tn.FFN_DOWN_SHEXP)
        shapes = ((ff, d), (ff, d), (d, ff))
        self.shared = tuple(
            spec.need(t.format(layer), s) for t, s in zip(shared, shapes, strict=True)
        )
        spec.refuse(weights, [tn.FFN_GATE_INP_SHEXP.format(layer)], "llama4's shared expert")

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k by router logit; weights ``sigmoid(logit)``: ``([N, k], [N, k])``."""
        logits = linear(x, self.weights.weight(self.router)).float()  # [N, E]
        top_logits, top_i = logits.topk(self.config.n_expert_used, dim=-1)
        return torch.sigmoid(top_logits), top_i

    def expert(self, x: Tensor, e: int) -> Tensor:
        w = self.weights.experts
        return swiglu(x, w(self.gate_exps)[e], w(self.up_exps)[e], w(self.down_exps)[e])

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, T, D]
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        top_w, top_i = self.route(flat)  # [N, k]
        out = combine_experts(flat, top_w, top_i, self.expert, weight_before=True)
        gate, up, down = (self.weights.matrix(name) for name in self.shared)
        return (out + swiglu(flat, gate, up, down)).view_as(x)


class Llama4Block(TransformerBlock):
    """Pre-norm attention (chunked with RoPE, or NoPE) and a dense or routed FFN."""

    attention_cls: ClassVar[type[nn.Module]] = Llama4Attention

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__(config, weights, layer, spec)
        refuse_weight_scales(spec, weights, layer)

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        moe = (layer + 1) % self.config.moe_layer_step == 0
        return Llama4Experts if moe else FeedForward


class Llama4Transformer(DecoderStack):
    """The llama4 decoder: chunked RoPE layers and NoPE global layers."""

    arch = Arch.LLAMA4
    block = Llama4Block

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        scale = config.rope_freq_scale
        self.rope = RotaryEmbedding(config, freq_scale=scale)  # global layers' base
        self.rope_local = RotaryEmbedding(config, base=config.rope_base_local, freq_scale=scale)

    def _tables(self, rope: nn.Module, start: int, seq: int, device: torch.device) -> Any:
        if self.rope_freqs is None:
            return rope(start, seq, device)
        return rope(start, seq, device, factors=self.weights.weight(self.rope_freqs))

    def layer_inputs(
        self, start: int, seq: int, device: torch.device, *, cached: bool
    ) -> list[LayerInputs]:
        """Chunked layers: the chunk mask and RoPE of base ``rope.freq_base_swa``; the others
        causal (``get_rope_freq_base``: ``rope.freq_base``). Layers ``(i + 1) % 4 == 0`` have no
        RoPE but the queries' temperature (by default, exactly the global layers)."""
        c = self.config
        masks = {
            True: chunked_mask(start, seq, cached=cached, device=device),
            False: attention_mask(start, seq, device=device) if cached else None,
        }
        empty = torch.empty(seq, 0)
        nope = NoRope(empty, empty, 0, c.rope_type, temperature(start, seq, device))
        tables = {
            True: self._tables(self.rope_local, start, seq, device),
            False: self._tables(self.rope, start, seq, device),
        }
        out: list[LayerInputs] = []
        for i in range(self.n_trunk):
            local = c.is_local_layer(i)
            uses_rope = (i + 1) % NO_ROPE_STEP != 0
            out.append((tables[local] if uses_rope else nope, masks[local]))
        return out


ARCHITECTURE = Architecture(
    arch=Arch.LLAMA4, decoder=Llama4Transformer, read_keys=read_keys, keys=KEYS
)
