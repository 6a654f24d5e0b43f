"""DeepSeek-V3.2 (``general.architecture = deepseek32``): deepseek2's decoder with DeepSeek Sparse
Attention, llama.cpp's ``llama_model_deepseek32`` (``src/models/deepseek32.cpp``).

- The latent attention in its absorbed ``attn_k_b`` / ``attn_v_b`` form (the only form the loader
  accepts) with q_lora, and a lightning indexer in every block (``blocks.indexer``): each query
  attends only to the ``attention.indexer.top_k`` earlier positions the indexer scores highest.
  llama.cpp applies that selection (its ``ggml_top_k`` indices unmask the attention), in prompt
  batches and in one-token steps alike, and so does this decoder. Its RoPE pairs are NEOX (the
  attention's are adjacent pairs), its key norm a layer norm with epsilon 1e-6.
- Everything else as deepseek2 (``deepseek2``): leading dense blocks, routed experts with the
  ungated shared experts, YaRN with the log multiplier; ``expert_gating_func`` is required.
- NextN/MTP blocks (``nextn_predict_layers``) are loaded and never run.

A sequence's state is an :class:`~.blocks.indexer.IndexerCache`: the latent and rope key of every
position (the latent attention's cache) and the indexer keys, valid for one weight version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, cast

from torch import Tensor, nn

from ggufswap.runtime.models import deepseek2
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.decoder import DecoderStack, TransformerBlock
from ggufswap.runtime.models.blocks.indexer import IndexerCache, LightningIndexer
from ggufswap.runtime.models.blocks.moe import lead_dense_ffn
from ggufswap.runtime.models.blocks.norms import rms_norm
from ggufswap.runtime.models.blocks.rope import RopeTables, rotary
from ggufswap.runtime.models.blocks.weights import TensorSpec, WeightProvider
from ggufswap.runtime.models.errors import KVCacheError
from ggufswap.runtime.models.hparams import Arch, DSAShape, HParams, KeyReader
from ggufswap.runtime.models.kv_cache import KVCache
from ggufswap.shards.keys import Keys

# llama_model_deepseek32::load_arch_hparams: hparams.f_norm_eps = 1e-6 (the indexer's key norm).
INDEXER_NORM_EPS: Final = 1e-6
INDEXER_KEYS: Final = (
    Keys.LLM.INDEXER_HEAD_COUNT,
    Keys.LLM.INDEXER_KEY_LENGTH,
    Keys.LLM.INDEXER_TOP_K,
)
KEYS: Final = (*deepseek2.KEYS, *INDEXER_KEYS)


def indexer_keys(reader: KeyReader) -> dict[str, int]:
    """The three required ``attention.indexer.*`` keys."""
    k = Keys.LLM
    return {
        "n_head": reader.get_int(k.INDEXER_HEAD_COUNT),
        "head_dim": reader.get_int(k.INDEXER_KEY_LENGTH),
        "top_k": reader.get_int(k.INDEXER_TOP_K),
    }


def require(reader: KeyReader, *templates: str) -> None:
    """Keys llama.cpp's loader reads as required where deepseek2's does not."""
    for template in templates:
        key = template.format(reader.arch)
        if key not in reader.md:
            reader.problems.append(f"missing required key {key!r}")


def read_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """llama_model_deepseek32::load_arch_hparams: deepseek2's keys (q_lora_rank and
    expert_gating_func required), and the indexer's."""
    require(reader, Keys.LLM.Q_LORA_RANK, Keys.LLM.EXPERT_GATING_FUNC)
    out = deepseek2.read_keys(reader, common)
    n_trunk = common["n_layer"] - out["n_layer_nextn"]
    out["dsa"] = DSAShape(
        **indexer_keys(reader),
        full_layers=(True,) * n_trunk,
        rope_neox=True,
        norm_eps=INDEXER_NORM_EPS,
    )
    return out


