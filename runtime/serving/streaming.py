"""What of a growing completion may be streamed: the text rules of the batcher.

A streamed completion must always be a prefix of its final text, so a chunk never holds the start
of a stop string that may still complete, an incomplete UTF-8 sequence, or the text of a trailing
run of byte-fallback tokens (an invalid group rewrites earlier bytes to U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from ggufswap.runtime.serving.tokenizer import GgufTokenizer

REPLACEMENT: Final = "\ufffd"  # an incomplete UTF-8 sequence decodes to this; held back


def first_stop(text: str, stops: Sequence[str], *, since: int) -> int | None:
    """Where the earliest stop string starts in ``text`` at or after ``since`` (text already sent
    never holds a whole stop string: ``_safe_end`` keeps the tail that could start one)."""
    found = [i for s in stops if (i := text.find(s, since)) >= 0]
    return min(found) if found else None


def sendable_end(
    tokenizer: GgufTokenizer,
    completion: Sequence[int],
    text: str,
    stops: Sequence[str],
    *,
    sent: int,
) -> int:
    """How much of ``text`` (the decode of ``completion``) can be streamed now, so that what is
    streamed is always a prefix of the final text: not a tail that could start a stop string, not
    an incomplete UTF-8 sequence, and not the text of a trailing run of byte-fallback tokens."""
    end = _safe_end(text, stops, sent=sent)
    run = tokenizer.trailing_byte_tokens(completion)
    if run:
        settled = tokenizer.decode(completion[: len(completion) - run])
        end = min(end, len(settled) if text.startswith(settled) else sent)
    return max(end, sent)


def _safe_end(text: str, stops: Sequence[str], *, sent: int) -> int:
    """How much of ``text`` may be sent: not a tail that could start a stop string, nor an
    incomplete UTF-8 sequence (decoded as U+FFFD until its last byte arrives)."""
    end = len(text)
    if stops:
        end = max(sent, end - (max(len(s) for s in stops) - 1))
    while end > sent and text[end - 1] == REPLACEMENT:
        end -= 1
    return end
