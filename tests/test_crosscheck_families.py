"""The cross-check families with fixtures of their own, replayed without their references.

``make crosscheck`` (``crosscheck/families.py``) recorded, per family of ``xfamily.FAMILIES``
(DeepSeek-V3.2 / GLM-5.x against llama.cpp; ik_llama.cpp's three-tensor deepseek2 against
ik_llama.cpp), every case's writer spec, the SHA-256 of its file and the reference's logits under
``tests/fixtures/crosscheck/<family>/``. As ``test_crosscheck.py`` does for the other cases, each
model is written again (the same bytes), and the decoder, reading it through the tensor store,
must meet the case's threshold, or stay within a quarter of the figures recorded for a case whose
miss the reference's own rounding explains (its allowance).
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
import xfamily  # found on the path above

RECORDED = {family: xcheck.load_golden(xfamily.fixtures_of(family)) for family in xfamily.FAMILIES}
CASES = {
    (family, name): case for family, (_, cases) in RECORDED.items() for name, case in cases.items()
}
# How far a case with an allowance may drift from its recorded figures (summation order, torch).
ALLOWED_DRIFT = 1.25


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as make crosscheck ran (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family", list(xfamily.FAMILIES))
def test_each_family_records_every_case_against_its_reference(family: str) -> None:
    """Every variant x type of the family is recorded, against the family's reference, in a few
    kilobytes per case."""
    manifest, cases = RECORDED[family]
    assert set(cases) == set(xfamily.all_cases(family))
    assert manifest["tokens"] == list(xcheck.TOKENS)
    assert manifest["reference"] == xfamily.ENGINES[family]
    folder = xfamily.fixtures_of(family)
    size = (folder / xcheck.MANIFEST.name).stat().st_size + (
        folder / xcheck.LOGITS.name
    ).stat().st_size
    assert size < 8 * 1024 * len(cases), size


@pytest.mark.parametrize(("family", "name"), sorted(CASES))
def test_decoder_agrees_with_the_recorded_reference_logits(
    family: str, name: str, tmp_path: Path
) -> None:
    """The case's model is rewritten byte for byte and the decoder's logits agree with the
    reference's recorded ones within the case's threshold (or its recorded allowance)."""
    case = CASES[(family, name)]
    assert case.spec == xfamily.case_spec(name), "the case's spec"
    path, sha256 = xcheck.write_case(case.spec, tmp_path)
    assert sha256 == case.sha256, (
        f"{name}: the writer no longer writes the recorded bytes; if intended, run "
        "`make crosscheck` to re-record the golden fixtures"
    )
    ours = xcheck.project_logits(path)[list(xcheck.GOLDEN_POSITIONS)]
    figures = xcheck.compare(case.logits, ours)
    entry = RECORDED[family][0]["cases"][name]
    if entry["allowance"] is None:
        assert not figures.meets(xcheck.case_threshold(name)), (name, figures)
        return
    recorded = entry["golden_figures"]
    assert figures.mean_kld <= recorded["mean_kld"] * ALLOWED_DRIFT, (name, figures)
    assert figures.top1 >= recorded["top1"], (name, figures)


CONVERTED_MANIFEST, CONVERTED = xfamily.load_files(xfamily.CONVERTED)


def test_every_converted_architecture_and_type_was_checked() -> None:
    """Files made by the references' own converters and quantizers were checked for
    DeepSeek-V3.2 and GLM-5 (llama.cpp: F32, F16, Q8_0, Q4_K) and ik_llama.cpp's deepseek2 form
    (ik: those and its Q6_0 and IQ4_K), every check within its threshold or the recorded
    allowance; the F32 files are kept."""
    types = {"F32", "F16", "Q8_0", "Q4_K"}
    expected = {f"{arch}/{t}" for arch in ("deepseek32", "glm-dsa") for t in types}
    expected |= {f"deepseek2-ik/{t}" for t in (*types, "Q6_0", "IQ4_K")}
    assert set(CONVERTED_MANIFEST["cases"]) == expected
    assert set(CONVERTED) == {n for n in expected if n.endswith("/F32")}


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_decoder_agrees_with_the_reference_on_its_converters_file(name: str) -> None:
    """The converter's file is the recorded one, and the decoder's logits agree with the
    reference's (llama.cpp, or ik_llama.cpp for its form) to a mean KLD below 1e-6, top-1 100%."""
    path, logits = CONVERTED[name]
    assert (
        hashlib.sha256(path.read_bytes()).hexdigest() == CONVERTED_MANIFEST["cases"][name]["sha256"]
    )
    ours = xcheck.project_logits(path)[list(xcheck.GOLDEN_POSITIONS)]
    figures = xcheck.compare(logits, ours)
    assert not figures.meets(xcheck.Threshold(1e-6, exact_top1=True)), (name, figures)
