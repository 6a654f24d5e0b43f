"""DeepSeek V2/V3/R1 and Kimi-K2 decoder (``general.architecture = deepseek2``).

Follows llama.cpp's ``llama_model_deepseek2::graph`` (``src/models/deepseek2.cpp``) and its
``build_moe_ffn`` (``src/llama-graph.cpp``):

- multi-head latent attention: ``q`` from ``attn_q`` or ``attn_q_a`` -> ``attn_q_a_norm`` ->
  ``attn_q_b``; ``attn_kv_a_mqa`` gives the compressed latent (RMS-normed by
  ``attn_kv_a_norm``) and one shared rope key. Files with ``attn_k_b`` / ``attn_v_b`` run the
  absorbed form (queries multiplied into the latent space, one shared key/value head: the cache
  holds the latent); files with the older ``attn_kv_b`` decompress per-head keys and values;
  ik_llama.cpp's files (DeepSeek-R1-0528, V3-0324 as the GGUF Tool Suite ships them) hold
  ``attn_kv_b`` *and* 2-D ``attn_k_b`` ``{nope, H * rank}`` / ``attn_v_b`` ``{rank, H * v}``
  (the same matrices split per head, without the ``*_mla`` keys): mainline refuses them, ik
  computes every batch of fewer than 128 tokens (every batch without flash attention) with the
  absorbed form from ``attn_k_b`` / ``attn_v_b``, and so does this decoder for every batch;
  ``attn_kv_b`` is loaded and never read (``unused``: ik reads it only for prompt batches of
  128 tokens or more with flash attention). Such a file routes as ik routes deepseek2: without
  the group limit (``is_ik_form``);
- RoPE NORM (adjacent pairs) on the last ``rope.dimension_count`` dims of each query head and on
  the shared rope key, with linear or YaRN scaling, and the softmax scale
  ``mscale^2 / sqrt(head_k)`` llama.cpp applies (``hparams._yarn``);
- blocks ``[0, leading_dense_block_count)`` dense SwiGLU, the others routed experts plus the
  ungated shared experts; routing by softmax or sigmoid, the optional ``exp_probs_b`` bias for
  selection only, group-limited (``expert_group_count`` / ``_used_count``), weights optionally
  renormalised and scaled (``expert_weights_norm`` / ``_scale``);
- NextN/MTP blocks (``nextn_predict_layers``) are never computed (``unused``).

Every weight is read from the provider at forward time, the MLA matrices too: nothing is derived
at load, so a swap of ``attn_kv_b``, ``attn_k_b`` or ``attn_v_b`` is what the next batch uses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor, nn

from ggufswap.runtime.models._moe_hparams import ROUTING_KEYS, routing_kwargs
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.decoder import DecoderStack, TransformerBlock
from ggufswap.runtime.models.blocks.moe import lead_dense_ffn
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables, rotary
from ggufswap.runtime.models.blocks.weights import (
    ExpertStack,
    TensorSpec,
    WeightProvider,
    linear,
)
from ggufswap.runtime.models.ggml_numerics import GgmlWeights
from ggufswap.runtime.models.hparams import (
    ROPE_SCALING_YARN,
    Arch,
    Gating,
    HParams,
    KeyReader,
    MLAShape,
)
from ggufswap.runtime.models.kv_cache import KVCache
from ggufswap.shards.keys import Keys, TensorNames

TN: Final = TensorNames
# deepseek2's "lite" files (DeepSeek-V2-Lite, GigaChat3, Kanana-2) may omit q_lora_rank: these
# block counts (and 48 with a 128256-token vocabulary), as load_arch_hparams decides.
DEEPSEEK2_LITE_LAYERS: Final = (26, 27)
# No expert_gating_func: softmax (DeepSeek V2/V2.5), but sigmoid for GLM 4.7 Lite (47 or 48
# blocks, 154880 tokens).
DEEPSEEK2_SIGMOID_LAYERS: Final = (47, 48)
DEEPSEEK2_SIGMOID_VOCAB: Final = 154880


KEYS: Final = (
    *ROUTING_KEYS,
    Keys.LLM.Q_LORA_RANK,
    Keys.LLM.KV_LORA_RANK,
    Keys.LLM.KEY_LENGTH_MLA,
    Keys.LLM.VALUE_LENGTH_MLA,
    Keys.LLM.ROPE_SCALING_YARN_LOG_MUL,
    Keys.LLM.ROPE_SCALING_ATTN_FACTOR,
    Keys.LLM.ROPE_SCALING_ORIG_CTX_LEN,
)


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_deepseek2::load_arch_hparams, the YaRN parameters llama_context derives from
    them, and the graph's attention scale (src/models/deepseek2.cpp)."""
    k = Keys.LLM
    n_head = common["n_head"]
    default_head = common["n_embd"] // n_head if n_head > 0 else 0
    key_length = common["key_length"] or default_head
    value_length = reader.get_int(k.VALUE_LENGTH, default_head)
    n_rot = common["rope_dim"] or key_length
    yarn = reader.md.get(k.ROPE_SCALING_TYPE.format(reader.arch)) == ROPE_SCALING_YARN
    n_layer = common["n_layer"] - reader.get_int(k.NEXTN_PREDICT_LAYERS, 0)
    n_vocab = common["n_vocab"]
    lite = n_layer in DEEPSEEK2_LITE_LAYERS or (n_layer == 48 and n_vocab == 128256)
    k_mla = reader.get_int(k.KEY_LENGTH_MLA, 0)
    v_mla = reader.get_int(k.VALUE_LENGTH_MLA, 0)
    if (k_mla == 0) != (v_mla == 0):
        reader.problems.append(
            f"{k.KEY_LENGTH_MLA.format(reader.arch)} ({k_mla}) and "
            f"{k.VALUE_LENGTH_MLA.format(reader.arch)} ({v_mla}) must be both set or both absent"
        )
    split = k_mla != 0 and v_mla != 0
    mla = MLAShape(
        q_lora_rank=reader.get_int(k.Q_LORA_RANK, 0) if lite else reader.get_int(k.Q_LORA_RANK),
        kv_lora_rank=reader.get_int(k.KV_LORA_RANK),
        head_k=k_mla if split else key_length,
        head_v=v_mla if split else value_length,
        n_rot=n_rot,
        split=split,
    )
    sigmoid = n_layer in DEEPSEEK2_SIGMOID_LAYERS and n_vocab == DEEPSEEK2_SIGMOID_VOCAB
    out = routing_kwargs(reader, default_gating=Gating.SIGMOID if sigmoid else Gating.SOFTMAX)
    out["mla"] = replace(mla, ik_scales=_ik_scales(reader, common, head_k=mla.head_k))
    out.update(_yarn(reader, common, head_k=mla.head_k, yarn=yarn))
    return out


