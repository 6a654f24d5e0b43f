"""Qwen3.5 / Qwen3-Next hybrids: the delta rule's two forms agree, the layer pattern and keys are
read as llama.cpp reads them, the writer lays out llama.cpp's tensors, and a commit between two
requests leaves no recurrent state behind."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest
import torch

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, Storage
from ggufswap.runtime.models import HParams, HParamsError, build_model
from ggufswap.runtime.models.blocks.delta_net import (
    causal_conv,
    delta_rule_chunked,
    delta_rule_recurrent,
)
from ggufswap.runtime.models.kv_cache import HybridCache, greedy_continuation
from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.generate import (
    Batcher,
    BatcherOptions,
    Ended,
    Sampling,
    TextDelta,
)
from ggufswap.shards import read_header, requantize
from ggufswap.shards.presets import tiny_qwen3next, tiny_qwen35, tiny_qwen35moe
from ggufswap.shards.writer import model_metadata, plan_tensors, write_model

WAIT_ROUNDS = 1000


def random_inputs(seq: int, heads: int = 3, dim: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(2, seq, heads, dim, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(2, seq, heads, dim, generator=g), dim=-1)
    v = torch.randn(2, seq, heads, dim, generator=g)
    decay = -torch.rand(2, seq, heads, generator=g) * 0.5
    beta = torch.rand(2, seq, heads, generator=g)
    state = torch.randn(2, heads, dim, dim, generator=g) * 0.1
    return [q, k, v, decay, beta, state]


@pytest.mark.parametrize("seq", [1, 5, 64, 150])
def test_the_chunked_delta_rule_is_the_recurrence(seq: int) -> None:
    """Chunks of 64 (prompts) give the token-by-token recurrence's outputs and final state, from
    a non-zero state, across chunk borders and with a padded last chunk."""
    q, k, v, g, beta, state = random_inputs(seq)
    out_r, state_r = delta_rule_recurrent(q, k, v, g, beta, state=state)
    out_c, state_c = delta_rule_chunked(q, k, v, g, beta, state=state)
    assert torch.allclose(out_c, out_r, atol=2e-5, rtol=1e-4)
    assert torch.allclose(state_c, state_r, atol=2e-5, rtol=1e-4)


def test_the_causal_conv_carries_its_state() -> None:
    """A convolution over 9 inputs equals one over 4 then 5 with the carried state."""
    g = torch.Generator().manual_seed(1)
    x, kernel = torch.randn(1, 9, 6, generator=g), torch.randn(6, 4, generator=g)
    whole, _ = causal_conv(x, None, kernel)
    first, state = causal_conv(x[:, :4], None, kernel)
    second, _ = causal_conv(x[:, 4:], state, kernel)
    assert torch.allclose(torch.cat((first, second), dim=1), whole, atol=1e-6)
    assert torch.allclose(whole[0, 0], x[0, 0] * kernel[:, 3])  # zeros before the first input


def metadata_of(spec: Any) -> dict[str, Any]:
    return {key: typed.value for key, typed in model_metadata(spec)}


def test_the_layer_pattern_and_keys_are_llama_cpps() -> None:
    """Every 4th block is full attention by default (full_attention_interval), the file's
    attention.recurrent_layers wins, and qwen35's RoPE sections are required."""
    md = metadata_of(tiny_qwen35(n_layers=8))
    hp = HParams.from_metadata(md)
    assert hp.recurrent_layers == (True, True, True, False) * 2
    assert hp.ssm is not None
    assert (hp.ssm.n_k_heads, hp.ssm.n_v_heads, hp.ssm.head_v, hp.ssm.d_conv) == (2, 4, 16, 4)
    assert hp.rope_sections == (11, 11, 10, 0)
    assert (hp.head_dim, hp.n_rot) == (32, 8)
    flags = [False, True] * 4
    explicit = HParams.from_metadata(md | {"qwen35.attention.recurrent_layers": flags})
    assert explicit.recurrent_layers == tuple(flags)
    with pytest.raises(HParamsError, match=r"rope\.dimension_sections"):
        HParams.from_metadata({k: v for k, v in md.items() if "sections" not in k})
    with pytest.raises(HParamsError, match="time_step_rank"):
        HParams.from_metadata(md | {"qwen35.ssm.time_step_rank": 3})


def test_the_writer_lays_out_llama_cpps_tensors() -> None:
    """Recurrent blocks hold attn_qkv, attn_gate, the conv kernel and the per-head vectors
    (qwen3next: ssm_ba instead of ssm_beta / ssm_alpha), the full-attention block a doubled
    attn_q (query and gate per head); every MoE block a gated shared expert."""
    dense = {t.name: t.ne for t in plan_tensors(tiny_qwen35())}
    assert dense["blk.0.attn_qkv.weight"] == (64, 2 * 32 + 64)
    assert dense["blk.0.ssm_conv1d.weight"] == (4, 128)
    assert dense["blk.0.ssm_a"] == (4,)
    assert dense["blk.0.ssm_beta.weight"] == (64, 4)
    assert dense["blk.3.attn_q.weight"] == (64, 2 * 2 * 32)
    assert "blk.3.attn_qkv.weight" not in dense
    assert "blk.0.attn_q.weight" not in dense
    nxt = {t.name for t in plan_tensors(tiny_qwen3next())}
    assert "blk.0.ssm_ba.weight" in nxt
    assert "blk.0.ssm_beta.weight" not in nxt
    assert "blk.2.ffn_gate_inp_shexp.weight" in {t.name for t in plan_tensors(tiny_qwen35moe())}
    with pytest.raises(ValueError, match="multiple of ssm_k_heads"):
        tiny_qwen35(ssm_v_heads=3)
    with pytest.raises(ValueError, match="n_expert"):
        tiny_qwen3next(n_expert=0, shared_expert=False)


