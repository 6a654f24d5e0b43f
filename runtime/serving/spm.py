"""llama.cpp's SentencePiece tokenizer (``tokenizer.ggml.model = llama``: Gemma, Llama 2,
Mistral), written after ``llm_tokenizer_spm_session`` and ``tokenizer_st_partition`` in its
``src/llama-vocab.cpp``.

Encoding:

1. **Special pieces first.** User-defined tokens are split out of the text always, control and
   unknown tokens only with ``parse_special``: longest text first (ties by id), every occurrence,
   left to right, each a token of its own (``tokenizer_st_partition``).
2. **Each remaining fragment** gets a leading space when ``add_space_prefix`` is set and what came
   before it was a special piece (or nothing), spaces become ``▁``, and it is split into one
   symbol per character.
3. **Merges.** Every adjacent pair whose concatenation is a vocabulary token (of any type) is a
   candidate; the candidate whose token has the highest score is merged first (ties: the leftmost),
   and the new symbol's pairs with its neighbours become candidates, until none is left.
4. **Byte fallback.** A final symbol that is no token becomes the ``<0xNN>`` tokens of its UTF-8
   bytes (else the byte's own one-character token, else the unknown token).

Decoding is llama.cpp's ``token_to_piece`` with Hugging Face's byte grouping (the previous
tokenizer's): ``▁`` becomes a space, byte tokens are grouped and decoded as UTF-8 (a group that is
not valid UTF-8 gives U+FFFD per byte), control and unknown tokens are left out unless asked for,
unused tokens give nothing, and one leading space is removed when ``add_space_prefix`` is set.

Building is a dictionary over the vocabulary's strings (no merge table: the merges are found
while encoding), so a start costs one pass over the vocabulary. Not carried over from llama.cpp:
its per-model left/right-strip attributes of special tokens (set by model name for Phi-3, jina and
ModernBERT vocabularies).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from ggufswap.runtime.serving.errors import TokenizerError
from ggufswap.runtime.serving.vocabulary import SPACE, TokenType
from ggufswap.shards.arrays import StringArray

if TYPE_CHECKING:
    from ggufswap.runtime.serving.vocabulary import Vocabulary

_END: Final = ""  # the key of a trie node that holds the id of the special text ending there
# A trie: character -> node, and _END -> token id.
Trie = dict[str, "Trie | int"]


class SpmTokenizer:
    """Text <-> token ids for one SentencePiece vocabulary, as llama.cpp computes them."""

    def __init__(self, vocab: Vocabulary) -> None:
        assert vocab.scores is not None, "SPM vocabularies carry scores (checked when read)"
        # llama.cpp's token_to_id: a text held by two tokens maps to the later one.
        tokens = vocab.tokens
        if isinstance(tokens, StringArray):  # decoded and indexed in one pass
            self._tokens, self._ids = tokens.with_index()
        else:
            self._tokens = list(tokens)
            self._ids = dict(zip(self._tokens, range(len(self._tokens)), strict=True))
        self._types = vocab.token_types
        self._scores = vocab.scores
        self._add_space_prefix = vocab.add_space_prefix
        self._unk_id = vocab.unk_id
        special = {TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED}
        self._trie: Trie = {}
        for token_id in [i for i, kind in enumerate(self._types) if kind in special]:
            if self._tokens[token_id]:
                _insert(self._trie, self._tokens[token_id], token_id)

    @property
    def tokens(self) -> Sequence[str]:
        """The vocabulary's strings, decoded."""
        return self._tokens

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._ids.get(token)

    def encode(self, text: str, *, parse_special: bool) -> list[int]:
        """The ids of ``text`` (no BOS/EOS: the caller adds them)."""
        ids: list[int] = []
        after_special = True  # the text's start counts as following a special piece
        for fragment in self._partition(text, parse_special=parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
                continue
            prefix = " " if self._add_space_prefix and after_special else ""
            ids += self._merge((prefix + fragment).replace(" ", SPACE))
            after_special = False
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool) -> str:
        """The text of ``ids`` (see the module docstring)."""
        tokens, types = self._tokens, self._types
        parts: list[str] = []
        pending = bytearray()
        for token_id in ids:
            kind = types[token_id]
            if kind in (TokenType.CONTROL, TokenType.UNKNOWN) and skip_special:
                continue
            if kind == TokenType.BYTE:
                pending.append(_byte_of(tokens[token_id]))
                continue
            if pending:
                parts.append(_decode_bytes(pending))
                pending.clear()
            if kind == TokenType.NORMAL:
                parts.append(tokens[token_id].replace(SPACE, " "))
            elif kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
                parts.append(tokens[token_id])
        if pending:
            parts.append(_decode_bytes(pending))
        text = "".join(parts)
        if self._add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def _partition(self, text: str, *, parse_special: bool) -> list[str | int]:
        """``text`` split into raw fragments and the ids of the special pieces in it, as
        llama.cpp's ``tokenizer_st_partition`` splits it (empty fragments dropped)."""
        fragments: list[str | int] = [text] if text else []
        for token_id in self._specials_in(text, parse_special=parse_special):
            piece = self._tokens[token_id]
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or piece not in fragment:
                    split.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(piece)):
                    if k:
                        split.append(token_id)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _specials_in(self, text: str, *, parse_special: bool) -> list[int]:
        """The special tokens whose text occurs in ``text``, longest first (ties by id): a walk
        of the specials' trie from every position (a few steps where a special could start)."""
        found: set[int] = set()
        root, n = self._trie, len(text)
        for start in range(n):
            node = root.get(text[start])
            end = start + 1
            while isinstance(node, dict):
                token_id = node.get(_END)
                if isinstance(token_id, int):
                    found.add(token_id)
                if end == n:
                    break
                node = node.get(text[end])
                end += 1
        if not parse_special:
            found = {t for t in found if self._types[t] == TokenType.USER_DEFINED}
        return sorted(found, key=lambda t: (-len(self._tokens[t]), t))

    def _merge(self, text: str) -> list[int]:
        """One fragment's ids: llama.cpp's bigram merges over its characters, then byte fallback
        (see the module docstring). Linear in the fragment, times the heap's log.

        Size: the merge loop reads best whole (it is llama.cpp's ``tokenize`` step by step).
        """
        ids, scores = self._ids, self._scores
        symbols = list(text)  # a merged-away symbol becomes ""
        n = len(symbols)
        after = [*range(1, n), -1]
        before = list(range(-1, n - 1))
        # (-score, left, right, length): the best score first, then the leftmost
        queue: list[tuple[float, int, int, int]] = []

        def candidate(left: int, right: int) -> None:
            token_id = ids.get(symbols[left] + symbols[right])
            if token_id is not None:
                size = len(symbols[left]) + len(symbols[right])
                heapq.heappush(queue, (-scores[token_id], left, right, size))

        for left in range(n - 1):
            candidate(left, left + 1)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            a, b = symbols[left], symbols[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # one of them merged since: stale
            symbols[left], symbols[right] = a + b, ""
            following = after[left] = after[right]
            if following >= 0:
                before[following] = left
            if before[left] >= 0:
                candidate(before[left], left)
            if following >= 0:
                candidate(left, following)
        out: list[int] = []
        at = 0 if n else -1
        while at != -1:
            token_id = ids.get(symbols[at])
            out += [token_id] if token_id is not None else self._bytes_of(symbols[at])
            at = after[at]
        return out

    def _bytes_of(self, symbol: str) -> list[int]:
        """The byte tokens of a symbol that is no token (llama.cpp's ``byte_to_token``)."""
        out = []
        for byte in symbol.encode("utf-8", errors="surrogatepass"):
            token_id = self._ids.get(f"<0x{byte:02X}>")
            if token_id is None and byte < 0x80:
                token_id = self._ids.get(chr(byte))
            if token_id is None:
                token_id = self._unk_id
            if token_id is None:
                raise TokenizerError(
                    f"byte 0x{byte:02X} of {symbol!r} has no token (<0x{byte:02X}> or the byte "
                    f"itself) and the vocabulary has no unknown token"
                )
            out.append(token_id)
        return out


def _insert(trie: Trie, text: str, token_id: int) -> None:
    node = trie
    for ch in text:
        child = node.setdefault(ch, {})
        assert isinstance(child, dict), "only _END holds an id, and _END is no character"
        node = child
    node[_END] = token_id


def _byte_of(token: str) -> int:
    """The byte of a ``<0xNN>`` token."""
    try:
        return int(token[3:5], 16) if len(token) == 6 and token.startswith("<0x") else ord(token)
    except (ValueError, TypeError):
        raise TokenizerError(f"byte token {token!r} is not of the form <0xNN>") from None


def _decode_bytes(data: bytearray) -> str:
    """A group of byte tokens as text: UTF-8, or U+FFFD per byte when it is not valid UTF-8
    (Hugging Face's ``ByteFallback`` decoder)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(data)
