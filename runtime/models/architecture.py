"""What an architecture's module gives the registry: ``Architecture``, one per module.

An architecture's module (``runtime/models/<arch>.py``) holds its decoder, the metadata keys of
its own that it reads (``read_keys``: the part of llama.cpp's ``load_arch_hparams`` beyond the keys
every architecture shares, which ``HParams.from_metadata`` reads), and its state (a KV cache, or
recurrent state). The registry (``registry.ARCHITECTURES``) holds one line per architecture. What
llama.cpp's loader requires of a file stays torch-free on the agent side (``shards.archs``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ggufswap.shards.keys import Arch

if TYPE_CHECKING:
    from ggufswap.runtime.models.blocks.decoder import DecoderStack
    from ggufswap.runtime.models.hparams import KeyReader

# (reader, the HParams fields read from the shared keys) -> the architecture's own HParams fields
ReadKeys = Callable[["KeyReader", Mapping[str, Any]], dict[str, Any]]


def no_keys(reader: KeyReader, common: Mapping[str, Any]) -> dict[str, Any]:
    """An architecture that reads only the shared keys."""
    return {}


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """One ``general.architecture`` as the runtime runs it."""

    arch: Arch
    decoder: type[DecoderStack]
    read_keys: ReadKeys = no_keys
    # The key templates ({arch}-prefixed, ``Keys.LLM.*``) ``read_keys`` reads.
    keys: tuple[str, ...] = ()
