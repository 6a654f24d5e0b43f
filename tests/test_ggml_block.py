"""A block's steps around its products in one compiled call each under ggml's numerics
(``runtime/kernels/ggml_block.py``): the attention's front (norm, q/k/v, head norms, RoPE) and a
gemma3 block's half after attention give the bits of the same steps one by one, reading the
store. Decode steps run block by block here (``per_block_steps``): gemma3's whole step in one call
is tests/test_ggml_step.py's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from runtime_helpers import ModelDir, Q, one_thread

import ggufswap.runtime.models.blocks.attention as attention_module
import ggufswap.runtime.models.blocks.decoder as decoder_module
import ggufswap.runtime.models.blocks.moe as moe_module
import ggufswap.runtime.models.blocks.weights as weights_module
import ggufswap.runtime.models.gemma3 as gemma3
from ggufswap.runtime import HotSwapRuntime, PlanState, Storage, float_products, ggml_flash_attn
from ggufswap.runtime.kernels import ggml_library
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.models.blocks.ggml_decode import per_block_steps
from ggufswap.runtime.models.ggml_numerics import ggml_norms, kv_cache_type
from ggufswap.runtime.models.registry import Decoder
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.presets import tiny_arch

pytestmark = [
    pytest.mark.skipif(ggml_library() is None, reason="no libggml installed"),
    pytest.mark.usefixtures(one_thread.__name__),
]

PROMPT = torch.tensor([[1, 17, 33, 250, 4, 99, 7]])
DOWN2 = "blk.2.ffn_down.weight"


@pytest.fixture(autouse=True)
def block_by_block() -> Iterator[None]:
    """Decode steps one compiled call a block, not one a step."""
    with per_block_steps():
        yield


def spec(arch: str = "gemma3") -> object:
    """A tiny model of ``arch`` (gemma3: six blocks, five of them sliding-window) with a mix of
    ggml's types."""
    return tiny_arch(arch).with_types(
        ffn_gate="q4_0", ffn_up="q5_0", ffn_down="q8_0", attn_o="iq4_nl", attn_k="q5_0"
    )


def open_ggml(first: Path) -> tuple[HotSwapRuntime, Decoder]:
    """A native runtime over ``first`` and its decoder with ggml's numerics."""
    runtime = HotSwapRuntime.open(first, storage=Storage.NATIVE)
    assert runtime.shards is not None, "open() keeps the shard set"
    config = HParams.from_metadata(runtime.shards.metadata)
    return runtime, build_model(config, runtime.store, store=runtime.store, numerics="ggml")


@pytest.fixture(params=["gemma3"])
def ggml_model(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[HotSwapRuntime, Decoder, ModelDir]]:
    model_dir = ModelDir.write(tmp_path / "model", spec(request.param))  # type: ignore[arg-type]
    runtime = HotSwapRuntime.open(model_dir.first, storage=Storage.NATIVE)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        config = HParams.from_metadata(runtime.shards.metadata)
        yield (
            runtime,
            build_model(config, runtime.store, store=runtime.store, numerics="ggml"),
            model_dir,
        )
    finally:
        runtime.close()


def decode(model: Decoder, steps: int = 4) -> list[torch.Tensor]:
    """The prompt's logits, then ``steps`` greedy steps' through a KV cache."""
    cache = model.new_cache(max_len=32)
    with torch.inference_mode():
        logits = model(PROMPT, cache=cache)
        out = [logits]
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            logits = model(token, start_pos=cache.length, cache=cache)
            out.append(logits)
    return out


def counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[bool]:
    """Whether each call of ``module.name`` gave a result (it is replaced by a counting twin)."""
    real = getattr(module, name)
    ran: list[bool] = []

    def counted(*args: object, **kwargs: object) -> object:
        y = real(*args, **kwargs)
        ran.append(y is not None)
        return y

    monkeypatch.setattr(module, name, counted)
    return ran


