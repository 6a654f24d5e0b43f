"""The cross-check against llama.cpp, replayed from its golden fixtures (no llama.cpp needed).

``make crosscheck`` recorded, for every case (model variant x weight type), the writer spec, the
SHA-256 of the file it wrote and llama.cpp's logits (tests/fixtures/crosscheck). Here each model is
written again by the project's writer, its bytes must be the recorded ones (a writer change shows
up here; re-run ``make crosscheck`` after an intended one), and the project's decoder, reading it
through the tensor store as the server does, must agree with llama.cpp's logits within issue 12's
thresholds. A case where llama.cpp's own activation rounding moves it past its threshold (MoE
routing decisions it flips, a near-tied top-1) carries the allowance ``make crosscheck`` recorded
after checking that the decoder with that rounding emulated meets the threshold: such a case must
stay within a quarter of its recorded figures.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the shared code

import xcheck  # found on the path above

MANIFEST, CASES = xcheck.load_all_golden()  # the shared files and each family's
SPECS = xcheck.all_cases()
# How far a case with an allowance may drift from its recorded figures (summation order, torch).
ALLOWED_DRIFT = 1.25


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as make crosscheck ran (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_fixtures_cover_every_case_and_stay_small() -> None:
    """Every variant x type the cross-check defines is recorded, in well under a megabyte."""
    assert set(CASES) == set(SPECS)
    assert MANIFEST["tokens"] == list(xcheck.TOKENS)
    size = xcheck.MANIFEST.stat().st_size + xcheck.LOGITS.stat().st_size
    # 161 cases took 605 KB (about 3.8 KB each: a spec and four positions' logits).
    assert size < 768 * 1024, size


@pytest.mark.parametrize("name", sorted(CASES))
def test_decoder_agrees_with_llama_cpp_golden_logits(name: str, tmp_path: Path) -> None:
    """The case's model is rewritten byte for byte and the decoder's logits agree with
    llama.cpp's recorded ones within the case's threshold (or its recorded allowance)."""
    case = CASES[name]
    assert case.spec == SPECS[name], "the recorded spec is the case's spec"
    path, sha256 = xcheck.write_case(case.spec, tmp_path)
    assert sha256 == case.sha256, (
        f"{name}: the writer no longer writes the recorded bytes; if intended, run "
        "`make crosscheck` to re-record the golden fixtures"
    )
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256
    ours = xcheck.project_logits(path)[list(xcheck.GOLDEN_POSITIONS)]
    figures = xcheck.compare(case.logits, ours)
    allowance = MANIFEST["cases"][name]["allowance"]
    if allowance is None:
        assert not figures.meets(xcheck.case_threshold(name)), (name, figures)
        return
    recorded = MANIFEST["cases"][name]["golden_figures"]
    assert figures.mean_kld <= recorded["mean_kld"] * ALLOWED_DRIFT, (name, figures, allowance)
    assert figures.top1 >= recorded["top1"], (name, figures, allowance)
