"""Where native storage keeps decoded weights: per-role scratch, and the decoded cache.

Native storage holds GGUF blocks; products multiply from them (:mod:`.qmatmul`). Where a product
needs the float values instead (many activation rows, a type or device without a compiled
kernel), they are decoded into one of two places:

- :func:`~ggufswap.runtime.kernels.role_scratch`: one reused buffer per tensor role
  (``ffn_up_exps.weight``, ``attn_q.weight``...) and thread, shared by every block: a decoded
  expert, or a band of rows of a dense matrix, lives there until the next decode of that role.
  No allocation per token.
- :class:`ForwardViews`: what a forward reads of a slot without decoding (its blocks as a
  ``QuantizedMatrix``, an expert stack, a float tensor's view), made once per slot and kept
  until a commit (or a tensor taken out of service) may have changed the slots' buffers.
- :class:`DecodedCache`: dense tensors decoded once and kept, an LRU bounded in bytes
  (``runtime.decoded_cache``), keyed by the tensor's content (fingerprint and type): a committed
  swap changes the key, so a stale entry is never returned, and the entry it replaces is dropped
  at once. A cache of 0 bytes keeps nothing.

Decoding is deterministic, so a cached or scratch-decoded tensor is bit-identical to decoding again:
the exactness guarantee (a swapped model computes what a fresh load computes) holds in this mode.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["DecodedCache", "ForwardViews"]

V = TypeVar("V")

CacheKey = tuple[str, str, int]  # (name, content fingerprint, ggml type)


class DecodedCache:
    """Decoded dense tensors, least recently used first out, at most ``budget`` bytes.

    Thread-safe: the inference thread reads through it, the stager reads derived tensors' sources.
    One entry per tensor name: a tensor whose content changed is decoded again and its old entry
    dropped. A tensor larger than the budget is decoded per use and never kept.
    """

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"decoded cache budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.used = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[CacheKey, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: CacheKey, decode: Callable[[], torch.Tensor]) -> torch.Tensor:
        name = key[0]
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry[0] == key:
                self._entries.move_to_end(name)
                self.hits += 1
                return entry[1]
            self.misses += 1
            if entry is not None:  # the content changed: the old decoding is dead
                del self._entries[name]
                self.used -= _nbytes(entry[1])
        value = decode()
        size = _nbytes(value)
        if size > self.budget:
            return value
        with self._lock:
            if name in self._entries:  # another thread decoded it meanwhile
                _, old = self._entries.pop(name)
                self.used -= _nbytes(old)
            self._entries[name] = (key, value)
            self.used += size
            while self.used > self.budget:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.used -= _nbytes(evicted)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used = 0

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "budget": self.budget,
                "used": self.used,
                "entries": len(self._entries),
                "hits": self.hits,
                "misses": self.misses,
            }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ForwardViews:
    """Views of slots made once for the forwards (see the module docstring); ``clear`` drops them
    all (commit calls it, as it may change any slot's buffers)."""

    def __init__(self) -> None:
        self._views: dict[tuple[str, str], object] = {}

    def get(self, kind: str, name: str, cls: type[V], make: Callable[[], V]) -> V:
        """The ``kind`` view of slot ``name``, made by ``make`` the first time."""
        view = self._views.get((kind, name))
        if not isinstance(view, cls):
            view = make()
            self._views[(kind, name)] = view
        return view

    def find(self, kind: str, name: str) -> object | None:
        """The ``kind`` view of ``name`` made since the last ``clear``, or None."""
        return self._views.get((kind, name))

    def keep(self, kind: str, name: str, view: object) -> None:
        """Remember ``view`` as the ``kind`` view of ``name`` until the next ``clear``."""
        self._views[(kind, name)] = view

    def clear(self) -> None:
        self._views.clear()
