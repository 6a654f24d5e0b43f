"""Tokenizers built from GGUF tokenizer metadata: SentencePiece-style (``llama``) and byte-level
BPE (``gpt2``), special tokens, BOS/EOS rules, and refusals that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ggufswap.runtime.serving.errors import TokenizerError
from ggufswap.runtime.serving.tokenizer import (
    SPACE,
    GgufTokenizer,
    TokenType,
    Vocabulary,
    spm_merges,
)
from ggufswap.shards.arrays import StringArray
from ggufswap.shards.presets import tiny_dense
from ggufswap.shards.writer import write_model

pytest.importorskip("tokenizers", reason="the tokenizer needs `pip install tokenizers`")

N, C, U, B = TokenType.NORMAL, TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.BYTE


PIECES = [f"{SPACE}the", "he", f"{SPACE}t", "t", "h", "e", SPACE, "c", "a", "at", "ca", f"{SPACE}c"]


def spm_md(**extra: Any) -> dict[str, Any]:
    """A small SentencePiece vocabulary: specials, bytes, and pieces whose scores favour ``▁the``
    over ``▁t`` + ``he``."""
    pieces = [
        ("<unk>", TokenType.UNKNOWN, 0.0),
        ("<s>", C, 0.0),
        ("</s>", C, 0.0),
        ("<|turn|>", C, 0.0),
        ("\n\n", U, 0.0),
        *((f"<0x{i:02X}>", B, 0.0) for i in range(256)),
        *(
            (p, N, -float(i))
            for i, p in enumerate(
                [
                    f"{SPACE}the",
                    "he",
                    f"{SPACE}t",
                    "t",
                    "h",
                    "e",
                    SPACE,
                    "c",
                    "a",
                    "at",
                    "ca",
                    f"{SPACE}c",
                ]
            )
        ),
        (f"{SPACE}cat", N, -20.0),
    ]
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p for p, _, _ in pieces],
        "tokenizer.ggml.token_type": [int(t) for _, t, _ in pieces],
        "tokenizer.ggml.scores": [s for _, _, s in pieces],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    md.update(extra)
    return md


def spm(**extra: Any) -> GgufTokenizer:
    return GgufTokenizer(Vocabulary.from_metadata(spm_md(**extra)))


def test_spm_merges_by_score_and_prefixes_a_space() -> None:
    """`the cat` becomes ▁the ▁cat (merges ranked by the merged piece's score), after BOS."""
    tok = spm()
    ids = tok.encode("the cat")
    assert [tok.token(i) for i in ids] == ["<s>", f"{SPACE}the", f"{SPACE}cat"]
    assert tok.decode(ids) == "the cat"


def test_spm_merge_order_follows_scores() -> None:
    """Merges come best merged-score first; only splits into two vocabulary tokens count."""
    merges = spm_merges(Vocabulary.from_metadata(spm_md()))
    assert merges[0] == (f"{SPACE}t", "he")  # ▁the has the best score; ▁ + the is no split
    assert (f"{SPACE}c", "at") in merges
    assert ("c", "at") not in merges  # "cat" is no token
    assert merges.index(("a", "t")) < merges.index(("c", "a"))


def test_spm_unknown_characters_fall_back_to_byte_tokens_and_round_trip() -> None:
    """Characters with no piece become their UTF-8 byte tokens and decode back."""
    tok = spm()
    ids = tok.encode("é!", add_bos=False)
    assert [tok.token(i) for i in ids] == [SPACE, "<0xC3>", "<0xA9>", "<0x21>"]
    assert tok.decode(ids) == "é!"


def test_add_space_prefix_false_keeps_the_text_as_written() -> None:
    """With add_space_prefix false (gemma) the first word gets no ▁ (and "at" outranks "ca")."""
    tok = spm(**{"tokenizer.ggml.add_space_prefix": False})
    assert [tok.token(i) for i in tok.encode("cat", add_bos=False)] == ["c", "at"]
    assert tok.decode(tok.encode("the cat")) == "the cat"


def test_control_tokens_need_parse_special_and_user_defined_are_always_whole() -> None:
    """<|turn|> is one token only with parse_special; a user-defined token always is."""
    tok = spm()
    turn = tok.token_id("<|turn|>")
    assert tok.encode("<|turn|>", add_bos=False, parse_special=True) == [turn]
    assert turn not in tok.encode("<|turn|>", add_bos=False)
    assert tok.token_id("\n\n") in tok.encode("the\n\ncat", add_bos=False)
    assert tok.decode([turn, *tok.encode("the", add_bos=False)]) == "the"
    assert tok.decode([turn], skip_special=False) == "<|turn|>"


def test_bos_and_eos_follow_the_file_unless_overridden() -> None:
    """add_bos_token / add_eos_token decide the defaults; arguments override them."""
    tok = spm(**{"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})
    ids = tok.encode("the")
    assert ids[0] != 1
    assert ids[-1] == 2
    assert tok.encode("the", add_bos=True, add_eos=False)[0] == 1


def bpe_md(**extra: Any) -> dict[str, Any]:
    """A byte-level BPE vocabulary: the 256 byte symbols plus merges for 'hello' and ' world'."""
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet())
    merged = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    tokens = [*symbols, *merged, "<|endoftext|>"]
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(N)] * (len(tokens) - 1) + [int(C)],
        "tokenizer.ggml.merges": [
            "h e",
            "l l",
            "he ll",
            "hell o",
            "Ġ w",
            "o r",
            "Ġw or",
            "l d",
            "Ġwor ld",
        ],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    md.update(extra)
    return md


def test_bpe_applies_the_file_merges_and_round_trips_bytes() -> None:
    """'hello world' is two tokens; any text (accents, emoji) round-trips; no BOS by default."""
    tok = GgufTokenizer(Vocabulary.from_metadata(bpe_md()))
    ids = tok.encode("hello world")
    assert [tok.token(i) for i in ids] == ["hello", "Ġworld"]
    for text in ["hello  world\n", "naïve 🤖 123456", ""]:
        assert tok.decode(tok.encode(text)) == text
    eos = tok.eos_id
    assert tok.encode("hello<|endoftext|>", parse_special=True)[-1] == eos


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "rwkv"}, "'rwkv' is not supported"),
        ({"tokenizer.ggml.scores": None}, "needs 'tokenizer.ggml.scores'"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "token_type has 2 entries"),
        ({"tokenizer.ggml.bos_token_id": 10_000}, "bos_token_id = 10000 is outside"),
    ],
)
def test_bad_metadata_is_refused_naming_the_key(change: dict[str, Any], message: str) -> None:
    """Unsupported kinds, missing scores, mismatched lengths and ids outside the vocabulary are
    refused with the key in the message."""
    md = {k: v for k, v in {**spm_md(), **change}.items() if v is not None}
    with pytest.raises(TokenizerError, match=message):
        Vocabulary.from_metadata(md)


