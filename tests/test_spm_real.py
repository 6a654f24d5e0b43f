"""The served SentencePiece tokenizer (llama.cpp's algorithm, ``runtime/serving/spm.py``) on the
real Gemma 3 270M's vocabulary: the ids llama.cpp gives for a varied corpus
(``tests/fixtures/gemma_real/tokens.json``, written by ``crosscheck/gemma_tokens.py``), and the
same ids, texts and streamed pieces as the Hugging Face tokenizer served before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ggufswap.runtime.serving.tokenizer import GgufTokenizer
from ggufswap.runtime.serving.vocabulary import read_vocabulary
from ggufswap.shards import read_header

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

FIXTURE = Path(__file__).parent / "fixtures" / "gemma_real" / "tokens.json"
SIDES = {"plain": False, "special": True}  # fixture key -> parse_special


@pytest.fixture(scope="module")
def corpus() -> dict[str, Any]:
    """The texts and llama.cpp's ids of them (both with and without special tokens parsed)."""
    fixture: dict[str, Any] = json.loads(FIXTURE.read_text())
    return fixture


@pytest.fixture(scope="module")
def served(real_gemma: Path) -> GgufTokenizer:
    return GgufTokenizer.from_file(real_gemma)


@pytest.fixture(scope="module")
def hugging_face(real_gemma: Path) -> GgufTokenizer:
    """The tokenizer served before: Hugging Face's BPE over the vocabulary's extracted merges."""
    pytest.importorskip("tokenizers", reason="the reference needs `pip install tokenizers`")
    return GgufTokenizer(read_vocabulary(read_header(real_gemma))[0], hf=True)


@pytest.mark.parametrize("side", SIDES)
def test_ids_are_llama_cpps(served: GgufTokenizer, corpus: dict[str, Any], side: str) -> None:
    """Every text of the corpus (GPL-3, code, scripts, emoji, runs of spaces and newlines, chat
    markers, byte fallback) encodes to the ids llama.cpp gives, special tokens parsed or not."""
    assert len(corpus["texts"]) >= 17
    for text, want in zip(corpus["texts"], corpus[side], strict=True):
        got = served.encode(text, add_bos=False, parse_special=SIDES[side])
        assert got == want, f"{text[:60]!r}: first difference at {_first_difference(got, want)}"


# slow: building the Hugging Face reference costs ~10 CPU-s; make test keeps llama.cpp's ids on
# the real vocabulary (above), its round trip (below), and test_tokenizer's equivalence with the
# previous tokenizer on a synthetic SentencePiece vocabulary.
@pytest.mark.slow
@pytest.mark.parametrize("side", SIDES)
def test_ids_texts_and_streamed_pieces_are_the_previous_tokenizers(
    served: GgufTokenizer, hugging_face: GgufTokenizer, corpus: dict[str, Any], side: str
) -> None:
    """The served tokenizer gives the Hugging Face tokenizer's ids for every text, and the same
    text for them (special tokens skipped or kept) and for every prefix of them (what a stream
    sends as tokens arrive)."""
    for text in corpus["texts"]:
        ids = served.encode(text, parse_special=SIDES[side])
        assert ids == hugging_face.encode(text, parse_special=SIDES[side]), text[:60]
        for skip in (True, False):
            assert served.decode(ids, skip_special=skip) == hugging_face.decode(
                ids, skip_special=skip
            )
        for end in range(min(len(ids), 600) + 1):
            assert served.decode(ids[:end]) == hugging_face.decode(ids[:end]), (text[:60], end)


def test_a_text_round_trips(served: GgufTokenizer, corpus: dict[str, Any]) -> None:
    """Decoding the ids of a text (no special tokens in it) gives the text back."""
    for text in corpus["texts"]:
        if "<" not in text:
            assert served.decode(served.encode(text)) == text


def _first_difference(got: list[int], want: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
        min(len(got), len(want)),
    )
