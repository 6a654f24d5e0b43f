"""Tokenizers built from a GGUF file's own metadata.

Two ``tokenizer.ggml.model`` kinds are supported:

- ``llama`` (SentencePiece): llama.cpp's own algorithm (``spm.py``): the adjacent pair whose
  concatenation is the highest-scoring token is merged, repeatedly; spaces become ``▁``, a ``▁`` is
  prepended when ``tokenizer.ggml.add_space_prefix`` is true (the default), and characters without
  a token fall back to the ``<0xXX>`` byte tokens. It builds in one pass over the vocabulary.
  :func:`build` can still make the Hugging Face equivalent (BPE whose merges are every split of a
  normal token into two vocabulary tokens, ranked by the merged token's score: the extraction
  ``transformers`` uses): the tokenizer served before, which the tests compare with.
- ``gpt2`` (byte-level BPE): Hugging Face's ``tokenizers`` over ``tokenizer.ggml.merges`` as
  given, with the pre-tokenizer regex that ``tokenizer.ggml.pre`` names; built once per vocabulary
  and cached (``tokenizer_cache.py``).

Control tokens are special (matched in text only with ``parse_special=True``); user-defined tokens
are always matched whole, as llama.cpp does. ``tokenizer.ggml.add_bos_token`` /
``add_eos_token`` decide what ``encode`` adds by default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ggufswap.logs import get_logger
from ggufswap.runtime.serving import tokenizer_cache
from ggufswap.runtime.serving.errors import TokenizerError
from ggufswap.runtime.serving.spm import SpmTokenizer
from ggufswap.runtime.serving.vocabulary import (
    BPE_PRE_SPLITS,
    SPACE,
    TokenizerKind,
    TokenType,
    Vocabulary,
    read_vocabulary,
)
from ggufswap.shards import read_header
from ggufswap.shards.keys import Keys

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ggufswap.shards.reader import ShardHeader

__all__ = [
    "BUILD_VERSION",
    "SPACE",
    "GgufTokenizer",
    "TokenType",
    "TokenizerKind",
    "Vocabulary",
    "build",
    "read_vocabulary",
    "spm_merge_ids",
    "spm_merges",
]

log = get_logger(__name__)

# The version of what build() makes of a vocabulary: part of the cache key
# (tokenizer_cache.py), so bump it whenever build() would give another tokenizer for the same
# file (a normalizer, decoder, merge order or added-token rule changed).
BUILD_VERSION: Final = 1


# The merge extraction examines, for each normal token, only the cuts whose two halves have
# lengths that vocabulary tokens have, at a cost of the token's length each; this many such
# characters per character of the vocabulary (plus a constant) is the most it will do, known
# before it starts. Real vocabularies stay under it (Gemma 3's 262k tokens: about 8 per
# character); a vocabulary built to make the extraction quadratic is refused at once rather
# than stalling every start.
MERGE_WORK_PER_CHAR: Final = 24
MERGE_WORK_FLOOR: Final = 1 << 22


def spm_merges(vocab: Vocabulary) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary tokens, best merged score first."""
    tokens = vocab.tokens
    return [(tokens[a], tokens[b]) for a, b in spm_merge_ids(vocab)]


