"""Tokenizers built from a GGUF file's own metadata, on Hugging Face's ``tokenizers`` library.

Two ``tokenizer.ggml.model`` kinds are supported:

- ``llama`` (SentencePiece BPE): llama.cpp merges the adjacent pair whose concatenation is the
  highest-scoring token, repeatedly. That is BPE whose merges are every ``(left, right)`` split of
  a normal token into two vocabulary tokens, ranked by the merged token's score (the same
  extraction ``transformers`` uses to convert SentencePiece models). Spaces become ``▁``, a ``▁``
  is prepended when ``tokenizer.ggml.add_space_prefix`` is true (the default), and characters
  without a token fall back to the ``<0xXX>`` byte tokens.
- ``gpt2`` (byte-level BPE): ``tokenizer.ggml.merges`` as given, with the pre-tokenizer regex
  that ``tokenizer.ggml.pre`` names.

Control tokens are special (matched in text only with ``parse_special=True``); user-defined tokens
are always matched whole, as llama.cpp does. ``tokenizer.ggml.add_bos_token`` /
``add_eos_token`` decide what ``encode`` adds by default.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ggufswap.logs import get_logger
from ggufswap.runtime.serving import tokenizer_cache
from ggufswap.runtime.serving.errors import TokenizerError
from ggufswap.shards import read_header
from ggufswap.shards.arrays import StringArray, scalars
from ggufswap.shards.keys import Keys
from ggufswap.shards.reader import ShardHeader, read_array_bytes
from ggufswap.shards.records import ArrayRef
from ggufswap.shards.value_types import GGUFValueType

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = get_logger(__name__)

# The version of what build() makes of a vocabulary: part of the cache key
# (tokenizer_cache.py), so bump it whenever build() would give another tokenizer for the same
# file (a normalizer, decoder, merge order or added-token rule changed).
BUILD_VERSION: Final = 1


class TokenizerKind(str, enum.Enum):
    """``tokenizer.ggml.model`` values this module builds."""

    SPM = "llama"
    BPE = "gpt2"


class TokenType(enum.IntEnum):
    """llama.cpp's ``LLAMA_TOKEN_TYPE_*`` (``tokenizer.ggml.token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


SPACE: Final = "\u2581"  # SentencePiece's visible space
_GPT2_SPLIT: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the pre-tokenizer split regex (llama.cpp's llama-vocab.cpp).
BPE_PRE_SPLITS: Final[Mapping[str, str]] = {
    "default": _GPT2_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


@dataclass(frozen=True)
class Vocabulary:
    """The tokenizer metadata of one GGUF file, decoded."""

    kind: TokenizerKind
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float] | None = None
    merges: Sequence[str] | None = None
    pre: str = "default"
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], array: Callable[[str], Sequence[Any]] | None = None
    ) -> Vocabulary:
        """Read ``tokenizer.ggml.*``; ``array(key)`` decodes arrays left on disk (read_array).

        Size: being reworked by issue 29; split there.
        """
        k = Keys.Tokenizer

        def arr(key: str) -> Sequence[Any] | None:
            if key not in md:
                return None
            value = md[key]
            if isinstance(value, list | tuple):
                return list(value)
            if array is None:
                raise TokenizerError(f"{key}: array left on disk and no reader given")
            return array(key)

        kind_name = md.get(k.MODEL)
        try:
            kind = TokenizerKind(str(kind_name))
        except ValueError:
            supported = ", ".join(repr(t.value) for t in TokenizerKind)
            raise TokenizerError(
                f"{k.MODEL} = {kind_name!r} is not supported; supported: {supported}"
            ) from None
        tokens, types = arr(k.TOKENS), arr(k.TOKEN_TYPE)
        scores, merges = arr(k.SCORES), arr(k.MERGES)
        problems = []
        if tokens is None:
            problems.append(f"missing {k.TOKENS!r}")
        n = len(tokens or ())
        if types is None:
            types = [TokenType.NORMAL] * n
        for key, values in ((k.TOKEN_TYPE, types), (k.SCORES, scores)):
            if values is not None and len(values) != n:
                problems.append(f"{key} has {len(values)} entries, {k.TOKENS} has {n}")
        if kind is TokenizerKind.SPM and scores is None:
            problems.append(f"a {kind.value!r} tokenizer needs {k.SCORES!r}")
        if kind is TokenizerKind.BPE and merges is None:
            problems.append(f"a {kind.value!r} tokenizer needs {k.MERGES!r}")
        pre = str(md.get(k.PRE, "default"))
        if kind is TokenizerKind.BPE and pre not in BPE_PRE_SPLITS:
            problems.append(f"{k.PRE} = {pre!r} is not supported; known: {sorted(BPE_PRE_SPLITS)}")
        ids = {key: md.get(key) for key in (k.BOS_ID, k.EOS_ID, k.UNK_ID)}
        for key, value in ids.items():
            if value is not None and not 0 <= int(value) < n:
                problems.append(f"{key} = {value} is outside the vocabulary (0..{n - 1})")
        if problems:
            raise TokenizerError("cannot build the tokenizer:\n  " + "\n  ".join(problems))

        def opt(key: str) -> int | None:
            value = ids[key]
            return None if value is None else int(value)

        return cls(
            kind=kind,
            tokens=tokens or [],
            token_types=[int(t) for t in types],
            scores=None if scores is None else [float(s) for s in scores],
            merges=merges,
            pre=pre,
            bos_id=opt(k.BOS_ID),
            eos_id=opt(k.EOS_ID),
            unk_id=opt(k.UNK_ID),
            add_bos=bool(md.get(k.ADD_BOS, kind is TokenizerKind.SPM)),
            add_eos=bool(md.get(k.ADD_EOS, False)),
            add_space_prefix=bool(md.get(k.ADD_SPACE_PREFIX, kind is TokenizerKind.SPM)),
        )


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


