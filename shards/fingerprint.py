"""Content fingerprints of tensor data: xxh3-128 of the bytes, cached by file identity.

A fingerprint names the content, not the file: the same bytes in another file, shard or offset
have the same fingerprint, which is how the runtime recognises a tensor returning to its
original content (reattachment) and the agent tells a rewritten-but-equal tensor from a changed one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Final

import xxhash

from ggufswap.shards.data import READ_CHUNK, iter_chunks, open_verified
from ggufswap.shards.records import TensorRecord

_CacheKey = tuple[tuple[int, int, int, int, int], int, int]


def fingerprint_bytes(data: bytes | memoryview) -> str:
    """Fingerprint of data already in memory (equal to :func:`fingerprint` of the same bytes)."""
    return xxhash.xxh3_128_hexdigest(data)


class Fingerprinter:
    """Computes fingerprints on demand; a file version's tensors are hashed once.

    Thread-safe. The cache is keyed by (file identity, offset, size): a replaced file has another
    identity, so a stale entry can never be returned for new content.
    """

    DEFAULT_CAPACITY: Final = 1 << 16

    def __init__(self, *, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._cache: OrderedDict[_CacheKey, str] = OrderedDict()
        self._lock = threading.Lock()
        self.hashed_bytes = 0

    def __call__(self, record: TensorRecord) -> str:
        key = (record.identity.as_tuple(), record.offset, record.nbytes)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        digest = self._compute(record)
        with self._lock:
            self._cache[key] = digest
            self.hashed_bytes += record.nbytes
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return digest

    def forget(self, record: TensorRecord) -> None:
        """Drop the cached fingerprint of ``record``: its bytes changed under the same file
        identity (a write through a shared mapping), so the next call hashes them again."""
        key = (record.identity.as_tuple(), record.offset, record.nbytes)
        with self._lock:
            self._cache.pop(key, None)

    @staticmethod
    def _compute(record: TensorRecord) -> str:
        hasher = xxhash.xxh3_128()
        scratch = memoryview(bytearray(min(READ_CHUNK, max(record.nbytes, 1))))
        with open_verified(record) as fd:
            for piece in iter_chunks(fd, record, scratch):
                hasher.update(piece)
        return hasher.hexdigest()


def fingerprint(record: TensorRecord) -> str:
    """Uncached fingerprint of one tensor's data."""
    return Fingerprinter._compute(record)
