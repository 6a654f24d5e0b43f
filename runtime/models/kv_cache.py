"""Per-sequence key/value cache for incremental decoding with the reference decoders.

``model(prompt, cache=cache)`` runs the prompt and keeps every layer's keys and values;
``model(new_tokens, start_pos=cache.length, cache=cache)`` then runs only the new tokens, their
queries attending to the cached keys and to each other. The logits equal those of one forward
over the whole sequence (to float rounding: the same products, summed over differently shaped
matmuls).

A cache holds activations computed from the weights of the forwards that filled it, so it is
valid for one weight version only: the server keeps one cache per request and commits plans only
between requests (``runtime.generate``); anyone else who commits a plan must drop the caches
filled before it.

Storage: per layer, ``k`` and ``v`` of shape ``[B, n_head_kv, capacity, head_dim]`` in the dtype
and on the device of the first keys written, allocated on the first forward with room for
``max_len`` positions and doubled when a forward runs past it. Sliding-window layers keep every
position too (the mask limits what they see), so one position index serves every layer. A decoder
with ggml's numerics and an F16 cache (the default) writes F16 keys and values: its cache holds
them as llama.cpp's does, in half the bytes, and its decode steps read them there
(``blocks/attention.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ggufswap.runtime.models.errors import KVCacheError

if TYPE_CHECKING:
    from ggufswap.runtime.models.registry import Decoder


class KVCache:
    """Keys and values of the ``length`` positions a sequence has run through, for every layer."""

    def __init__(self, *, n_layer: int, max_len: int = 256) -> None:
        if n_layer < 1 or max_len < 1:
            raise KVCacheError(
                f"a cache needs n_layer >= 1 and max_len >= 1, found {n_layer}, {max_len}"
            )
        self.n_layer, self.max_len = n_layer, max_len
        self.length = 0  # positions stored (in every layer once a forward has finished)
        self._k: list[Tensor | None] = [None] * n_layer  # [B, Hkv, capacity, hd]
        self._v: list[Tensor | None] = [None] * n_layer
        # Bumped whenever a layer's buffers are made or grown: whoever keeps their addresses
        # (a compiled decode step's arguments) takes them again then.
        self.generation = 0

    def check_continues(self, start_pos: int, n_new: int) -> None:
        """Raise unless a forward of ``n_new`` tokens at ``start_pos`` extends this cache."""
        if start_pos != self.length or n_new < 1:
            raise KVCacheError(
                f"a forward with a cache must start where the cache ends: the cache holds "
                f"{self.length} positions, the forward starts at {start_pos} with {n_new} tokens "
                f"(pass start_pos=cache.length, at least one token, or a new KVCache)"
            )

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this forward's keys and values of ``layer`` after the cached ones; return all of
        them, ``[B, Hkv, length + T, hd]`` each."""
        # k, v: [B, Hkv, T, hd]
        end = self.length + k.shape[2]
        cache_k, cache_v = self.buffers(layer, end, k, v)
        cache_k[:, :, self.length : end] = k
        cache_v[:, :, self.length : end] = v
        return cache_k[:, :, :end], cache_v[:, :, :end]

    def room(self, layer: int, end: int) -> tuple[Tensor, Tensor] | None:
        """``layer``'s whole key and value buffers where they hold ``end`` positions, else None
        (:meth:`buffers` makes or grows them)."""
        cache_k, cache_v = self._k[layer], self._v[layer]
        if cache_k is None or cache_v is None or end > cache_k.shape[2]:
            return None
        return cache_k, cache_v

    def buffers(self, layer: int, end: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``layer``'s whole key and value buffers ``[B, Hkv, capacity, hd]`` with room for
        ``end`` positions: made like ``k, v [B, Hkv, T, hd]`` (their dtype and device) on the
        first forward, doubled when ``end`` runs past them. A caller that writes positions
        ``length .. end - 1`` itself (a compiled decode step) reads them here."""
        cache_k, cache_v = self._k[layer], self._v[layer]
        if cache_k is None or cache_v is None:
            cache_k, cache_v = (
                t.new_zeros(*t.shape[:2], max(self.max_len, end), t.shape[3]) for t in (k, v)
            )
            self.generation += 1
        elif end > cache_k.shape[2]:
            cache_k, cache_v = (_grown(t, 2 * end) for t in (cache_k, cache_v))
            self.generation += 1
        self._k[layer], self._v[layer] = cache_k, cache_v
        return cache_k, cache_v

    def capacity(self) -> int:
        """Positions every layer's buffers hold (0 until each has them)."""
        caps = [0 if k is None else k.shape[2] for k in self._k]
        return min(caps)

    def advance(self, n_new: int) -> None:
        """Mark ``n_new`` more positions as stored (the model calls this after its last layer)."""
        self.length += n_new

    @property
    def nbytes(self) -> int:
        """Bytes held by the allocated buffers."""
        return sum(t.nbytes for t in (*self._k, *self._v) if t is not None)


class HybridCache(KVCache):
    """A :class:`KVCache` that also holds, for each recurrent (delta-net) layer, its conv state
    ``[B, kernel - 1, channels]`` and recurrent state ``[B, heads, state, state]`` (Qwen3.5,
    Qwen3-Next). The states summarise every position the sequence ran through, so like the keys
    and values they belong to the weight version that computed them: a commit that changes any
    weight invalidates the whole cache (the server drops caches across versions)."""

    def __init__(self, *, n_layer: int, max_len: int = 256) -> None:
        super().__init__(n_layer=n_layer, max_len=max_len)
        self._conv: list[Tensor | None] = [None] * n_layer
        self._state: list[Tensor | None] = [None] * n_layer

    def recurrent(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """The conv and recurrent states of ``layer`` after ``length`` positions (None, None
        before the first forward)."""
        return self._conv[layer], self._state[layer]

    def set_recurrent(self, layer: int, conv: Tensor, state: Tensor) -> None:
        """Store ``layer``'s states after this forward's positions."""
        self._conv[layer], self._state[layer] = conv, state

    @property
    def nbytes(self) -> int:
        states = (t for t in (*self._conv, *self._state) if t is not None)
        return super().nbytes + sum(t.nbytes for t in states)


def _grown(t: Tensor, capacity: int) -> Tensor:
    out = t.new_zeros(*t.shape[:2], capacity, t.shape[3])
    out[:, :, : t.shape[2]] = t
    return out


def attention_mask(
    start: int, length: int, *, window: int = 0, device: torch.device
) -> Tensor | None:
    """``[T, start + T]`` bool, True where the query at position ``start + i`` may attend the key
    at position ``j``: ``0 <= start + i - j`` and, with a window, ``< window``. None when plain
    causal attention over this forward's own tokens is the same (``start == 0``, window covering
    the forward).

    One query's mask (a decode step's, ``[1, start + 1]``) is one run of keys, made as such and
    marked with it (:func:`mask_keys`), so a step reads its keys without reading the mask."""
    if start == 0 and (window <= 0 or length <= window):
        return None
    if length == 1:
        lo = max(0, start - window + 1) if window > 0 else 0
        mask = torch.zeros(1, start + 1, dtype=torch.bool, device=device)
        mask[:, lo:] = True
        setattr(mask, _KEYS, (lo, start + 1))
        return mask
    query = torch.arange(start, start + length, device=device)
    key = torch.arange(start + length, device=device)
    dist = query[:, None] - key[None, :]  # [T, S]: i - j
    allowed = dist >= 0
    return allowed & (dist < window) if window > 0 else allowed


# The attribute that marks a one-query mask of :func:`attention_mask` with its run of keys. A mask
# is not written after it is made; a tensor made from it (a copy, a view) has no mark.
_KEYS = "_ggufswap_keys"


def mask_keys(mask: Tensor) -> tuple[int, int] | None:
    """The keys ``(lo, hi)`` of a one-query mask :func:`attention_mask` made (the run ``lo ..
    hi - 1``); None for any other tensor (its keys are read from its values)."""
    keys = getattr(mask, _KEYS, None)
    return keys if isinstance(keys, tuple) else None


def greedy_continuation(
    model: Decoder, prompt: list[int], n_new: int, *, cached: bool
) -> list[int]:
    """The greedy continuation of ``prompt``: a full forward per token, or (``cached``) one
    prefill and then one-token steps through a KV cache. The reference both ways agree on."""
    ids = list(prompt)
    cache = model.new_cache(max_len=len(prompt) + n_new) if cached else None
    with torch.inference_mode():
        for _ in range(n_new):
            if cache is None:
                logits = model(torch.tensor([ids]), last_only=True)[0, -1]  # [V]
            else:
                new = torch.tensor([ids[cache.length :]])  # [1, T]
                logits = model(new, start_pos=cache.length, cache=cache, last_only=True)[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]
