"""deepseek32 (DeepSeek-V3.2) and glm-dsa (GLM-5.x): the DSA lightning indexer selects what each
query attends to as llama.cpp's graph does, glm-dsa's shared blocks reuse a full block's
selection, the keys are read with llama.cpp's rules, and what its loader refuses is refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import ModelDir, Q, one_thread

from ggufswap.runtime import HotSwapRuntime, PlanState
from ggufswap.runtime.models import HParams, HParamsError, KVCache, KVCacheError, build_model
from ggufswap.runtime.models.blocks import DictWeightProvider
from ggufswap.runtime.models.blocks.indexer import IndexerCache, heap_top_k, top_k_mask
from ggufswap.runtime.models.deepseek2 import Deepseek2Transformer
from ggufswap.runtime.models.deepseek32 import SparseBlock, SparseTransformer
from ggufswap.runtime.models.hparams import Arch
from ggufswap.shards import read_header
from ggufswap.shards.presets import tiny_deepseek32, tiny_glm_dsa
from ggufswap.shards.writer import ModelSpec, Role, write_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

TOKENS = torch.tensor([[1, 17, 33, 250, 4, 99, 7, 128, 5, 60, 200, 3]])
F32_MATRICES = {r.name: "f32" for r in Role if r.name.startswith(("ATTN", "FFN", "INDEXER"))}
# std::partial_sort(idx, idx + k, idx + n, data[a] > data[b]) with g++ 12 (libstdc++), on rows
# of many ties: (row, k, the indices it leaves in front, sorted). ggml's CPU top_k runs exactly
# this; its tie-breaking is neither "earliest first" nor "latest first".
PARTIAL_SORT = [
    ((1, 2, 1, 0, 2, 2, 1, 2, 1, 1, 2), 6, (0, 1, 4, 5, 7, 10)),
    ((1, 0, 1, 0, 0, 0, 1), 4, (0, 1, 2, 6)),
    ((1, 2, 2, 1, 0, 2, 0, 1, 0), 5, (0, 1, 2, 3, 5)),
    ((0, 0, 2, 2, 2, 1, 2, 0, 2, 2, 1), 7, (2, 3, 4, 5, 6, 8, 9)),
    ((1, 1, 0, 1, 0, 2, 2, 2, 0, 1, 2, 2), 7, (1, 3, 5, 6, 7, 10, 11)),
    ((2, 2, 2, 2, 1, 0, 2, 2, 1, 1, 1, 1), 4, (0, 1, 2, 3)),
    ((0, 2, 2, 1, 1, 0, 0, 2), 3, (1, 2, 7)),
    ((1, 0, 2, 2, 1, 0, 0), 4, (0, 2, 3, 4)),
    ((0, 1, 1, 1, 2, 0, 1, 1, 2, 2, 1), 7, (1, 2, 3, 4, 7, 8, 9)),
    ((0, 2, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0), 9, (0, 1, 2, 3, 4, 5, 6, 7, 8)),
]


@contextmanager
def open_model(path: Path) -> Iterator[tuple[HotSwapRuntime, SparseTransformer]]:
    runtime = HotSwapRuntime.open(path)
    assert runtime.shards is not None, "open() keeps the shard set"
    try:
        model = build_model(
            HParams.from_metadata(runtime.shards.metadata), runtime.store, store=runtime.store
        )
        assert isinstance(model, SparseTransformer)
        yield runtime, model
    finally:
        runtime.close()


def logits_of(spec: ModelSpec, root: Path) -> torch.Tensor:
    with open_model(write_model(spec, root)[0]) as (_, model), torch.inference_mode():
        return model(TOKENS)


@pytest.mark.parametrize(("row", "k", "front"), PARTIAL_SORT)
def test_ties_at_the_top_k_boundary_go_as_ggmls_partial_sort_leaves_them(
    row: tuple[int, ...], k: int, front: tuple[int, ...]
) -> None:
    """With exact ties, the kept positions are the ones libstdc++'s partial_sort keeps."""
    assert sorted(heap_top_k([float(v) for v in row], k)) == list(front)
    mask = top_k_mask(torch.tensor([row], dtype=torch.float32), k)[0]
    assert mask.nonzero().flatten().tolist() == list(front)