def _ik_scales(reader: KeyReader, common: Mapping[str, Any], *, head_k: int) -> tuple[float, float]:
    """ik_llama.cpp's kq scale and RoPE attn_factor (``src/graphs/build_deepseek2.cpp``): the log
    multiplier as the converter stored it (0.1 x mscale_all_dim), ``rope.scaling.attn_factor``
    on the kq scale; equal to llama.cpp's whenever YaRN comes with a log multiplier."""
    k, freq_scale = Keys.LLM, common["rope_freq_scale"]
    log_mul = reader.get_float(k.ROPE_SCALING_YARN_LOG_MUL, 0.0)
    mscale = reader.get_float(k.ROPE_SCALING_ATTN_FACTOR, 1.0) * (
        1.0 + log_mul * math.log(1.0 / freq_scale)
    )
    return mscale * mscale / math.sqrt(head_k), 1.0 / (1.0 + 0.1 * math.log(1.0 / freq_scale))


def _yarn(
    reader: KeyReader, common: Mapping[str, Any], *, head_k: int, yarn: bool
) -> dict[str, Any]:
    """llama_context's YaRN parameters (ext_factor 1 for ``yarn`` scaling, attn_factor with its
    mscale adjustments) and deepseek2's kq scale ``mscale^2 / sqrt(head_k)``, which undoes the
    adjustment and applies ``rope.scaling.yarn_log_multiplier`` (stored x0.1 by the converter)."""
    k = Keys.LLM
    freq_scale = common["rope_freq_scale"]  # 1 for scaling type none (hparams._rope_freq_scale)
    log_mul = reader.get_float(k.ROPE_SCALING_YARN_LOG_MUL, 0.0) / 0.1
    ext_factor = 1.0 if yarn else 0.0
    attn_factor = 1.0
    factor = 1.0 / freq_scale
    if ext_factor != 0.0:

        def get_mscale(scale: float, mscale: float) -> float:
            return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0

        # With a log multiplier, deepseek2 takes mscale = mscale_all_dims, so the ratio
        # get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dims) is 1.
        attn_factor = 1.0 if log_mul != 0.0 else get_mscale(factor, 1.0)
        attn_factor *= 1.0 / (1.0 + 0.1 * math.log(factor))
    attn_factor *= reader.get_float(k.ROPE_SCALING_ATTN_FACTOR, 1.0)
    attn_factor_org = attn_factor * (1.0 + 0.1 * math.log(factor))
    mscale = attn_factor_org * (1.0 + 0.1 * log_mul * math.log(factor))
    return {
        "rope_ext_factor": ext_factor,
        "rope_attn_factor": attn_factor,
        "rope_ctx_orig": reader.get_int(k.ROPE_SCALING_ORIG_CTX_LEN, common["context_length"]),
        "attention_scale": mscale * mscale / math.sqrt(head_k),
    }