def spm_merge_ids(vocab: Vocabulary) -> list[tuple[int, int]]:
    """:func:`spm_merges` as token id pairs.

    Linear in the vocabulary's characters: tokens are taken by length, and a cut is tried only
    where both halves have a length some token has, for every token of that length at once (the
    slicing and look-ups run in C, ``map`` over a list). The work is bounded
    (:data:`MERGE_WORK_PER_CHAR`); a vocabulary past the bound raises :class:`TokenizerError`.
    """
    assert vocab.scores is not None, "SPM vocabularies carry scores (checked when read)"
    tokens, types, scores = vocab.tokens, vocab.token_types, vocab.scores
    index = {tok: i for i, tok in enumerate(tokens)}
    present = {len(t) for t in tokens}
    by_length: dict[int, list[int]] = {}
    for i, piece in enumerate(tokens):
        if types[i] == TokenType.NORMAL and len(piece) >= 2:
            by_length.setdefault(len(piece), []).append(i)
    budget = MERGE_WORK_PER_CHAR * sum(len(t) for t in tokens) + MERGE_WORK_FLOOR
    cuts: dict[int, list[int]] = {}
    work = 0
    for n, ids in sorted(by_length.items()):  # the work is known before any is done
        cuts[n] = [c for c in sorted(present) if c < n and n - c in present]
        work += n * len(ids) * len(cuts[n])
        if work > budget:
            raise _too_much_work(tokens, present, budget)
    ranked: list[tuple[float, int, int]] = []
    for n, ids in sorted(by_length.items()):
        pieces = [tokens[i] for i in ids]
        for cut in cuts[n]:
            lefts = list(map(index.get, [p[:cut] for p in pieces]))
            found = [k for k, a in enumerate(lefts) if a is not None]
            rights = list(map(index.get, [pieces[k][cut:] for k in found]))
            ranked.extend(
                (-scores[ids[k]], lefts[k], b)  # type: ignore[misc]
                for k, b in zip(found, rights, strict=True)
                if b is not None
            )
    ranked.sort()
    return [(a, b) for _, a, b in ranked]


def _too_much_work(tokens: Sequence[str], present: set[int], budget: int) -> TokenizerError:
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]))
    return TokenizerError(
        f"{Keys.Tokenizer.TOKENS}: extracting the merges would examine more than {budget:,} "
        f"characters ({MERGE_WORK_PER_CHAR} per character of the vocabulary); the vocabulary "
        f"has {len(present):,} distinct token lengths up to {len(tokens[longest]):,} characters "
        f"(token {longest}): it is not a real SentencePiece vocabulary; fix the file's "
        f"{Keys.Tokenizer.TOKENS}"
    )