@pytest.mark.parametrize("ggml_model", ["gemma3", "qwen3moe"], indirect=True)
def test_the_compiled_steps_give_the_bits_of_the_steps(
    ggml_model: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill and cached steps give, bit for bit, the logits of the blocks' steps one by one
    (each decode step's attention ggml's over the F16 cache, qwen3moe's MoE FFN ggml's in one
    call), and the compiled calls ran in every block of every forward: the front and gemma3's
    tail or qwen3moe's experts' gate and up in one graph in the prefill, the whole block in
    each decode step."""
    _, model, _ = ggml_model
    fronts = counting(monkeypatch, attention_module, "block_front")
    tails = counting(monkeypatch, gemma3, "block_tail")
    layers = counting(monkeypatch, gemma3, "block_layer")
    moe_layers = counting(monkeypatch, decoder_module, "block_moe_layer")
    pairs = counting(monkeypatch, weights_module, "routed_all")
    steps = counting(monkeypatch, attention_module, "ggml_decode_step")
    fused = decode(model)
    n = len(model.layers)
    decoded = (len(fused) - 1) * n
    gemma = model.config.arch.value == "gemma3"
    assert fronts == [True] * n, "the prefill's front ran compiled in every block"
    assert tails == ([True] * n if gemma else [])
    assert layers == ([True] * decoded if gemma else [])
    assert moe_layers == ([] if gemma else [True] * decoded)
    assert pairs == ([] if gemma else [True] * n)
    assert steps == [False] * n, "the prefill's attention is torch's, the steps' in the layers"
    monkeypatch.setattr(decoder_module, "block_moe_layer", lambda *args, **kwargs: None)
    monkeypatch.setattr(gemma3, "block_layer", lambda *args, **kwargs: None)
    monkeypatch.setattr(gemma3, "block_tail", lambda *args, **kwargs: None)
    monkeypatch.setattr(attention_module, "block_front", lambda *args, **kwargs: None)
    monkeypatch.setattr(weights_module, "routed_all", lambda *args, **kwargs: None)
    stepped = decode(model)
    assert steps[-decoded:] == [True] * decoded, "the steps' attention is ggml's too"
    for i, (a, b) in enumerate(zip(fused, stepped, strict=True)):
        assert torch.equal(a, b), f"forward {i}"


def test_the_f16_cache_holds_f16_and_its_steps_attend_as_ggml(
    ggml_model: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ggml's numerics the KV cache holds F16 tensors (an F32 cache float32); the prefill's
    logits are those of the torch attention over the same values, and a decode step's move
    (ggml's attention rounds the queries to F16) but stay close."""
    _, model, _ = ggml_model
    cache = model.new_cache(max_len=32)
    with torch.inference_mode():
        model(PROMPT, cache=cache)
    assert all(t is not None and t.dtype == torch.float16 for t in (*cache._k, *cache._v))
    with kv_cache_type(GGMLType.F32):
        cache32 = model.new_cache(max_len=32)
        with torch.inference_mode():
            model(PROMPT, cache=cache32)
    assert all(t is not None and t.dtype == torch.float32 for t in cache32._k)
    fused = decode(model, steps=2)
    monkeypatch.setattr(gemma3, "block_layer", lambda *args, **kwargs: None)
    monkeypatch.setattr(attention_module, "ggml_decode_step", lambda *args, **kwargs: None)
    torch_attention = decode(model, steps=2)
    assert torch.equal(fused[0], torch_attention[0]), "the prefill is unchanged"
    assert not torch.equal(fused[1], torch_attention[1]), "a decode step's attention is ggml's"
    assert torch.allclose(fused[1], torch_attention[1], atol=0.5, rtol=0.05)


@pytest.mark.parametrize("ggml_model", ["gemma3", "qwen3moe"], indirect=True)
def test_the_layer_calls_step_aside_inside_float_products_and_come_back(
    ggml_model: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside float products a decode step's block is not one compiled call (the steps run),
    and after it, without a commit, the compiled calls run again."""
    _, model, _ = ggml_model
    gemma = model.config.arch.value == "gemma3"
    module, name = (gemma3, "block_layer") if gemma else (decoder_module, "block_moe_layer")
    ran = counting(monkeypatch, module, name)
    n = len(model.layers)
    with float_products():
        decode(model, steps=1)
    assert ran == [False] * n
    decode(model, steps=1)
    assert ran[n:] == [True] * n


@pytest.mark.parametrize("ggml_model", ["qwen3moe"], indirect=True)
def test_the_moe_decode_step_is_ggmls_ffn_close_to_the_torch_steps(
    ggml_model: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A qwen3moe decode step's MoE FFN in one call (ggml's router, softmax, SwiGLU experts and
    weighted sum) ran in every block, and gives the torch steps' logits to float rounding."""
    _, model, _ = ggml_model
    ran = counting(monkeypatch, moe_module, "moe_step")
    monkeypatch.setattr(decoder_module, "block_moe_layer", lambda *args, **kwargs: None)
    fused = decode(model, steps=3)
    n = len(model.layers)
    assert ran == [False] * n + [True] * 3 * n, "the prefill steps, each decode step one call"
    monkeypatch.setattr(moe_module, "moe_step", lambda *args, **kwargs: None)
    stepped = decode(model, steps=3)
    for a, b in zip(fused, stepped, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("heads", "window"), [((4, 1), (0, 40)), ((8, 2), (17, 40))])
def test_ggml_attention_reads_the_cache_in_place(
    heads: tuple[int, int], window: tuple[int, int]
) -> None:
    """ggml's one-token attention over keys lo .. hi - 1 of an F16 cache (grouped heads, a
    window inside a larger buffer) gives the attention's values to F16 rounding, and the same
    bits as over a cache that holds those keys alone."""
    n_head, n_kv = heads
    lo, hi = window
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(n_head, 64, generator=gen)
    k, v = (torch.randn(1, n_kv, 48, 64, generator=gen).half() for _ in range(2))
    y = ggml_flash_attn(q, k, v, (lo, hi), scale=0.125)
    assert y is not None
    alone = ggml_flash_attn(
        q, *(t[:, :, lo:hi].contiguous() for t in (k, v)), (0, hi - lo), scale=0.125
    )
    assert alone is not None
    assert torch.equal(y, alone)
    kk, vv = (t[0, :, lo:hi].double() for t in (k, v))  # [Hkv, S, hd]
    qq = q.double().view(n_kv, n_head // n_kv, 64)
    ref = torch.softmax(qq @ kk.transpose(1, 2) * 0.125, -1) @ vv
    assert torch.allclose(y.double(), ref.reshape(-1), atol=5e-3)
    assert ggml_flash_attn(q, k.float(), v.float(), (lo, hi), scale=0.125) is None, "F16 only"


def test_an_f32_kv_cache_keeps_unrounded_keys_and_values(
    ggml_model: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under an F32 KV cache (kv_cache_type) the compiled front leaves keys and values unrounded,
    as the steps do: the same bits, and not those of the F16 cache."""
    _, model, _ = ggml_model
    with kv_cache_type(GGMLType.F32):
        fused = decode(model, steps=2)
        monkeypatch.setattr(attention_module, "block_front", lambda *args, **kwargs: None)
        stepped = decode(model, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(fused, stepped, strict=True))
    assert not torch.equal(fused[-1], decode(model, steps=2)[-1])  # the F16 cache's differ


@pytest.mark.parametrize(
    ("ggml_model", "swapped_name"),
    [("gemma3", DOWN2), ("qwen3moe", "blk.1.ffn_down_exps.weight")],
    indirect=["ggml_model"],
)
def test_a_swap_is_what_the_next_compiled_call_reads(
    ggml_model: tuple[HotSwapRuntime, Decoder, ModelDir], swapped_name: str, tmp_path: Path
) -> None:
    """After a committed swap of a block's FFN matrix (qwen3moe: its experts' down stack) the
    compiled calls compute with the new weights (a fresh load's logits, prefill and decode
    step), and after the swap back with the old ones."""
    runtime, model, model_dir = ggml_model
    baseline = decode(model, steps=1)
    saved = model_dir.save(swapped_name, tmp_path / "saved")
    model_dir.put(swapped_name, model_dir.variant(swapped_name, Q.Q4_0, tmp_path / "variants"))
    assert runtime.apply(model_dir.plan("to", [swapped_name])).state is PlanState.COMMITTED
    swapped = decode(model, steps=1)
    fresh, fresh_model = open_ggml(model_dir.first)
    try:
        again = decode(fresh_model, steps=1)
    finally:
        fresh.close()
    assert not torch.equal(swapped[0], baseline[0])
    assert all(torch.equal(a, b) for a, b in zip(swapped, again, strict=True))
    model_dir.put(swapped_name, saved)
    assert runtime.apply(model_dir.plan("back", [swapped_name])).state is PlanState.COMMITTED
    assert all(torch.equal(a, b) for a, b in zip(decode(model, 1), baseline, strict=True))


def test_the_tail_is_left_to_the_steps_where_it_does_not_apply(
    ggml_model: tuple[HotSwapRuntime, Decoder, ModelDir],
) -> None:
    """Inside float products, with another numerics' weights, or with rows of another dtype, the
    steps are not compiled."""
    runtime, model, _ = ggml_model
    block = model.layers[0]
    x = torch.randn(1, 1, block.config.n_embd)
    a = torch.randn(1, 1, block.config.n_head * block.config.head_dim)
    norms = (block.post_attn_norm, block.ffn_norm, block.post_ffw_norm)
    args = (block.attention, block.feed_forward)
    kw = {"norms": norms, "eps": 1e-6}
    with ggml_norms():
        assert gemma3.block_tail(block.weights, x, a, *args, **kw) is not None
        with float_products():
            assert gemma3.block_tail(block.weights, x, a, *args, **kw) is None
        assert gemma3.block_tail(runtime.store, x, a, *args, **kw) is None  # exact's provider
        assert gemma3.block_tail(block.weights, x.double(), a, *args, **kw) is None
    assert gemma3.block_tail(block.weights, x, a, *args, **kw) is None  # outside a ggml forward
    rope = model.layer_inputs(0, 1, torch.device("cpu"), cached=False)[0][0]
    front = {"norm": block.attn_norm, "rope": rope, "eps": 1e-6}
    with ggml_norms():
        assert attention_module.block_front(block.weights, x, block.attention, **front) is not None
        with float_products():
            assert attention_module.block_front(block.weights, x, block.attention, **front) is None
        assert attention_module.block_front(runtime.store, x, block.attention, **front) is None