def test_bpe_with_an_unknown_pre_tokenizer_is_refused() -> None:
    """A tokenizer.ggml.pre this module has no regex for is named, with the known ones."""
    with pytest.raises(TokenizerError, match="'deepseek-coder' is not supported"):
        Vocabulary.from_metadata(bpe_md(**{"tokenizer.ggml.pre": "deepseek-coder"}))


def test_a_written_model_file_gives_its_tokenizer(tmp_path: Path) -> None:
    """The writer's tiny model carries a SentencePiece vocabulary that builds: ids, specials and
    byte tokens as written."""
    path = write_model(tiny_dense(), tmp_path)[0]
    tok = GgufTokenizer.from_file(path)
    assert tok.n_vocab == 256
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("ab")
    assert ids[0] == 1
    assert [tok.token(i) for i in ids[-2:]] == ["<0x61>", "<0x62>"]
    assert tok.decode(ids[-2:]) == "ab"


def test_spm_look_ups_read_the_strings_decoded_at_the_build(tmp_path: Path) -> None:
    """An SPM tokenizer's entries and piece bytes come from the strings its build decoded: the
    file's string array is never walked again (a walk of Gemma's 262k tokens was ~0.07 s of a
    start, for the chat template's BOS and EOS)."""
    path = write_vocabulary(tmp_path / "vocab.gguf", spm_md())
    tok = GgufTokenizer.from_file(path)
    strings = tok.vocab.tokens
    assert isinstance(strings, StringArray)
    assert [tok.token(i) for i in range(tok.n_vocab)] == strings.tolist()
    assert tok.piece_bytes(tok.token_id("<0x61>") or 0) == b"a"
    assert strings._starts is None  # what a walk fills in


