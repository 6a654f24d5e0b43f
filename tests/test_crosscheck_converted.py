"""Files llama.cpp's own converter made from tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints,
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

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the shared code

import xcheck  # found on the path above
from converted import FIXTURES, threshold  # found on the path above

MANIFEST = json.loads((FIXTURES / xcheck.MANIFEST.name).read_text())
KEPT = {name: case for name, case in MANIFEST["cases"].items() if case["file"]}


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
    case = KEPT[name]
    path = FIXTURES / case["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == case["sha256"]
    with np.load(FIXTURES / xcheck.LOGITS.name) as arrays:
        key = case["logits_key"]
        golden = xcheck.decode_logits(
            arrays[f"{key}_codes"], arrays[f"{key}_offset"], arrays[f"{key}_step"]
        )
    ours = xcheck.project_logits(path)[list(xcheck.GOLDEN_POSITIONS)]
    figures = xcheck.compare(golden, ours)
    assert not figures.meets(threshold(name)), (name, figures)
