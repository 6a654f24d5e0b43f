"""The tokenizer metadata of a GGUF file (``tokenizer.ggml.*``), decoded and checked: what both
tokenizers (``spm.py``'s for SentencePiece vocabularies, Hugging Face's for byte-level BPE) are
built from."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ggufswap.runtime.serving import tokenizer_cache
from ggufswap.runtime.serving.errors import TokenizerError
from ggufswap.shards.arrays import StringArray, scalars
from ggufswap.shards.keys import Keys
from ggufswap.shards.reader import ShardHeader, read_array_bytes
from ggufswap.shards.records import ArrayRef
from ggufswap.shards.value_types import GGUFValueType


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
            token_types=list(map(int, types)),
            scores=None if scores is None else list(map(float, scores)),
            merges=merges,
            pre=pre,
            bos_id=opt(k.BOS_ID),
            eos_id=opt(k.EOS_ID),
            unk_id=opt(k.UNK_ID),
            add_bos=bool(md.get(k.ADD_BOS, kind is TokenizerKind.SPM)),
            add_eos=bool(md.get(k.ADD_EOS, False)),
            add_space_prefix=bool(md.get(k.ADD_SPACE_PREFIX, kind is TokenizerKind.SPM)),
        )


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
