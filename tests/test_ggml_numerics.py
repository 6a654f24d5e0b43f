"""``numerics="ggml"``: the decoders round as ggml's CPU kernels do and reproduce llama.cpp.

The golden llama.cpp logits of the cross-check (tests/fixtures/crosscheck) are replayed with the
decoder in both numerics: in "ggml" a quantized case agrees to float noise, far closer than the
exact float path, whose difference is ggml's activation rounding (docs/models.md, finding 3).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the shared code

import xcheck  # found on the path above

from ggufswap.config import Storage
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models import HParams, ModelError, build_model
from ggufswap.runtime.models.ggml_numerics import VEC_DOT, gelu, round_activations
from ggufswap.shards.ggml_types import GGMLType

MANIFEST, CASES = xcheck.load_golden()
# A handful of representative cases: each activation rounding (F16, Q8_0, Q8_1, Q8_K), dense
# and MoE experts, gemma3's GELU table, deepseek2's per-head products.
GGML_CASES = (
    "tiny-dense/F16",
    "tiny-dense/Q8_0",
    "tiny-dense/Q4_0",
    "tiny-dense/Q4_1",
    "tiny-dense/Q4_K",
    "tiny-dense/Q6_K",
    "gemma3/Q4_K",
    "gemma3/Q8_0",
    "llama-moe/Q4_K",
    "deepseek2/Q8_0",
    "deepseek2/Q4_K",
)
# What the emulation achieves through the fixtures' int16 codes of llama.cpp's logits (an F32
# case replays at 3.2e-10): 3e-10 to 4e-10 for F16 and the 32-blocks, 1.5e-9 to 3e-9 for the
# K-quants (crosscheck/emulate.py's float64 products give the same); the exact path 3e-7 (F16)
# and 3e-6 to 6e-4.
GGML_MAX_KLD = 5e-9


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as make crosscheck ran (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", GGML_CASES)
def test_ggml_numerics_reproduce_llama_cpp_golden_logits(name: str, tmp_path: Path) -> None:
    """With numerics "ggml" the decoder's logits agree with llama.cpp's to float noise, and
    closer than the exact path by orders of magnitude."""
    case = CASES[name]
    path, sha256 = xcheck.write_case(case.spec, tmp_path)
    assert sha256 == case.sha256, f"{name}: the writer no longer writes the recorded bytes"
    positions = list(xcheck.GOLDEN_POSITIONS)
    ggml = xcheck.compare(case.logits, xcheck.project_logits(path, numerics="ggml")[positions])
    exact = xcheck.compare(case.logits, xcheck.project_logits(path)[positions])
    assert ggml.mean_kld < GGML_MAX_KLD, (name, ggml)
    assert ggml.top1 == 1.0, (name, ggml)
    assert ggml.mean_kld * 100 < exact.mean_kld, (name, ggml, exact)


def test_ggml_numerics_need_native_storage(tmp_path: Path) -> None:
    """A decoder with numerics "ggml" over a dequantized store is refused, saying what it needs."""
    path, _ = xcheck.write_case(CASES["tiny-dense/Q8_0"].spec, tmp_path)
    runtime = HotSwapRuntime.open(path, storage=Storage.DEQUANTIZED)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        config = HParams.from_metadata(runtime.shards.metadata)
        with pytest.raises(ModelError, match="storage is dequantized, it needs native"):
            build_model(config, runtime.store, store=runtime.store, numerics="ggml")
        with pytest.raises(ModelError, match="pass the tensor store"):
            build_model(config, runtime.store, numerics="ggml")
        with pytest.raises(ValueError, match="'float'"):
            build_model(config, runtime.store, store=runtime.store, numerics="float")
    finally:
        runtime.close()


def test_q8_0_rounding_is_ggml_reference_quantization() -> None:
    """Activations rounded for a Q8_0 product equal gguf-py's Q8_0 quantize-dequantize of them
    (ggml's reference quantizer), but for values on a rounding tie."""
    from gguf import GGMLQuantizationType, quants

    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)) * 3
    ours = round_activations(x, VEC_DOT[GGMLType.Q8_0])
    q = quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    ref = torch.from_numpy(quants.dequantize(q, GGMLQuantizationType.Q8_0))
    assert (ours == ref).float().mean() > 0.999
    assert torch.allclose(ours, ref, rtol=0, atol=float(x.abs().max()) / 127)


def test_q8_k_rounding_keeps_the_peak_and_127_levels() -> None:
    """Q8_K rounds each block of 256 to 8-bit multiples of its float scale, the peak exact."""
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    ours = round_activations(x, VEC_DOT[GGMLType.Q4_K]).reshape(4, 2, 256)
    blocks = x.reshape(4, 2, 256)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = -peak / 127
    levels = ours / d
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    assert levels.round().abs().max() <= 128
    assert torch.allclose(ours.abs().amax(-1), peak.abs()[..., 0], rtol=1e-6)


def test_ggml_gelu_is_the_f16_table() -> None:
    """ggml's GELU: F16 values of the tanh GELU of F16 inputs, identity above 10, zero below -10."""
    x = torch.tensor([-12.0, -10.0, -1.0, 0.1234567, 2.5, 9.99, 10.0, 30.0])
    y = gelu(x)
    assert torch.equal(y[[0, 1, 6, 7]], torch.tensor([0.0, 0.0, 10.0, 30.0]))
    mid = x[2:6]
    expected = torch.nn.functional.gelu(mid.half().float(), approximate="tanh").half().float()
    assert torch.equal(y[2:6], expected)
    assert torch.equal(y[2:6], y[2:6].half().float())  # every value is an F16