def head_linear(x: Tensor, w: Tensor | ExpertStack) -> Tensor:
    """Per-head ``x[..., h, :] @ w[h].T``: ``x [..., H, K]``, ``w [H, N, K]`` -> ``[..., H, N]``,
    in ``w``'s device and dtype, back in ``x``'s. With ggml's numerics ``w`` is the per-head
    matrices (ggml's batched product: each head's rows rounded for its type)."""
    if not isinstance(w, Tensor):
        return torch.stack([linear(x[..., h, :], w[h]) for h in range(w.shape[0])], dim=-2)
    xw = x.to(device=w.device, dtype=w.dtype)
    y = torch.einsum("...hk,hnk->...hn", xw, w)
    return y.to(device=x.device, dtype=x.dtype)


def _heads(weights: WeightProvider, name: str, heads: int) -> Tensor | ExpertStack:
    """``attn_k_b`` / ``attn_v_b`` as ``[H, N, K]``: the stacked tensor (ik_llama.cpp's 2-D
    ``[H * N, K]`` form viewed per head), or with ggml's numerics its per-head matrices (the
    2-D form then multiplies in float)."""
    if isinstance(weights, GgmlWeights) and len(weights.shape(name)) == 3:
        return weights.experts(name)
    w = weights.weight(name)
    return w if w.dim() == 3 else w.view(heads, -1, w.shape[-1])


