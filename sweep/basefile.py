"""The baseline's log-probabilities as llama.cpp's ``--kl-divergence-base`` file keeps them.

Per scored position (the protocol's, :mod:`ggufswap.runtime.serving.perplexity`), the
log-probabilities of every token in 16 bits: ``log p = scale * q + min_log_prob`` over the top 16
nats below the maximum (lower ones store 0), with ``scale`` and ``min_log_prob`` as two float32 in
front of the row. That halves float32 logits and makes KLD need no second model in memory; the
file written here is byte-compatible with llama.cpp's (``_logits_`` magic, ``n_ctx``,
``n_vocab``, ``n_chunk``, the tokens, then the rows chunk by chunk), so ``llama-perplexity
--kl-divergence-base`` reads it and ggufswap reads llama.cpp's.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Final

import numpy as np
import torch
from torch import Tensor

from ggufswap.runtime.serving.perplexity import (
    first_scored,
    log_sum_exp,
    scored_per_chunk,
    token_nll,
)
from ggufswap.sweep.errors import KldError

LOGITS_MAGIC: Final = b"_logits_"
LOG_PROB_SPAN: Final = 16.0  # nats below the maximum that the base rows keep
_HEADER: Final = struct.Struct("<8sIii")  # magic, n_ctx (u32), n_vocab (i32), n_chunk (i32)
_ROW_HEAD: Final = 4  # uint16 slots of (scale, min_log_prob) in front of each row
_SLICE_ROWS: Final = 16  # positions processed at once (16 x 262144 float32 = 16 MiB)


def row_width(n_vocab: int) -> int:
    """uint16 slots of one stored base row (llama.cpp's ``nv``)."""
    return 2 * ((n_vocab + 1) // 2) + _ROW_HEAD


def encode_base_rows(logits: Tensor, targets: Tensor) -> tuple[np.ndarray, Tensor]:
    """``(rows [N, nv] uint16, nll [N] float64)`` of float32 logits ``[N, V]`` and the tokens
    ``[N]`` they predict: llama.cpp's ``log_softmax`` that writes a base row (the NLL is the
    protocol's :func:`~ggufswap.runtime.serving.perplexity.token_nll`)."""
    logits = logits.float()
    n, n_vocab = logits.shape
    rows = np.zeros((n, row_width(n_vocab)), dtype=np.uint16)
    for lo in range(0, n, _SLICE_ROWS):
        x = logits[lo : lo + _SLICE_ROWS]  # [n', V]
        max_logit = x.max(dim=1).values
        min_logit = torch.maximum(x.min(dim=1).values, max_logit - LOG_PROB_SPAN)
        lse = log_sum_exp(x, max_logit)
        min_log_prob = min_logit - max_logit - lse
        scale = (max_logit - min_logit) / 65535.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        # round half to even as nearest_int; below min_logit the value is negative: 0, as there
        q = (x - min_logit[:, None]).mul_(inv[:, None]).round_().clamp_(min=0.0)
        head = torch.stack([scale, min_log_prob], dim=1).numpy().astype(np.float32)
        block = rows[lo : lo + len(x)]
        block[:, :_ROW_HEAD] = head.view(np.uint16)
        np.copyto(block[:, _ROW_HEAD : _ROW_HEAD + n_vocab], q.numpy(), casting="unsafe")
    return rows, token_nll(logits, targets)


def decode_base_rows(rows: np.ndarray, n_vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(scale [N], min_log_prob [N], q [N, V] float32)`` of stored base rows."""
    head = np.ascontiguousarray(rows[:, :_ROW_HEAD]).view(np.float32)  # [N, 2]
    q = torch.from_numpy(np.ascontiguousarray(rows[:, _ROW_HEAD : _ROW_HEAD + n_vocab])).float()
    return torch.from_numpy(head[:, 0].copy()), torch.from_numpy(head[:, 1].copy()), q


class BaseLogProbsWriter:
    """Writes a llama.cpp ``--kl-divergence-base`` file chunk by chunk (then fsyncs it)."""

    def __init__(self, path: str | os.PathLike[str], *, chunks: np.ndarray, n_vocab: int) -> None:
        self.path = Path(path)
        self.n_chunk, self.n_ctx = chunks.shape
        self.n_vocab = n_vocab
        self._written = 0
        self._f = self.path.open("wb")
        self._f.write(_HEADER.pack(LOGITS_MAGIC, self.n_ctx, n_vocab, self.n_chunk))
        self._f.write(chunks.astype("<i4").tobytes())

    def write_chunk(self, rows: np.ndarray) -> None:
        expected = (scored_per_chunk(self.n_ctx), row_width(self.n_vocab))
        if rows.shape != expected:
            raise KldError(f"{self.path}: a chunk's rows are {list(expected)}, found {rows.shape}")
        self._f.write(rows.astype("<u2").tobytes())
        self._written += 1

    def discard(self) -> None:
        """Close and remove the unfinished file (an evaluation failed or was interrupted)."""
        self._f.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._written != self.n_chunk:
            self._f.close()
            raise KldError(f"{self.path}: {self._written} of {self.n_chunk} chunks written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


class BaseLogProbs:
    """A llama.cpp ``--kl-divergence-base`` file, memory-mapped: tokens and rows per chunk."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != LOGITS_MAGIC:
            raise KldError(f"{self.path} is not a llama.cpp log-probability file (no _logits_)")
        _, self.n_ctx, self.n_vocab, self.n_chunk = _HEADER.unpack(head)
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1:
            raise KldError(
                f"{self.path}: implausible header n_ctx={self.n_ctx} n_vocab={self.n_vocab} "
                f"n_chunk={self.n_chunk}"
            )
        tokens_bytes = 4 * self.n_ctx * self.n_chunk
        self._rows_per_chunk = scored_per_chunk(self.n_ctx)
        nv = row_width(self.n_vocab)
        expected = _HEADER.size + tokens_bytes + 2 * self.n_chunk * self._rows_per_chunk * nv
        if size != expected:
            raise KldError(
                f"{self.path}: {size} bytes, expected {expected} for n_ctx={self.n_ctx} "
                f"n_vocab={self.n_vocab} n_chunk={self.n_chunk} (truncated or not llama.cpp's)"
            )
        self.tokens = np.fromfile(
            self.path, dtype="<i4", count=self.n_ctx * self.n_chunk, offset=_HEADER.size
        ).reshape(self.n_chunk, self.n_ctx)
        self._rows = np.memmap(
            self.path,
            dtype="<u2",
            mode="r",
            offset=_HEADER.size + tokens_bytes,
            shape=(self.n_chunk, self._rows_per_chunk, nv),
        )

    def rows(self, chunk: int) -> np.ndarray:
        """``[n_ctx - 1 - n_ctx // 2, nv]`` uint16 rows of one chunk."""
        return np.asarray(self._rows[chunk])

    def targets(self, chunk: int) -> Tensor:
        """The tokens the scored positions of ``chunk`` predict."""
        first = first_scored(self.n_ctx)
        return torch.from_numpy(self.tokens[chunk, first + 1 :].astype(np.int64))