def test_streamed_text_is_always_a_prefix_of_the_final_text() -> None:
    """A trailing run of byte tokens is held back: <0x79> decodes to 'y' alone, but with <0x80>
    the group is invalid UTF-8 and both bytes become U+FFFD, so 'y' must not be streamed early."""
    from ggufswap.runtime.serving.streaming import sendable_end

    tok = spm()
    y, cont, cat = (tok.token_id(t) for t in ("<0x79>", "<0x80>", f"{SPACE}cat"))
    assert y is not None
    assert cont is not None
    assert cat is not None
    completion = [cat, y, cont, cat]
    assert tok.decode(completion[:2]).endswith("y")
    assert tok.trailing_byte_tokens(completion[:3]) == 2
    assert tok.trailing_byte_tokens(completion) == 0
    final = tok.decode(completion)
    sent = 0
    for n in range(1, len(completion) + 1):
        text = tok.decode(completion[:n])
        sent = sendable_end(tok, completion[:n], text, (), sent=sent)
        assert final.startswith(text[:sent]), (n, text[:sent], final)
    assert "y" not in final


def long_token_md(length: int) -> dict[str, Any]:
    """The small vocabulary plus one normal token of ``length`` characters."""
    md = spm_md()
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], "x" * length]
    md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"], int(N)]
    md["tokenizer.ggml.scores"] = [*md["tokenizer.ggml.scores"], -30.0]
    return md


@pytest.mark.timeout(60)
@pytest.mark.reliability(
    "bad input",
    "a vocabulary token of 1,000,000 characters (O(L²) merge extraction took ~23 min)",
    tries=1,
    outcome="the tokenizer builds in linear time (under the 60 s limit) and encodes as before",
)
def test_a_megabyte_token_builds_in_linear_time() -> None:
    """One 1 MB token costs the merge extraction time linear in its length (cuts are tried only
    where both halves have a length some token has), so the tokenizer builds and encodes."""
    tok = GgufTokenizer(Vocabulary.from_metadata(long_token_md(1_000_000)))
    assert tok.decode(tok.encode("the cat")) == "the cat"


@pytest.mark.reliability(
    "bad input",
    "a vocabulary of 3,000 tokens of every length up to 3,000 ('a' * k: quadratic merges)",
    tries=1,
    outcome="TokenizerError naming the work bound and the longest token, at once",
)
def test_a_vocabulary_built_for_quadratic_merges_is_refused() -> None:
    """Tokens of every length 1..3000 would need ~9e9 characters examined: Hugging Face's build
    refuses with a message naming the bound and the longest token, instead of stalling; the
    served (llama.cpp) tokenizer extracts no merges and encodes at once."""
    md = spm_md()
    extra = ["a" * k for k in range(2, 3001)]
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], *extra]
    md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"], *[int(N)] * len(extra)]
    md["tokenizer.ggml.scores"] = [*md["tokenizer.ggml.scores"], *[-40.0] * len(extra)]
    with pytest.raises(TokenizerError, match="would examine more than") as raised:
        GgufTokenizer(Vocabulary.from_metadata(md), hf=True)
    assert "3,000 characters" in str(raised.value)
    served = GgufTokenizer(Vocabulary.from_metadata(md))
    assert served.decode(served.encode("a" * 5000)) == "a" * 5000


SPM_TEXTS = [
    "the cat",
    "  the  cat  ",
    "<s>the</s>cat",
    "<|turn|>the cat<|turn|> cat",
    "the\n\ncat\n\n",
    "ça 🤖 c",
    "<0x41> catcat",
    "",
    " ",
]


@pytest.mark.parametrize("prefix", [True, False], ids=["space-prefix", "no-prefix"])
@pytest.mark.parametrize("special", [False, True], ids=["plain", "parse-special"])
def test_the_served_spm_tokenizer_is_the_previous_one(prefix: bool, special: bool) -> None:
    """llama.cpp's algorithm (served) and Hugging Face's BPE over the extracted merges (served
    before) give the same ids and texts: a space prefix after every special piece or none,
    user-defined and control tokens in text, byte fallback, runs of spaces."""
    vocab = Vocabulary.from_metadata(spm_md(**{"tokenizer.ggml.add_space_prefix": prefix}))
    served, before = GgufTokenizer(vocab), GgufTokenizer(vocab, hf=True)
    for text in SPM_TEXTS:
        ids = served.encode(text, parse_special=special)
        assert ids == before.encode(text, parse_special=special), text
        for skip in (True, False):
            assert served.decode(ids, skip_special=skip) == before.decode(ids, skip_special=skip)


# -- the tokenizer cache (tokenizer_cache.py) ---------------------------------------------------