def build(vocab: Vocabulary) -> Tokenizer:
    """The Hugging Face tokenizer of ``vocab`` (seconds for a 262k-token vocabulary: the cache
    keeps the result; :data:`BUILD_VERSION` names what this function makes)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    if not isinstance(vocab.tokens, list):  # looked up by index many times below
        vocab = dataclasses.replace(vocab, tokens=list(vocab.tokens))
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    unk = None if vocab.unk_id is None else vocab.tokens[vocab.unk_id]
    if vocab.kind is TokenizerKind.SPM:
        model = models.BPE(ids, spm_merges(vocab), unk_token=unk, byte_fallback=True, fuse_unk=True)
        tok = Tokenizer(model)
        steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
        if vocab.add_space_prefix:
            steps.insert(0, normalizers.Prepend(SPACE))
        tok.normalizer = normalizers.Sequence(steps)
        dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if vocab.add_space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
    else:
        assert vocab.merges is not None, "BPE vocabularies carry merges (checked when read)"
        pairs = [tuple(m.split(" ", 1)) for m in vocab.merges]
        tok = Tokenizer(models.BPE(ids, pairs, unk_token=unk))  # type: ignore[arg-type]
        tok.pre_tokenizer = pre.Sequence(
            [
                pre.Split(Regex(BPE_PRE_SPLITS[vocab.pre]), behavior="isolated"),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
    special = {TokenType.CONTROL, TokenType.UNKNOWN}
    added = [
        AddedToken(t, special=ty in special, normalized=False)
        for t, ty in zip(vocab.tokens, vocab.token_types, strict=True)
        if ty in special or ty == TokenType.USER_DEFINED
    ]
    tok.add_tokens(added)
    return tok


class GgufTokenizer:
    """Text <-> token ids for one GGUF vocabulary."""

    def __init__(
        self, vocab: Vocabulary, *, built: Tokenizer | None = None, hf: bool = False
    ) -> None:
        """``built``: the Hugging Face tokenizer of a BPE ``vocab`` when one was cached (else
        built). ``hf``: Hugging Face's tokenizer for an SPM vocabulary too (the reference the tests
        compare llama.cpp's algorithm with)."""
        self.vocab = vocab
        self._spm: SpmTokenizer | None = None
        self._tok: Tokenizer | None = built
        if vocab.kind is TokenizerKind.SPM and not hf and built is None:
            self._spm = SpmTokenizer(vocab)
        elif built is None:
            self._tok = build(vocab)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, cache: Path | None = None) -> GgufTokenizer:
        """The tokenizer of a GGUF file (the first shard of a split model holds it).

        ``cache``: a directory that keeps built tokenizers by vocabulary
        (:func:`tokenizer_cache.cache_dir` in the daemon; None builds every time).
        """
        return cls.from_header(read_header(path), cache=cache)

    @classmethod
    def from_header(cls, header: ShardHeader, *, cache: Path | None = None) -> GgufTokenizer:
        """:meth:`from_file` of a header already read (the loaded shard set's first); the
        vocabulary's arrays are read from the file it describes, refused if it changed since."""
        vocab, stored = read_vocabulary(header)
        if cache is None or vocab.kind is TokenizerKind.SPM:  # SPM: nothing worth caching
            return cls(vocab)
        key = tokenizer_cache.vocabulary_key(header.metadata, stored, build=BUILD_VERSION)
        built = tokenizer_cache.load(cache, key, n_vocab=len(vocab.tokens))
        log.info("tokenizer.cache", path=header.path, key=key, hit=built is not None)
        tokenizer = cls(vocab, built=built)
        if built is None:
            assert tokenizer._tok is not None, "a BPE vocabulary is built by Hugging Face"
            tokenizer_cache.store(cache, key, tokenizer._tok)
        return tokenizer

    @property
    def n_vocab(self) -> int:
        return len(self.vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    def encode(
        self,
        text: str,
        *,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        parse_special: bool = False,
    ) -> list[int]:
        """Token ids of ``text``; BOS/EOS as the file says unless given; control tokens written in
        the text are tokens only with ``parse_special``."""
        ids: list[int]
        if self._spm is not None:
            ids = self._spm.encode(text, parse_special=parse_special)
        else:
            assert self._tok is not None, "one of the two is built"
            self._tok.encode_special_tokens = not parse_special
            ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.vocab.add_bos if add_bos is None else add_bos
        eos = self.vocab.add_eos if add_eos is None else add_eos
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """The text of ``ids``; control tokens are left out unless ``skip_special=False``."""
        if self._spm is not None:
            return self._spm.decode(ids, skip_special=skip_special)
        assert self._tok is not None, "one of the two is built"
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special)
        return text

    def trailing_byte_tokens(self, ids: Sequence[int]) -> int:
        """How many of the last ``ids`` are byte-fallback tokens (``<0xXX>``). They decode as one
        group, and a group that is not valid UTF-8 becomes U+FFFD for *every* byte, so their
        text (even an ASCII byte's) may still change when the next token arrives."""
        types = self.vocab.token_types
        run = 0
        for token_id in reversed(ids):
            if not 0 <= token_id < len(types) or types[token_id] != TokenType.BYTE:
                break
            run += 1
        return run

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for in text (a response's logprobs show them): a byte
        token's byte, an SPM piece with ``▁`` as a space, a byte-level BPE piece decoded;
        control tokens as written."""
        token = self._tokens()[token_id]
        kind = self.vocab.token_types[token_id]
        if kind == TokenType.BYTE and len(token) == 6 and token.startswith("<0x"):
            return bytes([int(token[3:5], 16)])
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN) or self.vocab.kind is TokenizerKind.SPM:
            return token.replace(SPACE, " ").encode()
        table = _byte_decoder()
        return bytes(table.get(ch, ord(" ")) for ch in token)

    def token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` (``▁``-spaced for SPM, byte-level for BPE)."""
        return self._tokens()[token_id]

    def _tokens(self) -> Sequence[str]:
        """The vocabulary's strings: the SPM tokenizer's, decoded when it was built, else the
        file's (a first look-up there walks the whole array: ~0.07 s for Gemma's 262k)."""
        return self._spm.tokens if self._spm is not None else self.vocab.tokens

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        if self._spm is not None:
            return self._spm.token_id(token)
        assert self._tok is not None, "one of the two is built"
        found: int | None = self._tok.token_to_id(token)
        return found


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of its ``bytes_to_unicode``)."""
    if not _BYTE_DECODER:
        kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
        shifted = 0
        for byte in range(256):
            if byte in kept:
                _BYTE_DECODER[chr(byte)] = byte
            else:
                _BYTE_DECODER[chr(256 + shifted)] = byte
                shifted += 1
    return _BYTE_DECODER
