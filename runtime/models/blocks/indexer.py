"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5): which earlier tokens each query attends to.

llama.cpp's ``llama_model_deepseek32::graph`` / ``llama_model_glm_dsa::graph``
(``src/models/deepseek32.cpp``, ``glm-dsa.cpp``) and the CPU ``ggml_lightning_indexer``:

- indexer queries ``indexer.attn_q_b @ qr`` (``qr``: the attention's ``attn_q_a`` output after
  ``attn_q_a_norm``), ``n_head`` heads of ``head_dim``; one indexer key per token,
  ``indexer.attn_k @ x`` (``x``: the block's attention input after ``attn_norm``) through a layer
  norm with weight and bias (``indexer.k_norm``); both rotated on their first ``n_rot`` dims (the
  indexer head is ``[rope | nope]``) with the attention's RoPE tables, NEOX pairs (deepseek32) or
  adjacent pairs (glm-dsa);
- per-head weights ``indexer.proj @ x``, pre-scaled by ``1 / sqrt(head_dim * n_head)``;
- the score of query ``t`` for key ``s``: ``sum_h relu(q_h(t) . k(s)) * w_h(t)``, causal;
- each query keeps the ``top_k`` best-scored positions (all of them while it has fewer), and
  the attention sees only those (``build_attn`` unmasks the ``ggml_top_k`` indices in a mask
  filled with -inf, then adds the causal mask).

llama.cpp multiplies the indexer queries and keys by an orthonormal Walsh-Hadamard matrix before
the product (a rotation kept for quantized caches); the products are the same up to float
rounding, so it is not applied here. The indexer keys of earlier positions live in the sequence's
:class:`IndexerCache`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor, nn

from ggufswap.runtime.models.blocks.rope import RopeTables
from ggufswap.runtime.models.blocks.weights import TensorSpec, WeightProvider, linear
from ggufswap.runtime.models.hparams import HParams, RopeType
from ggufswap.runtime.models.kv_cache import KVCache
from ggufswap.shards.keys import TensorNames

TN = TensorNames


class IndexerCache(KVCache):
    """A :class:`KVCache` for the latent attention that also keeps every layer's indexer keys
    (``[B, 1, positions, head_dim]``, llama.cpp's second cache of ``llama_kv_cache_dsa``). Like
    the keys and values, they belong to the weight version that computed them."""

    def __init__(self, *, n_layer: int, max_len: int = 256) -> None:
        super().__init__(n_layer=n_layer, max_len=max_len)
        self.indexer = KVCache(n_layer=n_layer, max_len=max_len)

    def update_indexer(self, layer: int, k: Tensor) -> Tensor:
        """Store this forward's indexer keys of ``layer`` (``[B, 1, T, d]``) after the cached
        ones; all of them, ``[B, 1, length + T, d]``."""
        keys, _ = self.indexer.update(layer, k, k[..., :0])
        return keys

    def advance(self, n_new: int) -> None:
        super().advance(n_new)
        self.indexer.advance(n_new)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.indexer.nbytes


def layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    """llama.cpp's ``build_norm(..., LLM_NORM)``: ggml_norm (mean and variance over the last dim,
    float32) times ``w`` plus ``b``."""
    xf = x.float()
    y = F.layer_norm(xf, (xf.shape[-1],), eps=eps)
    return y * w.to(device=x.device, dtype=torch.float32) + b.to(x.device, torch.float32)


class LightningIndexer(nn.Module):
    """One block's indexer: ``select(qr, x, rope, start, cache) -> [B, T, S]`` bool, True for
    the positions each query keeps (see the module docstring)."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__()
        assert config.dsa is not None, "DSA configs carry their DSAShape"
        assert config.mla is not None, "DSA configs carry their MLAShape"
        self.config, self.weights, self.layer = config, weights, layer
        dsa, d = config.dsa, config.n_embd
        self.n_head, self.head_dim, self.top_k = dsa.n_head, dsa.head_dim, dsa.top_k
        self.rope_type = RopeType.NEOX if dsa.rope_neox else RopeType.NORM
        self.eps = dsa.norm_eps
        q_lora = config.mla.q_lora_rank
        need = spec.need
        self.wq_b = need(TN.INDEXER_ATTN_Q_B.format(layer), (self.n_head * self.head_dim, q_lora))
        self.wk = need(TN.INDEXER_ATTN_K.format(layer), (self.head_dim, d))
        self.k_norm = need(TN.INDEXER_K_NORM.format(layer, "weight"), (self.head_dim,))
        self.k_norm_b = need(TN.INDEXER_K_NORM.format(layer, "bias"), (self.head_dim,))
        self.proj = need(TN.INDEXER_PROJ.format(layer), (self.n_head, d))

    def scores(self, qr: Tensor, x: Tensor, rope: RopeTables, cache: KVCache | None) -> Tensor:
        """``[B, T, S]`` float32 indexer scores of this forward's queries for every key
        position (the cached ones first), before the causal mask."""
        w = self.weights
        bsz, seq, _ = x.shape
        rope = replace(rope, rope_type=self.rope_type)
        q = linear(qr, w.matrix(self.wq_b)).view(bsz, seq, self.n_head, self.head_dim)
        q = rope.rotate(q).float()  # [B, T, H, d]
        k = linear(x, w.matrix(self.wk))
        k = layer_norm(k, w.weight(self.k_norm), w.weight(self.k_norm_b), self.eps)
        k = rope.rotate(k[:, :, None]).float()  # [B, T, 1, d]
        if isinstance(cache, IndexerCache):
            k = cache.update_indexer(self.layer, k.transpose(1, 2)).transpose(1, 2)
        weights = linear(x, w.matrix(self.proj)).float()  # [B, T, H]
        weights = weights * (1.0 / math.sqrt(self.head_dim * self.n_head))
        qk = torch.einsum("bthd,bsd->bths", q, k[:, :, 0])  # [B, T, H, S]
        return torch.einsum("bths,bth->bts", qk.clamp_min(0.0), weights)

    def select(
        self, qr: Tensor, x: Tensor, rope: RopeTables, start: int, cache: KVCache | None
    ) -> Tensor:
        """``[B, T, S]`` bool: the causal positions among each query's ``top_k`` best scores
        (query ``i`` sits at position ``start + i``; every key position ``< start`` is cached)."""
        score = self.scores(qr, x, rope, cache)
        seq, keys = score.shape[1], score.shape[2]
        query = torch.arange(start, start + seq, device=score.device)
        causal = query[:, None] >= torch.arange(keys, device=score.device)[None, :]  # [T, S]
        score = score.masked_fill(~causal, float("-inf"))
        return top_k_mask(score, min(self.top_k, keys)) & causal


def top_k_mask(score: Tensor, k: int) -> Tensor:
    """``[..., S]`` bool: the ``k`` best scores of each row, as ggml's CPU ``top_k`` picks them.
    Ties at the boundary (an exact tie: typically two positions whose every head's product is
    negative, both scoring 0) go the way ggml's ``std::partial_sort`` leaves them (``heap_top_k``);
    the other rows take the plain top ``k``."""
    ranked = score.sort(dim=-1, descending=True, stable=True)
    chosen = torch.zeros_like(score, dtype=torch.bool)
    chosen.scatter_(-1, ranked.indices[..., :k], True)
    if k < score.shape[-1]:
        kth, next_ = ranked.values[..., k - 1], ranked.values[..., k]
        tied = (kth == next_) & torch.isfinite(kth)
        flat_scores, flat_chosen = (
            score.reshape(-1, score.shape[-1]),
            chosen.view(-1, score.shape[-1]),
        )
        for row in tied.reshape(-1).nonzero().flatten().tolist():
            flat_chosen[row] = False
            flat_chosen[row, heap_top_k(flat_scores[row].tolist(), k)] = True
    return chosen


def heap_top_k(data: list[float], k: int) -> list[int]:
    """The indices ``std::partial_sort(idx, idx + k, idx + n, data[a] > data[b])`` leaves in
    front (libstdc++'s ``__heap_select``: a heap of the first ``k``, whose worst element each
    later, strictly better one replaces), the set ggml's ``top_k`` returns."""
    heap = list(range(k))

    def less(a: int, b: int) -> bool:  # the comparator: a before b
        return data[a] > data[b]

    def adjust(hole: int, length: int, value: int) -> None:  # std::__adjust_heap
        top, child = hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if less(heap[child], heap[child - 1]):
                child -= 1
            heap[hole], hole = heap[child], child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            heap[hole], hole = heap[child - 1], child - 1
        parent = (hole - 1) // 2
        while hole > top and less(heap[parent], value):  # std::__push_heap
            heap[hole], hole = heap[parent], parent
            parent = (hole - 1) // 2
        heap[hole] = value

    for parent in range((k - 2) // 2, -1, -1):  # std::__make_heap
        adjust(parent, k, heap[parent])
    for i in range(k, len(data)):
        if less(i, heap[0]):  # std::__pop_heap: i takes the worst one's place
            adjust(0, k, i)
    return heap