def read_vocabulary(header: ShardHeader) -> tuple[Vocabulary, dict[str, bytes]]:
    """The vocabulary of a file's header, and the stored bytes of its arrays by key (what
    :func:`tokenizer_cache.vocabulary_key` hashes). Strings are decoded when looked up
    (:class:`StringArray`), so a tokenizer loaded from the cache decodes none of them."""
    md = header.metadata
    stored = {
        key: read_array_bytes(header, key)
        for key, value in md.items()
        if key.startswith(tokenizer_cache.KEY_PREFIX) and isinstance(value, ArrayRef)
    }

    def array(key: str) -> Sequence[Any]:
        ref = md[key]
        assert isinstance(ref, ArrayRef), "inline arrays are tuples (from_metadata takes those)"
        if ref.elem_type == GGUFValueType.STRING:
            return StringArray(stored[key], ref.count)
        return scalars(ref.elem_type, stored[key])

    return Vocabulary.from_metadata(md, array), stored


class GgufTokenizer:
    """Text <-> token ids for one GGUF vocabulary."""

    def __init__(self, vocab: Vocabulary, *, built: Tokenizer | None = None) -> None:
        """``built``: the Hugging Face tokenizer of ``vocab`` when one was cached (else built)."""
        self.vocab = vocab
        self._tok = build(vocab) if built is None else built

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
        if cache is None:
            return cls(vocab)
        key = tokenizer_cache.vocabulary_key(header.metadata, stored, build=BUILD_VERSION)
        built = tokenizer_cache.load(cache, key, n_vocab=len(vocab.tokens))
        log.info("tokenizer.cache", path=header.path, key=key, hit=built is not None)
        tokenizer = cls(vocab, built=built)
        if built is None:
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
        self._tok.encode_special_tokens = not parse_special
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.vocab.add_bos if add_bos is None else add_bos
        eos = self.vocab.add_eos if add_eos is None else add_eos
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """The text of ``ids``; control tokens are left out unless ``skip_special=False``."""
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
        token = self.vocab.tokens[token_id]
        kind = self.vocab.token_types[token_id]
        if kind == TokenType.BYTE and len(token) == 6 and token.startswith("<0x"):
            return bytes([int(token[3:5], 16)])
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN) or self.vocab.kind is TokenizerKind.SPM:
            return token.replace(SPACE, " ").encode()
        table = _byte_decoder()
        return bytes(table.get(ch, ord(" ")) for ch in token)

    def token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` (``▁``-spaced for SPM, byte-level for BPE)."""
        return self.vocab.tokens[token_id]

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
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