def write_vocabulary(path: Path, md: dict[str, Any]) -> Path:
    """A GGUF file holding only ``md`` (tokenizer metadata), as the project's writer encodes it."""
    from gguf import GGUFValueType as V

    from ggufswap.shards._gguf_encode import TypedValue, encode_metadata, write_gguf

    def typed(value: Any) -> TypedValue:
        if isinstance(value, bool):
            return TypedValue(V.BOOL, value)
        if isinstance(value, int):
            return TypedValue(V.UINT32, value)
        if isinstance(value, str):
            return TypedValue(V.STRING, value)
        first = value[0]
        sub = (
            V.STRING
            if isinstance(first, str)
            else V.FLOAT32
            if isinstance(first, float)
            else V.INT32
        )
        return TypedValue(V.ARRAY, list(value), sub)

    kv = [(key, typed(value)) for key, value in md.items()]
    write_gguf(path, n_kv=len(kv), kv_bytes=encode_metadata(kv), tensors=[])
    return path


TEXTS = ["the cat", "hello world", "naïve 🤖 <|turn|> 123\n\n", ""]


def cached_load(path: Path, cache: Path) -> tuple[GgufTokenizer, list[dict[str, Any]]]:
    """``from_file`` with the cache, and what it logged."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        tok = GgufTokenizer.from_file(path, cache=cache)
    return tok, logs


def hit(logs: list[dict[str, Any]]) -> bool:
    (event,) = [e for e in logs if e["event"] == "tokenizer.cache"]
    return bool(event["hit"])


def test_a_built_tokenizer_is_cached_and_loaded_back(tmp_path: Path) -> None:
    """The first load of a BPE vocabulary builds and writes one entry (merges as "left right");
    the next loads it (a hit) and encodes and decodes every text as a fresh build does, special
    tokens included."""
    import json

    from ggufswap.runtime.serving.tokenizer_cache import MAGIC

    path = write_vocabulary(tmp_path / "v.gguf", bpe_md())
    fresh = GgufTokenizer.from_file(path)
    first, logs = cached_load(path, tmp_path / "cache")
    assert not hit(logs)
    (entry,) = (tmp_path / "cache").iterdir()
    assert entry.suffix == ".tokenizer"
    body = json.loads(entry.read_bytes()[len(MAGIC) + 32 + 16 :])
    assert all(isinstance(m, str) and " " in m for m in body["model"]["merges"])  # "left right"
    again, logs = cached_load(path, tmp_path / "cache")
    assert hit(logs)
    for tok in (first, again):
        for text in TEXTS:
            for special in (False, True):
                ids = fresh.encode(text, parse_special=special)
                assert tok.encode(text, parse_special=special) == ids, text
                assert tok.decode(ids) == fresh.decode(ids)
        assert [tok.token(i) for i in range(tok.n_vocab)] == list(fresh.vocab.tokens)


def test_an_spm_vocabulary_is_not_cached(tmp_path: Path) -> None:
    """A SentencePiece vocabulary builds in one pass (llama.cpp's algorithm needs no merge
    table): nothing is written to the cache and nothing is looked up there."""
    path = write_vocabulary(tmp_path / "v.gguf", spm_md())
    tok, logs = cached_load(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    assert "tokenizer.cache" not in [e["event"] for e in logs]
    assert [tok.token(i) for i in tok.encode("the cat")] == ["<s>", f"{SPACE}the", f"{SPACE}cat"]


def _damage(entry: Path, other: Path, how: str) -> None:
    data = entry.read_bytes()
    if how == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        entry.write_bytes(b"")
    elif how == "flipped byte":
        entry.write_bytes(data[:-10] + bytes([data[-10] ^ 0x20]) + data[-9:])
    elif how == "another key's entry":
        entry.write_bytes(other.read_bytes())
    elif how == "refused by tokenizers":  # framing and checksum right, the JSON not a tokenizer
        import xxhash

        from ggufswap.runtime.serving.tokenizer_cache import MAGIC

        body = b'{"version": "1.0", "model": 7}'
        key = entry.name.removesuffix(".tokenizer").encode()
        entry.write_bytes(MAGIC + key + xxhash.xxh3_128_digest(body) + body)


@pytest.mark.parametrize(
    "how",
    ["truncated", "empty", "flipped byte", "another key's entry", "refused by tokenizers"],
)
def test_a_damaged_or_stale_entry_is_rebuilt_never_trusted(tmp_path: Path, how: str) -> None:
    """An entry cut short, empty, with a flipped byte, holding another vocabulary's tokenizer,
    or refused by tokenizers is logged and rebuilt; the rebuilt entry is a hit next time."""
    cache = tmp_path / "cache"
    renamed = bpe_md()  # as many tokens: only the key tells the entries apart
    renamed["tokenizer.ggml.tokens"][-1] = "<|end|>"
    other = write_vocabulary(tmp_path / "other.gguf", renamed)
    cached_load(other, cache)
    path = write_vocabulary(tmp_path / "v.gguf", bpe_md())
    _, logs = cached_load(path, cache)
    (key,) = [e["key"] for e in logs if e["event"] == "tokenizer.cache"]
    entry = cache / f"{key}.tokenizer"
    (other_entry,) = set(cache.iterdir()) - {entry}
    _damage(entry, other_entry, how)
    tok, logs = cached_load(path, cache)
    assert not hit(logs)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "tokenizer.cache_bad_entry"
    ]
    assert [tok.token(i) for i in tok.encode("hello world")] == ["hello", "Ġworld"]
    _, logs = cached_load(path, cache)
    assert hit(logs)


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer.ggml.tokens": 270, "value": f"{SPACE}dog"},
        {"tokenizer.ggml.scores": 270, "value": -0.5},
        {"tokenizer.ggml.token_type": 270, "value": int(U)},
        {"tokenizer.ggml.add_space_prefix": False},
        {"tokenizer.ggml.unknown_token_id": 3},
    ],
    ids=["a token", "a score", "a type", "a setting", "the unknown id"],
)
def test_the_cache_key_follows_the_vocabulary(tmp_path: Path, change: dict[str, Any]) -> None:
    """Another token, score, type or setting gives another key; the same vocabulary in another
    file (other metadata beside it) gives the same key."""
    from ggufswap.runtime.serving.tokenizer import BUILD_VERSION, read_vocabulary
    from ggufswap.runtime.serving.tokenizer_cache import vocabulary_key
    from ggufswap.shards import read_header

    def key(md: dict[str, Any], name: str) -> str:
        header = read_header(write_vocabulary(tmp_path / name, md))
        return vocabulary_key(header.metadata, read_vocabulary(header)[1], build=BUILD_VERSION)

    base = key(spm_md(), "base.gguf")
    assert key({"general.name": "another model", **spm_md()}, "same.gguf") == base
    md = spm_md()
    value = change.pop("value", None)
    ((name, where),) = change.items()
    if value is None:
        md[name] = where
    else:
        md[name] = [*md[name][:where], value, *md[name][where + 1 :]]
    assert key(md, "changed.gguf") != base


def test_a_cache_that_cannot_be_written_only_costs_the_build(tmp_path: Path) -> None:
    """A cache path that is a file: the tokenizer still builds, and the failure is logged."""
    path = write_vocabulary(tmp_path / "v.gguf", bpe_md())
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    tok, logs = cached_load(path, blocked)
    assert "tokenizer.cache_not_written" in [e["event"] for e in logs]
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_merges_holding_a_space_are_cached_as_pairs(tmp_path: Path) -> None:
    """A merge whose halves hold a space (Hugging Face's build of an SPM vocabulary) cannot be
    written "left right": the entry keeps the pairs, and loads back to the same encodings."""
    import json

    from ggufswap.runtime.serving.tokenizer_cache import load, serialized, store

    md = spm_md(**{"tokenizer.ggml.add_space_prefix": False})
    for piece in ("x", " ", "x "):
        md["tokenizer.ggml.tokens"].append(piece)
        md["tokenizer.ggml.token_type"].append(int(N))
        md["tokenizer.ggml.scores"].append(-1.0)
    vocab = Vocabulary.from_metadata(md)
    fresh = GgufTokenizer(vocab, hf=True)
    assert fresh._tok is not None
    assert ["x", " "] in json.loads(serialized(fresh._tok))["model"]["merges"]
    store(tmp_path, "k" * 32, fresh._tok)
    again = GgufTokenizer(vocab, built=load(tmp_path, "k" * 32, n_vocab=len(vocab.tokens)))
    assert again._tok is not None, "the entry loads"
    assert again.encode("x x", add_bos=False) == fresh.encode("x x", add_bos=False)


def test_a_header_read_before_gives_the_same_tokenizer_or_refuses_a_replaced_file(
    tmp_path: Path,
) -> None:
    """from_header (the daemon's: the loaded set's first header) builds what from_file builds,
    and refuses a file replaced since the header was read rather than mix two vocabularies."""
    from ggufswap.shards import FileChangedError, read_header

    path = write_vocabulary(tmp_path / "v.gguf", spm_md())
    header = read_header(path)
    tok = GgufTokenizer.from_header(header, cache=tmp_path / "cache")
    assert tok.encode("the cat") == GgufTokenizer.from_file(path).encode("the cat")
    write_vocabulary(tmp_path / "new.gguf", long_token_md(10)).replace(path)
    with pytest.raises(FileChangedError):
        GgufTokenizer.from_header(header, cache=tmp_path / "cache")