class SparseLatentAttention(deepseek2.LatentAttention):
    """The latent attention behind the lightning indexer's selection (``sparse``); blocks whose
    ``DSAShape.full_layers`` entry is False (glm-dsa's shared blocks) have no indexer and reuse
    the selection of the block before."""

    def __init__(self, config: HParams, weights: WeightProvider, layer: int, spec: TensorSpec):
        super().__init__(config, weights, layer, spec)
        assert config.dsa is not None, "DSA configs carry their DSAShape"
        full = config.dsa.full_layers[layer]
        self.indexer = LightningIndexer(config, weights, layer, spec) if full else None

    def sparse(
        self,
        x: Tensor,
        rope: RopeTables,
        start: int,
        selection: Tensor | None,
        cache: KVCache | None,
    ) -> tuple[Tensor, Tensor]:
        """The attention output of ``x`` (``[B, T, D]``, after ``attn_norm``) and the selection
        it used (``[B, T, S]`` bool: this block's indexer's, or ``selection``)."""
        qr = self.q_lora(x)
        if self.indexer is not None:
            selection = self.indexer.select(qr, x, rope, start, cache)
        assert selection is not None, "a shared block follows a full one (DSAShape.problems)"
        return self.attend(qr, x, rope, selection[:, None], cache), selection


class SparseBlock(TransformerBlock):
    """Pre-norm sparse latent attention, then a dense or routed FFN, each with a residual."""

    attention_cls = SparseLatentAttention

    def ffn_cls(self, layer: int) -> type[nn.Module]:
        return lead_dense_ffn(self.config, layer)

    def sparse(
        self,
        x: Tensor,
        rope: RopeTables,
        start: int,
        selection: Tensor | None,
        cache: KVCache | None,
    ) -> tuple[Tensor, Tensor]:
        """The block's output and the indexer selection it attended with."""
        w, eps = self.weights.weight, self.config.norm_eps
        attention: SparseLatentAttention = self.attention  # type: ignore[assignment]
        a, selection = attention.sparse(
            rms_norm(x, w(self.attn_norm), eps), rope, start, selection, cache
        )
        h = x + a
        return h + self.feed_forward(rms_norm(h, w(self.ffn_norm), eps)), selection


class SparseTransformer(DecoderStack):
    """The DSA decoder: each block's attention sees what the indexer selects; the selection of
    a full block passes to the shared blocks after it."""

    block = SparseBlock

    def __init__(
        self, config: HParams, weights: WeightProvider, *, check_shapes: bool = True
    ) -> None:
        super().__init__(config, weights, check_shapes=check_shapes)
        assert config.mla is not None, "DSA configs carry their MLAShape"
        self.rope = rotary(config, config.rope_base, n_rot=config.mla.n_rot)

    def forward(
        self,
        tokens: Tensor,
        *,
        start_pos: int = 0,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """Logits of ``tokens`` at positions ``start_pos ..``; with ``cache`` (an
        :class:`IndexerCache`: ``new_cache``) they also attend to the cached positions;
        ``last_only``: the last position's alone (:meth:`DecoderStack.logits`)."""
        # tokens: [B, T] int64 -> logits: [B, T, V] float32
        c, seq = self.config, tokens.shape[1]
        if cache is not None:
            if not isinstance(cache, IndexerCache):
                raise KVCacheError(
                    f"{c.arch.value} keeps its indexer keys beside the latent cache: pass "
                    f"model.new_cache(...), not a {type(cache).__name__}"
                )
            cache.check_continues(start_pos, seq)
        x = self.embedding(tokens)  # [B, T, D]
        rope = self.rope(start_pos, seq, tokens.device)
        selection: Tensor | None = None
        for block in self.layers:
            x, selection = cast(SparseBlock, block).sparse(x, rope, start_pos, selection, cache)
        if cache is not None:
            cache.advance(seq)
        return self.logits(x, last_only=last_only)

    def new_cache(self, *, max_len: int) -> IndexerCache:
        """An empty state for one sequence: the latent cache and the indexer keys."""
        return IndexerCache(n_layer=self.n_trunk, max_len=max_len)


class Deepseek32Transformer(SparseTransformer):
    """deepseek32: an indexer in every block, NEOX indexer RoPE."""

    arch = Arch.DEEPSEEK32


ARCHITECTURE = Architecture(
    arch=Arch.DEEPSEEK32, decoder=Deepseek32Transformer, read_keys=read_keys, keys=KEYS
)
