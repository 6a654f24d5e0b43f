"""A decode step in one compiled call under ggml's numerics (``runtime/models/blocks/
ggml_decode.py``, ``runtime/kernels/csrc/ggmlstep.c``), gemma3's and qwen3moe's: every block, the
final norm and the head give the bits of the blocks one call each and of the steps one by one,
read what the store holds after a commit, and step aside where they do not apply."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
import torch
from runtime_helpers import ModelDir, Q, one_thread
from test_ggml_block import open_ggml

import ggufswap.runtime.models.blocks.attention as attention_module
import ggufswap.runtime.models.blocks.decoder as decoder_module
import ggufswap.runtime.models.blocks.ggml_decode as ggml_decode
import ggufswap.runtime.models.gemma3 as gemma3
from ggufswap.runtime import HotSwapRuntime, PlanState, float_products
from ggufswap.runtime.kernels import _compiled, ggml_library
from ggufswap.runtime.kernels.ggml_step import (
    StepLayer,
    decode_step,
    rope_row,
    step_caches,
    step_weights,
)
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.models.blocks.ggml_decode import per_block_steps
from ggufswap.runtime.models.ggml_numerics import kv_cache_type
from ggufswap.runtime.models.registry import Decoder
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.presets import tiny_arch, tiny_llama3

pytestmark = [
    pytest.mark.skipif(ggml_library() is None, reason="no libggml installed"),
    pytest.mark.usefixtures(one_thread.__name__),
]

PROMPT = torch.tensor([[1, 17, 33, 250, 4, 99, 7]])
DOWN2 = "blk.2.ffn_down.weight"


@pytest.fixture(params=["gemma3"])
def gemma(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[HotSwapRuntime, Decoder, ModelDir]]:
    """A tiny model of a mix of ggml's types, native, with ggml's numerics: gemma3 (six blocks,
    five with a window of 4) unless the test asks for qwen3moe, or llama3-moe (a llama with 4
    experts and Llama 3.1's RoPE factors, a ``rope_freqs`` tensor: its RoPE tables are computed
    afresh each step, from its ``layer_inputs``)."""
    base = (
        tiny_llama3(n_layers=4, n_expert=4, n_expert_used=2, n_ff_expert=64)
        if request.param == "llama3-moe"
        else tiny_arch(request.param)
    )
    spec = base.with_types(
        ffn_gate="q4_0", ffn_up="q5_0", ffn_down="q8_0", attn_o="iq4_nl", attn_k="q5_0"
    )
    model_dir = ModelDir.write(tmp_path / "model", spec)
    runtime, model = open_ggml(model_dir.first)
    try:
        yield runtime, model, model_dir
    finally:
        runtime.close()


def steps_of(
    model: Decoder, steps: int, *, swap_at: tuple[int, object] | None = None
) -> list[torch.Tensor]:
    """The prompt's logits, then ``steps`` greedy steps' through a cache made too small for
    them (it grows twice); ``swap_at = (i, apply)``: ``apply()`` runs before step ``i``."""
    cache = model.new_cache(max_len=4)
    with torch.inference_mode():
        logits = model(PROMPT, cache=cache)
        out = [logits]
        for i in range(steps):
            if swap_at is not None and swap_at[0] == i:
                swap_at[1]()  # type: ignore[operator]
            token = logits[:, -1:].argmax(-1)
            logits = model(token, start_pos=cache.length, cache=cache)
            out.append(logits)
    return out


def ran(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each one-call step ran (``ggml_decode.decode_step`` replaced by a counting twin)."""
    real = ggml_decode.decode_step
    calls: list[bool] = []

    def counted(*args: object, **kwargs: object) -> object:
        y = real(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(y is not None)
        return y

    monkeypatch.setattr(ggml_decode, "decode_step", counted)
    return calls


@pytest.mark.parametrize("gemma", ["gemma3", "qwen3moe", "llama3-moe"], indirect=True)
def test_one_call_steps_give_the_bits_of_the_block_calls_and_of_the_steps(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six decode steps in one call each (gemma3's past the window, the cache grown twice) give,
    bit for bit, the logits of the blocks one compiled call each and of every step one by one
    (ggml's products, attention and MoE FFN called from Python)."""
    _, model, _ = gemma
    calls = ran(monkeypatch)
    one = steps_of(model, 6)
    assert calls == [True] * 6, "every decode step ran as one call"
    with per_block_steps():
        blocks = steps_of(model, 6)
        for name in ("block_layer", "block_tail"):
            monkeypatch.setattr(gemma3, name, lambda *args, **kwargs: None)
        monkeypatch.setattr(decoder_module, "block_moe_layer", lambda *args, **kwargs: None)
        monkeypatch.setattr(attention_module, "block_front", lambda *args, **kwargs: None)
        stepped = steps_of(model, 6)
    assert calls == [True] * 6, "not while the steps run block by block"
    for i, (a, b, c) in enumerate(zip(one, blocks, stepped, strict=True)):
        assert torch.equal(a, b), f"forward {i}: one call against the block calls"
        assert torch.equal(a, c), f"forward {i}: one call against the steps"


@pytest.mark.parametrize(
    ("gemma", "swapped"),
    [
        ("gemma3", DOWN2),
        ("gemma3", "head"),
        ("gemma3", "token_embd.weight"),
        ("qwen3moe", "blk.1.ffn_down_exps.weight"),
    ],
    indirect=["gemma"],
)
def test_a_swap_between_steps_is_what_the_next_step_reads(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir], swapped: str, tmp_path: Path
) -> None:
    """A swap committed between two steps of one cache (a block's FFN matrix, qwen3moe's experts'
    down stack, the head, or the embedding table the step decodes its row from) is
    what the next one-call step reads, as the block calls read it; a fresh load computes the
    same; after the swap back the steps are the first load's again."""
    runtime, model, model_dir = gemma
    name = model.output if swapped == "head" else swapped  # type: ignore[union-attr]
    assert isinstance(name, str)
    baseline = steps_of(model, 3)
    saved = model_dir.save(name, tmp_path / "saved")
    plans = iter(range(10))  # a plan id once: the runtime applies an id once

    def swap() -> None:
        model_dir.put(name, model_dir.variant(name, Q.Q4_0, tmp_path / "variants"))
        plan = model_dir.plan(f"to-{next(plans)}", [name])
        assert runtime.apply(plan).state is PlanState.COMMITTED

    def back() -> None:
        model_dir.put(name, saved)
        plan = model_dir.plan(f"back-{next(plans)}", [name])
        assert runtime.apply(plan).state is PlanState.COMMITTED

    one = steps_of(model, 3, swap_at=(2, swap))
    back()
    with per_block_steps():
        blocks = steps_of(model, 3, swap_at=(2, swap))
    assert all(torch.equal(a, b) for a, b in zip(one, blocks, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(one[:3], baseline[:3], strict=True))
    assert not torch.equal(one[3], baseline[3]), "the step after the commit reads the swap"
    fresh, fresh_model = open_ggml(model_dir.first)
    try:
        again = steps_of(fresh_model, 3)
        assert all(torch.equal(a, b) for a, b in zip(steps_of(model, 3), again, strict=True))
    finally:
        fresh.close()
    back()
    assert all(torch.equal(a, b) for a, b in zip(steps_of(model, 3), baseline, strict=True))


@pytest.mark.parametrize("where", ["float products", "F32 cache", "block by block"])
def test_the_step_steps_aside_where_it_does_not_apply_and_comes_back(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Inside float products, under an F32 KV cache or block by block, a decode step is not one
    call (the blocks step); after it, without a commit, it is one call again."""
    _, model, _ = gemma
    calls = ran(monkeypatch)
    aside: AbstractContextManager[object] = {
        "float products": float_products(),
        "F32 cache": kv_cache_type(GGMLType.F32),
        "block by block": per_block_steps(),
    }.get(where, nullcontext())
    with aside:
        steps_of(model, 2)
    assert calls == [], "no one-call step ran"
    steps_of(model, 2)
    assert calls == [True] * 2


def test_a_decoder_with_exact_numerics_never_takes_the_call(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder with exact numerics over the same store steps block by block."""
    runtime, _, _ = gemma
    calls = ran(monkeypatch)
    assert runtime.shards is not None
    config = HParams.from_metadata(runtime.shards.metadata)
    exact = build_model(config, runtime.store, store=runtime.store)
    steps_of(exact, 2)
    assert calls == []


def test_step_arguments_that_do_not_fit_are_refused(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir],
) -> None:
    """A step's weights need a final norm of the blocks' width; its caches F16 buffers of each
    block's heads, one pair a block; its call a float32 row of that width and one RoPE row a
    kind of block: elsewhere None (the blocks step). A position past the caches is refused by
    the C side, not written."""
    _, model, _ = gemma
    weights = model.weights
    layers = [layer.step_layer(0) for layer in model.layers]
    assert all(isinstance(layer, StepLayer) for layer in layers)
    head = weights.matrix(model.output)
    norm = weights.weight(model.norm)
    held = step_weights(layers, norm, head.blocks)  # type: ignore[arg-type, union-attr]
    assert held is not None
    assert step_weights(layers, norm[:-1], head.blocks) is None  # type: ignore[arg-type, union-attr]
    f16 = [(torch.zeros(1, h, 8, d, dtype=torch.float16),) * 2 for h, d in held.heads]
    caches = step_caches(held, f16)
    assert caches is not None
    assert step_caches(held, [(k.float(), v.float()) for k, v in f16]) is None
    assert step_caches(held, f16[:-1]) is None
    n_rot = model.config.n_rot
    cos, sin = torch.ones(1, n_rot // 2), torch.zeros(1, n_rot // 2)
    assert rope_row(cos[:, :-1], sin[:, :-1], n_rot, True, 0) is None
    assert rope_row(cos.double(), sin.double(), n_rot, True, 0) is None
    rope = rope_row(cos, sin, n_rot, True, 0)
    assert rope is not None
    x = torch.randn(1, 1, held.d)
    assert decode_step(x.double(), held, [rope], caches, pos=0, eps=1e-6) is None
    assert decode_step(x, held, [rope, rope], caches, pos=0, eps=1e-6) is None
    logits = decode_step(x, held, [rope], caches, pos=0, eps=1e-6)
    assert logits is not None
    assert logits.shape == (1, 1, head.blocks.shape[0])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="pos=8 of 8"):
        decode_step(x, held, [rope], caches, pos=8, eps=1e-6)


@pytest.mark.parametrize("gemma", ["gemma3", "qwen3moe"], indirect=True)
def test_what_a_stack_tells_its_steps_is_what_its_layer_inputs_give_them(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir],
) -> None:
    """A stack's ``step_kinds`` tells a one-token step, without tables or masks, what its
    ``layer_inputs`` give it: each layer's kind, each kind's RoPE rows (the same rows of the
    same tables) and first key, at every position before, at and past gemma3's window of 4, and
    past the tables' first length (they grow)."""
    _, model, _ = gemma
    told = ggml_decode._told(model)  # type: ignore[arg-type]
    assert told is not None
    cpu = torch.device("cpu")
    grown = told.ropes[0][0]._n_pos  # the tables' first length: past it they grow
    for pos in [*range(12), grown - 1, grown, grown + 5]:
        inputs = model.layer_inputs(pos, 1, cpu, cached=True)  # type: ignore[union-attr]
        found = ggml_decode._kinds(inputs, pos + 1)
        assert found is not None
        rows, _ = told.rows(pos)
        assert (told.kinds, rows) == found, f"position {pos}"
    assert told.ropes[0][0]._n_pos > grown


def test_a_stack_whose_layer_inputs_differ_is_told_nothing(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stack class that gives its layers other inputs (it overrides ``layer_inputs``) and does
    not tell its steps so (``step_kinds``) is told nothing: its steps read ``layer_inputs``, and
    still run as one call with the same bits."""
    _, model, _ = gemma
    base = type(model)

    def layer_inputs(self: Decoder, *args: object, **kwargs: object) -> object:
        return base.layer_inputs(self, *args, **kwargs)  # type: ignore[arg-type]

    told = type("Other", (base,), {"layer_inputs": layer_inputs})
    calls = ran(monkeypatch)
    first = steps_of(model, 6)
    model.__class__ = told
    try:
        assert model.step_kinds() is None  # type: ignore[operator]
        assert ggml_decode._told(model) is None  # type: ignore[arg-type]
        again = steps_of(model, 6)
    finally:
        model.__class__ = base
    assert calls == [True] * 12
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("gemma", ["gemma3", "qwen3moe"], indirect=True)
def test_a_token_past_the_vocabulary_is_refused_as_the_blocks_refuse_it(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir],
) -> None:
    """A one-call step decodes its token's embedding row itself; a token that is not a row is
    refused as the blocks' embedding refuses it, and nothing is added to the cache."""
    _, model, _ = gemma
    vocab = model.config.n_vocab  # type: ignore[union-attr]
    refused = []
    for aside in (nullcontext(), per_block_steps()):
        cache = model.new_cache(max_len=16)
        with torch.inference_mode(), aside:
            model(PROMPT, cache=cache)
            for token in (vocab, -1):
                with pytest.raises((IndexError, RuntimeError)) as info:
                    model(torch.tensor([[token]]), start_pos=cache.length, cache=cache)
                refused.append((type(info.value), cache.length))
    assert refused[:2] == refused[2:]
    assert {length for _, length in refused} == {PROMPT.shape[1]}


def test_the_call_scales_the_embedding_as_torch_does(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir],
) -> None:
    """The call's ``x_scale`` multiplies the row in float32 as torch's ``x * scale`` does, for a
    scale that is not a power of two (gemma3's own, sqrt(640) for the real model)."""
    _, model, _ = gemma
    weights = model.weights
    layers = [layer.step_layer(0) for layer in model.layers]
    head = weights.matrix(model.output)
    held = step_weights(layers, weights.weight(model.norm), head.blocks)  # type: ignore[arg-type, union-attr]
    assert held is not None
    n_rot = model.config.n_rot
    cos, sin = torch.rand(1, n_rot // 2), torch.rand(1, n_rot // 2)
    rope = rope_row(cos, sin, n_rot, True, 0)
    assert rope is not None
    x, scale = torch.randn(1, 1, held.d), math.sqrt(640)
    logits = []
    for row, by in ((x, scale), (x * scale, 1.0)):
        f16 = [(torch.zeros(1, h, 8, d, dtype=torch.float16),) * 2 for h, d in held.heads]
        caches = step_caches(held, f16)
        assert caches is not None
        logits.append(decode_step(row, held, [rope], caches, pos=0, eps=1e-6, x_scale=by))
    assert logits[0] is not None
    assert torch.equal(logits[0], logits[1])  # type: ignore[arg-type]


def test_the_step_decodes_the_embedding_its_stack_would(
    gemma: tuple[HotSwapRuntime, Decoder, ModelDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step decodes its token's embedding row itself only where the stack embeds as
    ``DecoderStack`` does and the compiled decoder is on; with the compiled kernels switched off
    between steps it takes the stack's embedding, and the steps stay one call with the same
    bits."""
    _, model, _ = gemma
    base = type(model)
    d = model.config.n_embd  # type: ignore[union-attr]
    weights = model.weights
    assert ggml_decode._embedding(weights, model, d) is not None  # type: ignore[arg-type]

    def embedding(self: Decoder, tokens: torch.Tensor) -> torch.Tensor:
        return base.embedding(self, tokens)  # type: ignore[arg-type]

    model.__class__ = type("OwnEmbedding", (base,), {"embedding": embedding})
    try:
        assert ggml_decode._embedding(weights, model, d) is None  # type: ignore[arg-type]
    finally:
        model.__class__ = base
    calls = ran(monkeypatch)
    first = steps_of(model, 4)
    with _compiled.disabled():
        off = steps_of(model, 4)
    assert calls == [True] * 8
    assert all(torch.equal(a, b) for a, b in zip(first, off, strict=True))