def test_each_query_keeps_its_top_k_causal_positions(tmp_path: Path) -> None:
    """The first block's indexer keeps min(top_k, position + 1) causal positions per query, each
    scoring at least as high as every causal position it drops."""
    with open_model(write_model(tiny_deepseek32(), tmp_path)[0]) as (_, model):
        block = model.layers[0]
        assert isinstance(block, SparseBlock)
        indexer = block.attention.indexer
        assert indexer is not None
        x = torch.randn(1, 12, model.config.n_embd, generator=torch.Generator().manual_seed(0))
        qr = block.attention.q_lora(x)
        rope = model.rope(0, 12, x.device)
        score = indexer.scores(qr, x, rope, None)[0]
        chosen = indexer.select(qr, x, rope, 0, None)[0]
        for t in range(12):
            kept, dropped = score[t, chosen[t]], score[t, : t + 1][~chosen[t, : t + 1]]
            assert int(chosen[t].sum()) == min(indexer.top_k, t + 1)
            assert not chosen[t, t + 1 :].any(), "never a future position"
            assert dropped.numel() == 0 or kept.min() >= dropped.max()


@pytest.mark.parametrize("preset", [tiny_deepseek32, tiny_glm_dsa], ids=["deepseek32", "glm-dsa"])
def test_a_top_k_covering_every_position_is_deepseek2s_dense_attention(
    preset: Any, tmp_path: Path
) -> None:
    """With top_k past the sequence the indexer selects everything, and the model computes
    what deepseek2's decoder computes on the same weights without the indexer."""
    spec = preset(indexer_top_k=64).with_types(**F32_MATRICES)
    with open_model(write_model(spec, tmp_path)[0]) as (runtime, model):
        weights = {n: runtime.store.weight(n) for n in runtime.store.slots if ".indexer." not in n}
        dense_config = replace(model.config, arch=Arch.DEEPSEEK2, dsa=None)
        dense = Deepseek2Transformer(dense_config, DictWeightProvider(weights))
        with torch.inference_mode():
            torch.testing.assert_close(model(TOKENS), dense(TOKENS), atol=1e-5, rtol=0)


def test_the_selection_changes_only_the_positions_past_top_k(tmp_path: Path) -> None:
    """top_k 4 and top_k 64 give the same logits at the first four positions (every position
    selected either way) and different ones after."""
    sparse = logits_of(tiny_deepseek32(name="sparse").with_types(**F32_MATRICES), tmp_path)
    dense = logits_of(
        tiny_deepseek32(name="dense", indexer_top_k=64).with_types(**F32_MATRICES), tmp_path
    )
    torch.testing.assert_close(sparse[:, :4], dense[:, :4], atol=1e-6, rtol=0)
    assert (sparse[:, 4:] - dense[:, 4:]).abs().amax() > 1e-2


def test_shared_blocks_reuse_the_selection_of_the_full_block_before(tmp_path: Path) -> None:
    """glm-dsa's blocks 1 and 3 have no indexer and attend with the selection blocks 0 and 2
    computed; the shared blocks' file holds no indexer tensors."""
    path = write_model(tiny_glm_dsa(), tmp_path)[0]
    with open_model(path) as (runtime, model):
        assert not any(
            n.startswith(("blk.1.indexer", "blk.3.indexer")) for n in runtime.store.slots
        )
        x = torch.randn(1, 12, model.config.n_embd, generator=torch.Generator().manual_seed(1))
        rope = model.rope(0, 12, x.device)
        selection: torch.Tensor | None = None
        seen = []
        with torch.inference_mode():
            for block in model.layers:
                assert isinstance(block, SparseBlock)
                x, selection = block.sparse(x, rope, 0, selection, None)
                seen.append(selection)
        assert seen[1] is seen[0]
        assert seen[3] is seen[2]
        assert not torch.equal(seen[0], seen[2])


