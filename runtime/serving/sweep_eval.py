"""A sweep's evaluation of the model that reads a runtime's store, shared by the in-process sweep
and the runtime process of ``ggufswap sweep --config`` (``ggufswap sweep-runtime``).

:class:`ChunkEvaluator` runs llama-perplexity's protocol (:mod:`.kld`): the baseline once (its
base file ``baseline.logits`` and ``baseline.json`` with the digest of each chunk's scored
logits, reused when the model's tensor table, the tokens and the context are the same), then for
any weight version the figures against it and the digests that prove a restore.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import Tensor

from ggufswap.logs import get_logger
from ggufswap.runtime.models import Decoder, Numerics
from ggufswap.runtime.serving.errors import ServingError
from ggufswap.runtime.serving.kld import (
    BaseLogProbs,
    BaseLogProbsWriter,
    KldStats,
    encode_base_rows,
    eval_batch,
    first_scored,
    logits_digest,
)
from ggufswap.runtime.serving.sweep_results import JOURNAL, write_text
from ggufswap.shards import TensorRecord

log = get_logger(__name__)

BASELINE_LOGITS: Final = "baseline.logits"
BASELINE_JSON: Final = "baseline.json"


class BaselineMismatch(ServingError):
    """``--out`` holds the journal of a sweep of another model, text or context."""


class ChunkEvaluator:
    """Evaluates ``chunks`` ``[C, n_ctx]`` (the text's tokens) with ``model``."""

    def __init__(
        self,
        model: Decoder,
        chunks: np.ndarray,
        bos_id: int | None,
        *,
        numerics: Numerics = Numerics.EXACT,
    ) -> None:
        self.model = model
        self.numerics = Numerics(numerics)  # the model's, recorded with the baseline
        self.chunks = chunks
        self.batch = eval_batch(chunks, bos_id)  # [C, n_ctx] as evaluated
        self.n_ctx = int(chunks.shape[1])

    def __len__(self) -> int:
        return len(self.chunks)

    def scored_logits(self, chunk: int) -> Tensor:
        """``[n_ctx - 1 - n_ctx // 2, V]`` float32 logits of one chunk's scored positions."""
        with torch.inference_mode():
            logits = self.model(self.batch[chunk : chunk + 1])  # [1, n_ctx, V]
            return logits[0, first_scored(self.n_ctx) : self.n_ctx - 1].float()

    def targets(self, chunk: int) -> Tensor:
        first = first_scored(self.n_ctx)
        return torch.from_numpy(self.chunks[chunk, first + 1 :].astype(np.int64))

    def identity(self, originals: Mapping[str, TensorRecord]) -> dict[str, Any]:
        """What the baseline depends on: the tensor table (name, type, shape), the tokens."""
        table = hashlib.sha256()
        for name in sorted(originals):
            rec = originals[name]
            table.update(f"{name}:{rec.ggml_type.name}:{list(rec.ne)}\n".encode())
        return {
            "tensors_sha256": table.hexdigest(),
            "tokens_sha256": hashlib.sha256(self.chunks.astype("<i4").tobytes()).hexdigest(),
            "n_ctx": self.n_ctx,
            "n_chunk": len(self.chunks),
        }

    def baseline(self, out_dir: Path, originals: Mapping[str, TensorRecord]) -> dict[str, Any]:
        """The baseline's record, computed now (files written to ``out_dir``) or reused."""
        path = out_dir / BASELINE_JSON
        identity = self.identity(originals)
        if path.exists() and (out_dir / BASELINE_LOGITS).exists():
            stored = json.loads(path.read_text())
            numerics = stored.get("numerics", Numerics.EXACT.value)  # absent: before the option
            if stored.get("identity") == identity and numerics == self.numerics.value:
                return dict(stored)
            if (out_dir / JOURNAL).exists() and numerics != self.numerics.value:
                raise BaselineMismatch(
                    f"{out_dir} holds a sweep computed with numerics {numerics!r} ({path}), "
                    f"this one computes with {self.numerics.value!r}; use the same --numerics "
                    "or a new --out"
                )
            if (out_dir / JOURNAL).exists():
                raise BaselineMismatch(
                    f"{out_dir} holds the sweep of another model, text or context "
                    f"({path}: {stored.get('identity')} != {identity}); use a new --out"
                )
        started = time.perf_counter()
        writer: BaseLogProbsWriter | None = None
        digests, nll_sum, count = [], 0.0, 0
        for c in range(len(self.chunks)):
            logits = self.scored_logits(c)
            if writer is None:
                tmp = out_dir / f".{BASELINE_LOGITS}.tmp"
                writer = BaseLogProbsWriter(tmp, chunks=self.chunks, n_vocab=int(logits.shape[1]))
            rows, nll = encode_base_rows(logits, self.targets(c))
            writer.write_chunk(rows)
            digests.append(logits_digest(logits))
            nll_sum += float(nll.sum())
            count += len(nll)
        assert writer is not None, "text_chunks gives at least two chunks"
        writer.close()
        writer.path.replace(out_dir / BASELINE_LOGITS)
        record = {
            "identity": identity,
            "numerics": self.numerics.value,
            "n_vocab": writer.n_vocab,
            "ppl": float(np.exp(nll_sum / count)),
            "count": count,
            "digests": digests,
            "eval_s": round(time.perf_counter() - started, 3),
        }
        write_text(path, json.dumps(record, indent=1) + "\n")
        log.info("sweep.baseline", ppl=record["ppl"], chunks=len(digests), eval_s=record["eval_s"])
        return record

    def measure(self, base: BaseLogProbs) -> tuple[dict[str, Any], list[str]]:
        """``(figures against the baseline, digest of each chunk's logits)``, every chunk."""
        stats = KldStats()
        digests = []
        for c in range(len(self.chunks)):
            logits = self.scored_logits(c)
            stats.add(logits, base.rows(c), self.targets(c))
            digests.append(logits_digest(logits))
        return asdict(stats.result()), digests

    def digests(self, n: int) -> list[str]:
        """The digests of the first ``n`` chunks' logits (0: every chunk)."""
        count = min(n or len(self.chunks), len(self.chunks))
        return [logits_digest(self.scored_logits(c)) for c in range(count)]
