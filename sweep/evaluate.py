"""A sweep's evaluation of the model that reads a runtime's store, shared by the in-process sweep
and the runtime process of ``ggufswap sweep --config`` (``ggufswap sweep-runtime``).

:class:`ChunkEvaluator` runs llama-perplexity's protocol
(:mod:`ggufswap.runtime.serving.perplexity`): the baseline once (its base file
``baseline.logits`` and ``baseline.json`` with the digest of each chunk's scored logits, reused
when the model's tensor table, the tokens, the context and the numerics are the same), then for
any weight version the figures against it and the digests that prove a restore.

With a baseline model (``--baseline MODEL``, e.g. the BF16 or Q8_0 model whose tensors the swaps
replace), the base file holds that model's log-probabilities, while the digests (the restore
check) stay those of the swept model; ``baseline.json`` then also records the swept model's own
figures against the baseline model (``model_vs_baseline``).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import Tensor

from ggufswap.config import Storage
from ggufswap.logs import get_logger
from ggufswap.runtime.kernels import ggml_library
from ggufswap.runtime.models import Decoder, Numerics
from ggufswap.runtime.models.ggml_numerics import kv_cache_name
from ggufswap.runtime.serving.perplexity import eval_batch, first_scored, scored_per_chunk
from ggufswap.shards import TensorRecord
from ggufswap.sweep.basefile import BaseLogProbs, BaseLogProbsWriter, encode_base_rows
from ggufswap.sweep.errors import BaselineMismatch
from ggufswap.sweep.kld import KldStats, logits_digest
from ggufswap.sweep.results import JOURNAL, write_text

log = get_logger(__name__)

BASELINE_LOGITS: Final = "baseline.logits"
BASELINE_JSON: Final = "baseline.json"


def table_digest(originals: Mapping[str, TensorRecord]) -> str:
    """sha256 of a model's tensor table (name, type, shape): what its logits depend on."""
    table = hashlib.sha256()
    for name in sorted(originals):
        rec = originals[name]
        table.update(f"{name}:{rec.ggml_type.name}:{list(rec.ne)}\n".encode())
    return table.hexdigest()