class LatentAttention(nn.Module):
    """Multi-head latent attention in either file form (see the module docstring)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        assert config.mla is not None, "deepseek2 configs carry their MLAShape"
        self.config, self.weights, self.layer = config, weights, layer
        m: MLAShape = config.mla
        self.m, d, h = m, config.n_embd, config.n_head
        need = spec.need
        if m.q_lora_rank > 0:
            self.wq_a: str | None = need(TN.ATTN_Q_A.format(layer), (m.q_lora_rank, d))
            self.q_a_norm = need(TN.ATTN_Q_A_NORM.format(layer), (m.q_lora_rank,))
            self.wq = need(TN.ATTN_Q_B.format(layer), (h * m.head_k, m.q_lora_rank))
            spec.refuse(weights, [TN.ATTN_Q.format(layer, "weight")], "q_lora_rank > 0")
        else:
            self.wq_a, self.q_a_norm = None, ""
            self.wq = need(TN.ATTN_Q.format(layer, "weight"), (h * m.head_k, d))
            names = (TN.ATTN_Q_A.format(layer), TN.ATTN_Q_B.format(layer))
            spec.refuse(weights, names, "q_lora_rank is 0")
        self.wkv_a = need(TN.ATTN_KV_A_MQA.format(layer), (m.kv_lora_rank + m.n_rot, d))
        self.kv_a_norm = need(TN.ATTN_KV_A_NORM.format(layer), (m.kv_lora_rank,))
        split = (TN.ATTN_K_B.format(layer), TN.ATTN_V_B.format(layer))
        kv_b = TN.ATTN_KV_B.format(layer)
        # ik_llama.cpp's form: attn_kv_b beside 2-D attn_k_b / attn_v_b (module docstring).
        self.ik = not m.split and weights.has(split[0]) and weights.has(split[1])
        self.absorbed = m.split or self.ik
        if m.split:
            self.wk_b = need(split[0], (h, m.kv_lora_rank, m.nope))
            self.wv_b = need(split[1], (h, m.head_v, m.kv_lora_rank))
            spec.refuse(weights, [kv_b], "attention.key_length_mla is set")
        elif self.ik:
            self.wk_b = need(split[0], (h * m.kv_lora_rank, m.nope))
            self.wv_b = need(split[1], (h * m.head_v, m.kv_lora_rank))
            self.unread_kv_b = kv_b  # loaded, never computed with (``unused``)
        else:
            self.wkv_b = need(kv_b, (h * (m.nope + m.head_v), m.kv_lora_rank))
            spec.refuse(weights, split, "attention.key_length_mla is not set")
        self.wo = need(TN.ATTN_OUT.format(layer, "weight"), (d, h * m.head_v))

    def q_lora(self, x: Tensor) -> Tensor:
        """``attn_q_a_norm(attn_q_a x)`` (``qr``, which the DSA indexer reads too), or ``x``
        itself without q_lora."""
        # x: [B, T, D] -> [B, T, q_lora_rank or D]
        w, c = self.weights, self.config
        if self.wq_a is None:
            return x
        return rms_norm(linear(x, w.matrix(self.wq_a)), w.weight(self.q_a_norm), c.norm_eps)

    def forward(
        self, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        return self.attend(self.q_lora(x), x, rope, mask, cache)

    def attend(
        self, qr: Tensor, x: Tensor, rope: RopeTables, mask: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        """The attention of ``x`` (``[B, T, D]``) with the queries from ``qr`` (``q_lora``'s
        output), under ``mask`` (``[T, S]`` or ``[B, 1, T, S]`` bool; None: causal)."""
        m, c, w = self.m, self.config, self.weights
        q = linear(qr, w.matrix(self.wq)).unflatten(-1, (c.n_head, m.head_k))  # [B, T, H, hk]
        q_nope, q_pe = q[..., : m.nope], rope.rotate(q[..., m.nope :])  # [B, T, H, nope / rot]
        kv = linear(x, w.matrix(self.wkv_a))  # [B, T, rank + rot]
        latent = rms_norm(kv[..., : m.kv_lora_rank], w.weight(self.kv_a_norm), c.norm_eps)
        k_pe = rope.rotate(kv[..., None, m.kv_lora_rank :])  # [B, T, 1, rot]
        if self.absorbed:
            y = self._absorbed(q_nope, q_pe, latent, k_pe, mask=mask, cache=cache)  # [B, T, H, v]
        else:
            y = self._decompressed(q_nope, q_pe, latent, k_pe, mask=mask, cache=cache)
        return linear(y.flatten(-2), w.matrix(self.wo))  # [B, T, D]

    def _absorbed(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        latent: Tensor,
        k_pe: Tensor,
        *,
        mask: Tensor | None,
        cache: KVCache | None,
    ) -> Tensor:
        """attn_k_b turns the queries into latent queries; one key/value head (the latent and
        the rope key) serves every query head; attn_v_b decompresses each head's output."""
        rank, w = self.m.kv_lora_rank, self.weights
        q_lat = head_linear(q_nope, _heads(w, self.wk_b, self.config.n_head))  # [B, T, H, rank]
        q = torch.cat((q_lat, q_pe), dim=-1).transpose(1, 2)  # [B, H, T, rank + rot]
        k = torch.cat((latent[:, :, None], k_pe), dim=-1).transpose(1, 2)  # [B, 1, T, rank+rot]
        if cache is not None:  # the values are the keys' latent part: cache nothing twice
            k, _ = cache.update(self.layer, k, k[..., :0])
        v = k[..., :rank]  # [B, 1, S, rank]
        heads = q.shape[1]
        y = F.scaled_dot_product_attention(
            q,
            k.expand(-1, heads, -1, -1),
            v.expand(-1, heads, -1, -1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.config.attn_scale,
        )  # [B, H, T, rank]
        return head_linear(
            y.transpose(1, 2), _heads(w, self.wv_b, self.config.n_head)
        )  # [B, T, H, v]

    def _decompressed(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        latent: Tensor,
        k_pe: Tensor,
        *,
        mask: Tensor | None,
        cache: KVCache | None,
    ) -> Tensor:
        """attn_kv_b decompresses the latent into per-head keys and values (multi-head
        attention, as llama.cpp runs files without attn_k_b / attn_v_b)."""
        m, heads = self.m, q_nope.shape[2]
        kv = linear(latent, self.weights.matrix(self.wkv_b))  # [B, T, H * (nope + v)]
        kv = kv.unflatten(-1, (heads, m.nope + m.head_v))
        k = torch.cat((kv[..., : m.nope], k_pe.expand(-1, -1, heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [B, H, T, head_k]
        k, v = k.transpose(1, 2), kv[..., m.nope :].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.config.attn_scale
        )  # [B, H, T, v]
        return y.transpose(1, 2)


class Deepseek2Block(TransformerBlock):
    """Pre-norm latent attention, then a dense or routed FFN, each with a residual."""

    attention_cls = LatentAttention

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        return lead_dense_ffn(self.config, layer)


class Deepseek2Transformer(DecoderStack):
    """The deepseek2 decoder: latent attention, YaRN RoPE on its rope dims only."""

    arch = Arch.DEEPSEEK2
    block = Deepseek2Block

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        mla = config.mla
        assert mla is not None, "deepseek2 configs carry their MLAShape"
        ik_form = is_ik_form(config, weights)
        if ik_form:  # ik routes deepseek2 ungrouped, scales its attention its own way
            scale, rope_attn = mla.ik_scales
            config = replace(
                config,
                n_expert_groups=0,
                n_group_used=0,
                attention_scale=scale,
                rope_attn_factor=rope_attn,
            )
        super().__init__(config, weights, check_shapes=check_shapes)
        self.ik_form = ik_form
        self.rope = rotary(config, config.rope_base, n_rot=mla.n_rot)


def is_ik_form(config: HParams, weights: WeightProvider) -> bool:
    """Whether the file is in ik_llama.cpp's three-tensor form (``attn_kv_b`` beside
    ``attn_k_b`` / ``attn_v_b``, no ``*_mla`` keys): a file only ik_llama.cpp reads, so the
    decoder computes what ik computes. Its routing then ignores ``expert_group_count`` (ik's
    ``build_moe_ffn`` limits groups for BailingMoE only; mainline and the other forms here
    apply them), and its attention scale and RoPE magnitude are ik's (``MLAShape.ik_scales``:
    llama.cpp's too, but for YaRN without a log multiplier or linear scaling)."""
    assert config.mla is not None, "deepseek2 configs carry their MLAShape"
    k_b, kv_b = TN.ATTN_K_B.format(0), TN.ATTN_KV_B.format(0)
    return not config.mla.split and weights.has(k_b) and weights.has(kv_b)


ARCHITECTURE = Architecture(
    arch=Arch.DEEPSEEK2, decoder=Deepseek2Transformer, read_keys=read_keys, keys=KEYS
)
