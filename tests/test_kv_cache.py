"""Incremental decoding with a KV cache gives the logits of a full forward, for every
architecture, and the server's cached greedy decoding gives the text of uncached decoding."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from runtime_helpers import one_thread

from ggufswap.runtime import HotSwapRuntime, Storage
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.models.errors import KVCacheError
from ggufswap.runtime.models.gemma3 import sliding_window_mask
from ggufswap.runtime.models.kv_cache import (
    KVCache,
    attention_mask,
    greedy_continuation,
    mask_keys,
)
from ggufswap.runtime.models.registry import Decoder
from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.generate import (
    Batcher,
    BatcherOptions,
    Ended,
    Event,
    Sampling,
    TextDelta,
)
from ggufswap.shards.presets import tiny_arch, tiny_dense, tiny_gpt_oss, tiny_llama3, tiny_moe
from ggufswap.shards.writer import ModelSpec, write_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

WAIT_ROUNDS = 1000  # upper bound of batcher rounds in one test: a broken loop fails, never hangs
ATOL = 1e-5
# Delta-net layers: the chunked prefill (a triangular solve per chunk) and the token-by-token
# recurrence round differently in float32 (each ~1e-7 from a float64 recurrence), and the per-head
# RMS norm of their small outputs magnifies it (measured: 3.7e-5 on qwen35, 1.5e-4 on qwen3next).
ATOL_RECURRENT = 5e-4
# gemma4: its three extra RMS norms per block (V, and each FFN output twice) roughly triple the
# float32 rounding of the cached path's differently shaped products (measured over 6 seeds: max
# 8.8e-6 .. 1.2e-5, gemma3 2.9e-6 .. 7.1e-6).
ATOL_GEMMA4 = 3e-5

# Every architecture (gemma3's window of 4 is shorter than the sequences), llama as MoE too.
SPECS = {
    "llama": tiny_dense(),
    "llama-moe": tiny_arch("llama", n_expert=4, n_expert_used=2),
    "qwen2": tiny_arch("qwen2"),
    "qwen3": tiny_arch("qwen3"),
    "qwen2moe": tiny_arch("qwen2moe"),
    "qwen3moe": tiny_moe(),
    "gemma3": tiny_arch("gemma3"),
    "gemma3-q4": tiny_arch("gemma3").with_types(attn_q="q4_0", ffn_down="q4_0"),
    "deepseek2": tiny_arch("deepseek2"),  # attn_k_b/attn_v_b: the cache holds the latent
    "deepseek2-kv-b": tiny_arch("deepseek2", mla_split=False, q_lora_rank=0),
    "glm4moe": tiny_arch("glm4moe"),
    "llama-rope-freqs": tiny_llama3(),
    "gpt-oss": tiny_gpt_oss(),  # sinks, window of 4 on even layers, YaRN, MXFP4 experts
    "qwen3vlmoe": tiny_arch("qwen3vlmoe"),  # interleaved multimodal RoPE
    "minimax-m2": tiny_arch("minimax-m2"),
    "llama4": tiny_arch("llama4"),  # chunked RoPE layers, a NoPE layer with the temperature
    "gemma4": tiny_arch("gemma4"),  # per-layer head shapes: the cache holds both kinds
    "dots1": tiny_arch("dots1"),
    # delta-net blocks: conv and recurrent state in the cache, a chunked prefill
    "qwen35": tiny_arch("qwen35"),
    "qwen3next": tiny_arch("qwen3next"),
    # the indexer's keys cached beside the latent; top-k 4 of up to 12 positions
    "deepseek32": tiny_arch("deepseek32"),
    "glm-dsa": tiny_arch("glm-dsa"),  # shared blocks reuse the full ones' selection
    "deepseek2-ik": tiny_arch("deepseek2", mla_split=False, mla_ik=True),
}


def open_model(spec: ModelSpec, root: Path) -> Iterator[tuple[HotSwapRuntime, Decoder]]:
    """A runtime over ``spec`` written into ``root`` (``root/<name>.gguf``), and its decoder."""
    runtime = HotSwapRuntime.open(write_model(spec, root)[0])
    assert runtime.shards is not None, "open() keeps the shard set"
    config = HParams.from_metadata(runtime.shards.metadata)
    try:
        yield runtime, build_model(config, runtime.store, store=runtime.store)
    finally:
        runtime.close()


@pytest.fixture(params=list(SPECS))
def model(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Decoder]:
    for _, decoder in open_model(SPECS[request.param], tmp_path):
        yield decoder


def random_tokens(model: Decoder, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.n_vocab, (batch, length), generator=g)


def test_prefill_and_steps_give_the_logits_of_a_full_forward(model: Decoder) -> None:
    """A prefill of 7 tokens, a 3-token chunk and ten one-token steps give the logits of one
    forward over all 20 tokens (batch of 2), to float rounding (the delta-net layers' states
    included)."""
    tokens = random_tokens(model, batch=2, length=20)
    cache = model.new_cache(max_len=8)  # grows twice on the way
    with torch.inference_mode():
        full = model(tokens)
        parts = [
            model(tokens[:, :7], cache=cache),
            model(tokens[:, 7:10], start_pos=7, cache=cache),
        ]
        parts += [model(tokens[:, i : i + 1], start_pos=i, cache=cache) for i in range(10, 20)]
    assert cache.length == 20
    atol = ATOL_RECURRENT if model.config.ssm is not None else ATOL
    atol = ATOL_GEMMA4 if model.config.arch.value == "gemma4" else atol
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=atol, rtol=0)


def test_greedy_decoding_with_the_cache_picks_the_tokens_of_full_forwards(model: Decoder) -> None:
    """Greedy decoding of 16 tokens with the cache (past a sliding window of 4 several times)
    gives the tokens of decoding without it."""
    prompt = random_tokens(model, batch=1, length=5, seed=1)[0].tolist()
    with_cache = greedy_continuation(model, prompt, 16, cached=True)
    assert with_cache == greedy_continuation(model, prompt, 16, cached=False)


@pytest.mark.parametrize("storage", [Storage.NATIVE, Storage.DEQUANTIZED], ids=lambda s: s.value)
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3moe", "deepseek32"])
def test_last_only_gives_the_last_positions_logits(
    tmp_path: Path, arch: str, storage: Storage
) -> None:
    """``last_only`` (what generation asks for) computes the head for the last position alone,
    with and without a cache: the full forward's last row, bit for bit where the store's
    products go row by row (native), to float rounding where torch multiplies the rows
    together (dequantized)."""
    runtime = HotSwapRuntime.open(write_model(tiny_arch(arch), tmp_path)[0], storage=storage)
    try:
        assert runtime.shards is not None
        model = build_model(
            HParams.from_metadata(runtime.shards.metadata), runtime.store, store=runtime.store
        )
        tokens = random_tokens(model, batch=2, length=9)
        cache = model.new_cache(max_len=9)
        with torch.inference_mode():
            full = model(tokens)[:, -1:]
            last = model(tokens, last_only=True)
            cached = model(tokens, cache=cache, last_only=True)
        assert last.shape == cached.shape == (2, 1, model.config.n_vocab)
        if storage is Storage.NATIVE:
            assert torch.equal(last, full)
        torch.testing.assert_close(last, full, atol=ATOL, rtol=0)
        torch.testing.assert_close(cached, full, atol=ATOL, rtol=0)
    finally:
        runtime.close()


def test_cached_decoding_is_deterministic(model: Decoder) -> None:
    """The same prompt decoded twice with fresh caches gives bit-identical logits."""
    tokens = random_tokens(model, batch=1, length=12, seed=2)
    runs = []
    for _ in range(2):
        cache = model.new_cache(max_len=12)
        with torch.inference_mode():
            steps = [model(tokens[:, :4], cache=cache)[:, -1]]
            steps += [
                model(tokens[:, i : i + 1], start_pos=i, cache=cache)[:, -1] for i in range(4, 12)
            ]
        runs.append(torch.cat(steps))
    assert torch.equal(runs[0], runs[1])


def test_a_forward_that_does_not_continue_the_cache_is_refused(tmp_path: Path) -> None:
    """A cached forward at a position other than the cache's length raises, naming both, and
    leaves the cache as it was."""
    for _, model in open_model(tiny_dense(), tmp_path):
        tokens = random_tokens(model, batch=1, length=6)
        cache = model.new_cache(max_len=6)
        with torch.inference_mode():
            model(tokens[:, :4], cache=cache)
            with pytest.raises(KVCacheError, match="holds 4 positions, the forward starts at 5"):
                model(tokens[:, 5:6], start_pos=5, cache=cache)
            with pytest.raises(KVCacheError, match="holds 4 positions, the forward starts at 0"):
                model(tokens[:, :1], cache=cache)
        assert cache.length == 4


def test_the_cache_grows_past_its_initial_length() -> None:
    """Writing past ``max_len`` keeps every earlier position and returns all of them."""
    cache = KVCache(n_layer=1, max_len=2)
    k = torch.arange(5 * 3, dtype=torch.float32).view(1, 1, 5, 3)
    for i in range(5):
        all_k, all_v = cache.update(0, k[:, :, i : i + 1], -k[:, :, i : i + 1])
        cache.advance(1)
        assert torch.equal(all_k, k[:, :, : i + 1])
        assert torch.equal(all_v, -k[:, :, : i + 1])


def test_attention_mask_with_a_cache_keeps_causality_and_the_window() -> None:
    """Queries at positions 5..7 see keys up to their own position, and with a window of 3 only
    the last 3; from position 0 it is the sliding-window mask (or None: plain causal)."""
    mask = attention_mask(5, 3, window=3, device=torch.device("cpu"))
    assert mask is not None
    assert [[j for j in range(8) if mask[i, j]] for i in range(3)] == [
        [3, 4, 5],
        [4, 5, 6],
        [5, 6, 7],
    ]
    causal = attention_mask(5, 1, device=torch.device("cpu"))
    assert causal is not None
    assert bool(causal.all())
    assert causal.shape == (1, 6)
    assert attention_mask(0, 4, device=torch.device("cpu")) is None
    assert attention_mask(0, 3, window=3, device=torch.device("cpu")) is None
    windowed = attention_mask(0, 6, window=3, device=torch.device("cpu"))
    assert windowed is not None
    assert torch.equal(windowed, sliding_window_mask(6, 3, torch.device("cpu")))


@pytest.mark.parametrize("window", [0, 1, 3, 8])
def test_a_one_query_mask_is_marked_with_its_run_of_keys(window: int) -> None:
    """A decode step's mask (one query at ``start``) allows what the general mask's row allows,
    and is marked with that run of keys; a copy carries no mark (its keys are read from its
    values)."""
    cpu = torch.device("cpu")
    for start in range(2, 14):  # the general mask from start - 1 is None at 0
        mask = attention_mask(start, 1, window=window, device=cpu)
        assert mask is not None
        general = attention_mask(start - 1, 2, window=window, device=cpu)  # its last row
        assert general is not None
        assert mask.shape == (1, start + 1)
        assert torch.equal(mask[0], general[1])
        keep = general[1].nonzero().flatten()
        assert mask_keys(mask) == (int(keep[0]), int(keep[-1]) + 1)
        assert mask_keys(mask.clone()) is None


def served_text(batcher: Batcher, prompt: str, sampling: Sampling) -> str:
    """Submit one prompt and run the batcher's rounds on this thread until it ends."""
    generation = batcher.submit([prompt], sampling)
    text = ""
    for _ in range(WAIT_ROUNDS):
        batcher.step()
        try:
            while True:
                event: Event = generation.events.get_nowait()
                if isinstance(event, TextDelta):
                    text += event.text
                elif isinstance(event, Ended):
                    return text
        except queue.Empty:
            pass
    raise AssertionError(f"no end after {WAIT_ROUNDS} rounds: {text!r}")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen35moe"])
