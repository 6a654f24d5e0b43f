"""Files llama.cpp's own converter made from tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints
(and, each in its family's folder, Qwen3-VL-MoE, Llama 4, MiniMax-M2 and Gemma 4 ones),
replayed against llama.cpp's recorded logits (no llama.cpp, no converter needed).

``make crosscheck`` (``crosscheck/converted.py``) converted the checkpoints with
``convert_hf_to_gguf.py``, quantized them with llama.cpp's quantizer, had llama.cpp compute the
logits, and kept the F32 files (the other types' figures are in the manifest) with llama.cpp's
logits under ``tests/fixtures/crosscheck/converted``. The decoder, reading each kept file through
the tensor store as the server does, agrees with them: top-1 100% and mean KLD < 1e-6.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the shared code

import xcheck  # found on the path above
from converted import FIXTURES, threshold  # found on the path above

MANIFEST = json.loads((FIXTURES / xcheck.MANIFEST.name).read_text())
KEPT = {name: case for name, case in MANIFEST["cases"].items() if case["file"]}
# The families with fixture files of their own (xcheck.FAMILY_VARIANTS): converter files under
# tests/fixtures/crosscheck/<family>/converted (crosscheck/converted.py --family).
FAMILY_DIRS = {f: xcheck.family_fixtures(f) / "converted" for f in xcheck.FAMILY_VARIANTS}
FAMILY_MANIFESTS = {
    f: json.loads((d / xcheck.MANIFEST.name).read_text())
    for f, d in FAMILY_DIRS.items()
    if (d / xcheck.MANIFEST.name).exists()
}
FAMILY_KEPT = [
    (f, name)
    for f, m in FAMILY_MANIFESTS.items()
    for name, case in m["cases"].items()
    if case["file"]
]
CHECKED_TYPES = {"F32", "F16", "Q8_0", "Q4_K"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as make crosscheck ran (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_every_architecture_and_type_was_checked() -> None:
    """Each hybrid architecture was converted and checked at F32, F16, Q8_0 and Q4_K, and every
    check met its threshold (or the recorded allowance for llama.cpp's rounding)."""
    archs = {name.partition("/")[0] for name in MANIFEST["cases"]}
    assert archs == {"qwen35", "qwen35moe", "qwen3next"}
    for arch in archs:
        types = {n.partition("/")[2] for n in MANIFEST["cases"] if n.startswith(arch + "/")}
        assert types == {"F32", "F16", "Q8_0", "Q4_K"}
    assert set(KEPT) == {n for n in MANIFEST["cases"] if n.endswith("/F32")}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_decoder_agrees_with_llama_cpp_on_converter_files(name: str) -> None:
    """The converter's file is the recorded one, and the decoder's logits agree with
    llama.cpp's within the case's threshold."""
    check_kept(FIXTURES, KEPT[name], name)


def test_every_family_was_converted_and_checked() -> None:
    """Each family with fixtures of its own (qwen3vlmoe, llama4, minimax-m2, gemma4) was
    converted and checked at F32, F16, Q8_0 and Q4_K, its F32 file kept."""
    assert set(FAMILY_MANIFESTS) == set(xcheck.FAMILY_VARIANTS)
    for family, manifest in FAMILY_MANIFESTS.items():
        types = {name.partition("/")[2] for name in manifest["cases"]}
        assert types == CHECKED_TYPES, family
        kept = {n for n, case in manifest["cases"].items() if case["file"]}
        assert kept == {n for n in manifest["cases"] if n.endswith("/F32")}, family


@pytest.mark.parametrize(("family", "name"), FAMILY_KEPT)
def test_decoder_agrees_with_llama_cpp_on_family_converter_files(family: str, name: str) -> None:
    """A family's converter file is the recorded one, and the decoder's logits agree with
    llama.cpp's within the case's threshold (top-1 100%, mean KLD < 1e-6 at F32)."""
    check_kept(FAMILY_DIRS[family], FAMILY_MANIFESTS[family]["cases"][name], name)


def check_kept(fixtures: Path, case: dict[str, Any], name: str) -> None:
    """The kept file's bytes, and the decoder against llama.cpp's recorded logits."""
    path = fixtures / case["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == case["sha256"]
    with np.load(fixtures / xcheck.LOGITS.name) as arrays:
        key = case["logits_key"]
        golden = xcheck.decode_logits(
            arrays[f"{key}_codes"], arrays[f"{key}_offset"], arrays[f"{key}_step"]
        )
    ours = xcheck.project_logits(path)[list(xcheck.GOLDEN_POSITIONS)]
    figures = xcheck.compare(golden, ours)
    assert not figures.meets(threshold(name)), (name, figures)