@pytest.mark.parametrize("preset", [tiny_qwen35, tiny_qwen35moe, tiny_qwen3next])
def test_the_hybrid_cache_holds_every_layers_state(preset: Any, tmp_path: Path) -> None:
    """A prefill fills the attention layers' keys and values and every delta-net layer's conv
    and recurrent states; a one-token step then continues them."""
    runtime = HotSwapRuntime.open(write_model(preset(), tmp_path)[0])
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(HParams.from_metadata(runtime.shards.metadata), runtime.store)
        cache = model.new_cache(max_len=8)
        assert isinstance(cache, HybridCache)
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3, 4]]), cache=cache)
            conv, state = cache.recurrent(0)
            assert conv is not None
            assert conv.shape == (1, 3, 128)
            assert state is not None
            assert state.shape == (1, 4, 16, 16)
            assert cache.recurrent(3) == (None, None)  # full attention: keys and values
            model(torch.tensor([[5]]), start_pos=4, cache=cache)
        assert cache.length == 5
    finally:
        runtime.close()


def served_text(batcher: Batcher, prompt: str, sampling: Sampling) -> str:
    """Submit one prompt and run the batcher's rounds on this thread until it ends."""
    generation = batcher.submit([prompt], sampling)
    text = ""
    for _ in range(WAIT_ROUNDS):
        batcher.step()
        try:
            while True:
                event = generation.events.get_nowait()
                if isinstance(event, TextDelta):
                    text += event.text
                elif isinstance(event, Ended):
                    return text
        except queue.Empty:
            pass
    raise AssertionError(f"no end after {WAIT_ROUNDS} rounds: {text!r}")


def test_a_commit_between_requests_leaves_no_recurrent_state(tmp_path: Path) -> None:
    """After a commit that swaps a delta-net weight, the next request decodes as a fresh load of
    the new weights does: no conv or recurrent state of the old version carries over."""
    spec = tiny_qwen35(n_vocab=2048, context_length=512)
    path = write_model(spec, tmp_path)[0]
    runtime = HotSwapRuntime.open(path)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(HParams.from_metadata(runtime.shards.metadata), runtime.store)
        tokenizer = GgufTokenizer.from_file(path)
        batcher = Batcher(runtime, model, tokenizer, options=BatcherOptions())
        sampling = Sampling(max_tokens=10, temperature=0.0)
        prompt = "Monday, Tuesday,"
        before = served_text(batcher, prompt, sampling)
        name = "blk.0.ssm_out.weight"
        requantize(path, name, "q4_0")
        runtime.apply(Plan("p", "", (Job(read_header(path).tensor_map()[name]),)))
        after = served_text(batcher, prompt, sampling)
        ids = tokenizer.encode(prompt)
        expected = greedy_continuation(model, ids, 10, cached=False)
        if tokenizer.eos_id in expected:
            expected = expected[: expected.index(tokenizer.eos_id)]
        assert after == tokenizer.decode(expected)
        assert isinstance(before, str)
    finally:
        runtime.close()


SWAPS = [
    (tiny_qwen35moe, "blk.1.ffn_down_exps.weight", Storage.DEQUANTIZED),
    (tiny_qwen35moe, "blk.1.ffn_down_exps.weight", Storage.NATIVE),
    (tiny_qwen3next, "blk.0.ssm_ba.weight", Storage.NATIVE),
    (tiny_qwen35, "blk.2.ssm_alpha.weight", Storage.DEQUANTIZED),
]


@pytest.mark.parametrize(
    ("preset", "name", "storage"),
    SWAPS,
    ids=["qwen35moe-experts", "qwen35moe-experts-native", "qwen3next-ssm_ba", "qwen35-alpha"],
)
def test_a_swap_equals_a_fresh_load(
    preset: Any, name: str, storage: Storage, tmp_path: Path
) -> None:
    """Re-quantizing an expert stack or a delta-net projection and hot-swapping it gives the
    logits of a fresh load bit for bit, in both storages."""
    tokens = torch.tensor([[1, 17, 33, 250, 4, 99, 7, 128, 5, 60]])
    path = write_model(preset().with_types(ffn_down_exps="q8_0", ssm_beta_alpha="q8_0"), tmp_path)[
        0
    ]

    def logits(runtime: HotSwapRuntime) -> torch.Tensor:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(HParams.from_metadata(runtime.shards.metadata), runtime.store)
        with torch.inference_mode():
            return model(tokens)

    runtime = HotSwapRuntime.open(path, storage=storage)
    try:
        before = logits(runtime)
        requantize(path, name, "q4_0")
        runtime.apply(Plan("p", "", (Job(read_header(path).tensor_map()[name]),)))
        swapped = logits(runtime)
    finally:
        runtime.close()
    fresh = HotSwapRuntime.open(path, storage=storage)
    try:
        assert torch.equal(swapped, logits(fresh))
    finally:
        fresh.close()
    assert not torch.equal(swapped, before), "the swap changed nothing"