def test_an_indexer_swap_equals_a_fresh_load(tmp_path: Path) -> None:
    """Re-quantizing an indexer matrix and committing its plan gives a fresh load's logits bit
    for bit, and differs from before (it moves the selection or the scores' ranking)."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_deepseek32())
    name = "blk.1.indexer.attn_q_b.weight"
    with open_model(model_dir.first) as (runtime, model):
        with torch.inference_mode():
            before = model(TOKENS)
        model_dir.put(name, model_dir.variant(name, Q.Q4_0, tmp_path / "variants"))
        ticket = runtime.apply(model_dir.plan("idx-q4", [name]))
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        with torch.inference_mode():
            swapped = model(TOKENS)
        with open_model(model_dir.first) as (_, fresh):
            with torch.inference_mode():
                assert torch.equal(swapped, fresh(TOKENS))
        assert not torch.equal(swapped, before)


def test_the_cache_keeps_the_indexer_keys_and_a_plain_cache_is_refused(tmp_path: Path) -> None:
    """new_cache() holds the indexer keys of every position beside the latent; a plain KVCache,
    which would drop them, is refused by name."""
    with open_model(write_model(tiny_deepseek32(), tmp_path)[0]) as (_, model):
        cache = model.new_cache(max_len=16)
        assert isinstance(cache, IndexerCache)
        with torch.inference_mode():
            model(TOKENS[:, :7], cache=cache)
        assert cache.length == cache.indexer.length == 7
        with pytest.raises(KVCacheError, match="indexer keys"):
            model(TOKENS, cache=KVCache(n_layer=model.n_trunk))


def _md(arch: str = "deepseek32", **changes: object) -> dict[str, object]:
    """The metadata of the arch's tiny preset as written, with changes (None: key removed)."""
    root = Path(_TMP[0]) / arch
    if not root.exists():
        write_model((tiny_deepseek32 if arch == "deepseek32" else tiny_glm_dsa)(), root)
    md = dict(read_header(next(root.glob("*.gguf"))).metadata)
    for key, value in changes.items():
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


_TMP: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _metadata_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    _TMP[:] = [str(tmp_path_factory.mktemp("md"))]


def test_the_indexer_keys_and_glm_dsas_block_pattern() -> None:
    """deepseek32: every block full, NEOX indexer RoPE, key norm eps 1e-6; glm-dsa: the file's
    indexer.types, else every block full below a 1M context and GLM-5.2's pattern from it, NORM
    RoPE, eps 0, sigmoid gating when the key is absent."""
    ds = HParams.from_metadata(_md())
    assert ds.dsa is not None
    assert ds.dsa.full_layers == (True,) * 3
    assert (ds.dsa.n_head, ds.dsa.head_dim, ds.dsa.top_k) == (4, 64, 4)
    assert ds.dsa.rope_neox
    assert ds.dsa.norm_eps == 1e-6
    glm = HParams.from_metadata(_md("glm-dsa"))
    assert glm.dsa is not None
    assert glm.dsa.full_layers == (True, False, True, False)
    assert not glm.dsa.rope_neox
    assert glm.dsa.norm_eps == 0.0
    assert int(glm.gating) == 2
    untyped = _md("glm-dsa", **{"glm-dsa.attention.indexer.types": None})
    assert HParams.from_metadata(untyped).dsa.full_layers == (True,) * 4  # type: ignore[union-attr]
    long = {**untyped, "glm-dsa.context_length": 1048576}
    assert HParams.from_metadata(long).dsa.full_layers == (True, True, True, False)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        ("deepseek32", {"deepseek32.expert_gating_func": None}, "deepseek32.expert_gating_func"),
        ("deepseek32", {"deepseek32.attention.indexer.top_k": None}, "indexer.top_k"),
        (
            "deepseek32",
            {
                "deepseek32.attention.key_length_mla": None,
                "deepseek32.attention.value_length_mla": None,
            },
            "requires MLA",
        ),
        ("deepseek32", {"deepseek32.attention.q_lora_rank": None}, "q_lora_rank"),
        ("deepseek32", {"deepseek32.attention.indexer.key_length": 8}, "exceeds"),
        ("glm-dsa", {"glm-dsa.attention.indexer.types": [False, True, True, True]}, "block 0"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_what_llama_cpp_refuses_is_refused_by_name(
    arch: str, change: dict[str, object], message: str
) -> None:
    """A file llama.cpp's DSA loaders or graphs would refuse is refused, naming the key."""
    with pytest.raises(HParamsError, match=message):
        HParams.from_metadata(_md(arch, **change))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"indexer_head_dim": 32}, "power of 2"),
        ({"indexer_head_dim": 96}, "power of 2"),
        ({"mla_split": False, "n_head_kv": 4}, "attn_k_b/attn_v_b form"),
        ({"expert_gating_func": 0}, "expert_gating_func"),
        ({"indexer_types": (True, False, True)}, "glm-dsa's"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_the_writer_refuses_what_llama_cpp_cannot_run(
    overrides: dict[str, Any], message: str
) -> None:
    """A deepseek32 spec llama.cpp's loader refuses, or whose indexer its graph cannot rotate,
    is refused with the reason."""
    with pytest.raises(ValueError, match=message):
        tiny_deepseek32(**overrides)
