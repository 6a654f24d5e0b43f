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

The recorded bytes must not depend on the machine that writes them: numpy takes other SIMD paths
on other CPUs (AVX-512's ``power`` and ``exp`` round differently from AVX2's and from the
baseline's), so the writer uses none whose result varies, and one test writes the cases again in
a process with numpy's dispatched CPU features turned off.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
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


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as make crosscheck ran (restored afterwards). Per test, not per module:
    a module-scoped fixture would make the module one unit of work for xdist (conftest.py)."""
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


# Written again with numpy's SIMD paths off: each variant's K-quant case (rows of 256: the
# synthesized blocks and the widest rope factors), and every type of the rope-factor and MXFP4
# variants.
SIMD_CASES = sorted(
    {n for n in CASES if n.endswith("/Q4_K")}
    | {n for n in CASES if n.startswith(("llama-rope-freqs/", "gpt-oss-mxfp4/"))}
)

# Float32 results that numpy's dispatched paths round differently (its AVX2 and AVX-512 exp,
# log, sin, tanh and power against the baseline's): the control that the switch took effect.
_CONTROL = """
import hashlib
import numpy as np
x = np.linspace(0.1, 10, 4099, dtype=np.float32)
results = (np.exp(x), np.log(x), np.sin(x), np.tanh(x), np.power(x, np.float32(0.37)))
CONTROL = hashlib.sha256(b"".join(r.tobytes() for r in results)).hexdigest()
"""

_WRITE_AGAIN = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import xcheck
specs = xcheck.all_cases()
out = {"control": CONTROL}
with tempfile.TemporaryDirectory() as tmp:
    for name in json.loads(sys.stdin.read()):
        folder = Path(tmp) / name.replace("/", "_")
        folder.mkdir()
        out[name] = xcheck.write_case(specs[name], folder)[1]
print(json.dumps(out))
"""


def _control() -> str:
    scope: dict[str, str] = {}
    exec(_CONTROL, scope)
    return scope["CONTROL"]


def _dispatched_features() -> list[str]:
    """The CPU features numpy dispatches to on this machine (beyond its baseline)."""
    try:
        from numpy._core import _multiarray_umath as umath  # numpy 2
    except ImportError:  # numpy 1.26
        from numpy.core import _multiarray_umath as umath
    return [f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f)]


@pytest.mark.process
def test_the_writer_writes_the_recorded_bytes_whichever_simd_path_numpy_takes() -> None:
    """With every CPU feature numpy dispatches to turned off (NPY_DISABLE_CPU_FEATURES), the
    cases are written with the recorded bytes, while the control's float32 results change (the
    switch took effect)."""
    features = _dispatched_features()
    if not features:
        pytest.skip("numpy dispatches to no CPU feature beyond its baseline here")
    done = subprocess.run(
        [sys.executable, "-c", _CONTROL + _WRITE_AGAIN, str(Path(xcheck.__file__).parent)],
        input=json.dumps(SIMD_CASES),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(features)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    written = json.loads(done.stdout.splitlines()[-1])
    differing = [n for n in SIMD_CASES if written[n] != CASES[n].sha256]
    assert not differing, (
        f"with numpy's {features} off the writer wrote other bytes for {differing}: a "
        "computation of the writer depends on numpy's SIMD path"
    )
    if written["control"] == _control():
        pytest.skip(f"turning {features} off changed no float32 result here: nothing was shown")