class ChunkEvaluator:
    """Evaluates ``chunks`` ``[C, n_ctx]`` (the text's tokens) with ``model``."""

    def __init__(
        self,
        model: Decoder,
        chunks: np.ndarray,
        bos_id: int | None,
        *,
        numerics: Numerics = Numerics.EXACT,
        storage: Storage = Storage.DEQUANTIZED,
        source: str = "",
        text: str | None = None,
    ) -> None:
        self.model = model
        self.numerics = Numerics(numerics)  # the model's, recorded with the baseline
        self.storage = storage
        self.chunks = chunks
        self.bos_id = bos_id
        self.batch = eval_batch(chunks, bos_id)  # [C, n_ctx] as evaluated
        self.n_ctx = int(chunks.shape[1])
        self.source = source  # the model file, recorded with the baseline
        self.text_sha256 = hashlib.sha256(text.encode()).hexdigest() if text is not None else None

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
        return {
            "tensors_sha256": table_digest(originals),
            "tokens_sha256": hashlib.sha256(self.chunks.astype("<i4").tobytes()).hexdigest(),
            "n_ctx": self.n_ctx,
            "n_chunk": len(self.chunks),
        }

    def protocol(self, base: ChunkEvaluator | None) -> dict[str, Any]:
        """How every figure of the sweep was measured (recorded in every output)."""
        return {
            "numerics": self.numerics.value,
            "products": products(self.numerics),
            "kv_cache": kv_cache_of(self.numerics),
            "n_ctx": self.n_ctx,
            "n_chunk": len(self.chunks),
            "scored_per_chunk": scored_per_chunk(self.n_ctx),
            "bos": self.bos_id,
            "text_sha256": self.text_sha256,
            "tokens_sha256": hashlib.sha256(self.chunks.astype("<i4").tobytes()).hexdigest(),
            "model": self.source,
            "baseline_model": base.source if base is not None else self.source,
            "baseline_file": BASELINE_LOGITS,
        }

    def _stored(
        self, out_dir: Path, identity: dict[str, Any], base: ChunkEvaluator | None
    ) -> dict[str, Any] | None:
        """The stored baseline when it is this one's; BaselineMismatch when a journal of
        another sweep is there."""
        path = out_dir / BASELINE_JSON
        if not (path.exists() and (out_dir / BASELINE_LOGITS).exists()):
            return None
        stored = json.loads(path.read_text())
        numerics = stored.get("numerics", Numerics.EXACT.value)  # absent: before the option
        base_source = base.source if base is not None else self.source
        protocol = stored.get("protocol", {})
        same_base = protocol.get("baseline_model", base_source) == base_source
        ours = products(self.numerics), kv_cache_of(self.numerics)
        theirs = protocol.get("products", ours[0]), protocol.get("kv_cache", "f32")  # absent: older
        same = numerics == self.numerics.value and theirs == ours
        if stored.get("identity") == identity and same and same_base:
            return dict(stored)
        if not (out_dir / JOURNAL).exists():
            return None
        if not same:
            raise BaselineMismatch(
                f"{out_dir} holds a sweep computed with numerics {numerics!r}, products of "
                f"{theirs[0]}, KV cache {theirs[1]} ({path}); this one computes with "
                f"{self.numerics.value!r}, products of {ours[0]}, KV cache {ours[1]}; use the "
                "same --numerics and --ggml, or a new --out"
            )
        raise BaselineMismatch(
            f"{out_dir} holds the sweep of another model, text, context or baseline model "
            f"({path}: {stored.get('identity')} != {identity}); use a new --out"
        )

    def baseline(
        self,
        out_dir: Path,
        originals: Mapping[str, TensorRecord],
        *,
        base: ChunkEvaluator | None = None,
    ) -> dict[str, Any]:
        """The baseline's record, computed now (files written to ``out_dir``) or reused.
        ``base``: the evaluator of a baseline model (default: this model is its own)."""
        identity = self.identity(originals)
        stored = self._stored(out_dir, identity, base)
        if stored is not None:
            return stored
        started = time.perf_counter()
        ref = base if base is not None else self
        writer: BaseLogProbsWriter | None = None
        digests, nll_sum, nll2_sum, count = [], 0.0, 0.0, 0
        try:
            for c in range(len(self.chunks)):
                logits = ref.scored_logits(c)
                if writer is None:
                    tmp = out_dir / f".{BASELINE_LOGITS}.tmp"
                    writer = BaseLogProbsWriter(
                        tmp, chunks=self.chunks, n_vocab=int(logits.shape[1])
                    )
                rows, nll = encode_base_rows(logits, self.targets(c))
                writer.write_chunk(rows)
                if base is None:
                    digests.append(logits_digest(logits))
                nll_sum += float(nll.sum())
                nll2_sum += float((nll * nll).sum())
                count += len(nll)
        except BaseException:
            if writer is not None:  # no half-written base file is left behind
                writer.discard()
            raise
        assert writer is not None, "text_chunks gives at least two chunks"
        writer.close()
        writer.path.replace(out_dir / BASELINE_LOGITS)
        mean = nll_sum / count
        var = nll2_sum / count - mean * mean
        record: dict[str, Any] = {
            "identity": identity,
            "numerics": self.numerics.value,
            "protocol": self.protocol(base),
            "n_vocab": writer.n_vocab,
            "ppl": math.exp(mean),  # as NllStats.perplexity: `ggufswap perplexity`'s figure
            "ppl_unc": math.exp(mean) * math.sqrt(var / (count - 1)) if var > 0 else 0.0,
            "count": count,
        }
        if base is not None:  # the swept model against the baseline model, and its digests
            figures, digests = self.measure(BaseLogProbs(out_dir / BASELINE_LOGITS))
            record["model_vs_baseline"] = figures
        record["digests"] = digests
        record["eval_s"] = round(time.perf_counter() - started, 3)
        write_text(out_dir / BASELINE_JSON, json.dumps(record, indent=1) + "\n")
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
        return stats.result().as_metrics(), digests

    def digests(self, n: int) -> list[str]:
        """The digests of the first ``n`` chunks' logits (0: every chunk)."""
        count = min(n or len(self.chunks), len(self.chunks))
        return [logits_digest(self.scored_logits(c)) for c in range(count)]


def kv_cache_of(numerics: Numerics) -> str:
    """How the keys and values are held: ggml numerics as llama-perplexity's default cache
    (``f16``, unless :func:`~ggufswap.runtime.models.ggml_numerics.kv_cache_type` says F32),
    float products unrounded (``f32``)."""
    return kv_cache_name() if numerics is Numerics.GGML else "f32"


def products(numerics: Numerics) -> str:
    """Whose arithmetic the products are, recorded beside the numerics: ggml numerics on
    ik_llama.cpp's libggml compare with ik_llama.cpp's llama-perplexity, on mainline's with
    llama.cpp's, emulated (no libggml) with mainline's to its noise (docs/sweep.md)."""
    if numerics is not Numerics.GGML:
        return "float"
    library = ggml_library()
    if library is None:
        return "emulated (mainline's rounding)"
    whose = "ik_llama.cpp's libggml" if library.ik else "llama.cpp's libggml"
    return f"{whose} ({library.package})" if library.package else whose