def test_the_batcher_decodes_with_the_cache_as_full_forwards_would(
    arch: str, tmp_path: Path
) -> None:
    """The batcher's greedy completion (prefill, then one token per step) is the text of greedy
    decoding without a cache, and the same prompt twice gives the same text."""
    spec = tiny_arch(arch, n_vocab=2048, context_length=512)
    for runtime, model in open_model(spec, tmp_path):
        [path] = tmp_path.glob("*.gguf")
        tokenizer = GgufTokenizer.from_file(path)
        batcher = Batcher(runtime, model, tokenizer, options=BatcherOptions())
        sampling = Sampling(max_tokens=12, temperature=0.0)
        # Its completion is plain pieces: text streamed from byte tokens can differ from the final
        # decode of the same tokens (an invalid UTF-8 run decodes differently once it grows).
        prompt = "Monday, Tuesday,"
        text = served_text(batcher, prompt, sampling)
        assert served_text(batcher, prompt, sampling) == text
        ids = tokenizer.encode(prompt)
        uncached = greedy_continuation(model, ids, 12, cached=False)
        if tokenizer.eos_id in uncached:
            uncached = uncached[: uncached.index(tokenizer.eos_id)]
        assert "\ufffd" not in tokenizer.decode(uncached), "pick a prompt without byte tokens"
        assert text == tokenizer.decode(uncached)


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_a_mask_written_in_place_is_read_again(inference: bool) -> None:
    """The run of keys a step's mask allows is kept for the step's layers, and read again when
    the same mask tensor was written in place since (inference tensors included, which keep no
    version counter)."""
    from ggufswap.runtime.models.blocks.attention import _span

    with torch.inference_mode(inference):
        _mask_written_in_place_is_read_again(_span)


def _mask_written_in_place_is_read_again(_span: Callable[[torch.Tensor], object]) -> None:
    mask = torch.tensor([[False, True, True, False]])
    assert _span(mask) == (1, 3)
    mask[0, 3] = True
    assert _span(mask) == (1, 4)
    mask[0, 2] = False
    assert _span(mask) is None  # no longer one run
