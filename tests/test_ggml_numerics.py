"""``numerics="ggml"``: the decoders round as ggml's CPU kernels do and reproduce llama.cpp.

The golden llama.cpp logits of the cross-check (tests/fixtures/crosscheck) are replayed with the
decoder in both numerics: in "ggml" a quantized case agrees to float noise, far closer than the
exact float path, whose difference is ggml's activation rounding (docs/models.md, finding 3).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the shared code

import xcheck  # found on the path above

from ggufswap.config import Storage
from ggufswap.runtime import HotSwapRuntime, float_products
from ggufswap.runtime.kernels import _ggml
from ggufswap.runtime.models import HParams, ModelError, build_model
from ggufswap.runtime.models.ggml_numerics import VEC_DOT, gelu, q8_blocks, round_activations
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
# case replays at 3.2e-10): 3e-10 to 4e-10 for the 32-blocks, 4e-9 for F16, 1.5e-9 to 3e-9 for
# the K-quants; the exact path 3e-7 (F16) and 3e-6 to 6e-4.
GGML_MAX_KLD = 5e-9
# How much closer than the exact path a case must be. F16's exact path is only 3e-7 off, and
# with ggml's RMS norm (bit for bit llama.cpp's on tiny-dense/F16's attn_norm-0 and -1) one F16
# rounding of layer 1's attention inputs falls the other way: 4e-9, 79 times closer.
EXACT_MARGIN = 50


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as make crosscheck ran (restored afterwards). Per test, not per module:
    a module-scoped fixture would make the module one unit of work for xdist (conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("products", ["emulated", "mainline-libggml"])
@pytest.mark.parametrize("name", GGML_CASES)
def test_ggml_numerics_reproduce_llama_cpp_golden_logits(
    name: str, products: str, tmp_path: Path
) -> None:
    """With numerics "ggml" the decoder's logits agree with llama.cpp's to float noise, and
    closer than the exact path by orders of magnitude: its products emulated, or mainline's
    libggml's own (ik's fork rounds some activations its own way: its products are checked
    against its own recording, tests/test_ggml_golden.py)."""
    library = _ggml.library()
    if products != "emulated" and (library is None or library.ik):
        pytest.skip(f"no mainline libggml here ({_ggml.describe()})")
    case = CASES[name]
    path, sha256 = xcheck.write_case(case.spec, tmp_path)
    assert sha256 == case.sha256, f"{name}: the writer no longer writes the recorded bytes"
    positions = list(xcheck.GOLDEN_POSITIONS)
    with float_products() if products == "emulated" else contextlib.nullcontext():
        logits = xcheck.project_logits(path, numerics="ggml")
    ggml = xcheck.compare(case.logits, logits[positions])
    exact = xcheck.compare(case.logits, xcheck.project_logits(path)[positions])
    assert ggml.mean_kld < GGML_MAX_KLD, (name, ggml)
    assert ggml.top1 == 1.0, (name, ggml)
    assert ggml.mean_kld * EXACT_MARGIN < exact.mean_kld, (name, ggml, exact)


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


def _near_ties(rows: int, blocks: int, block: int, seed: int) -> torch.Tensor:
    """Activations whose every other value sits within float rounding of a rounding tie of an
    8-bit block quantization (``(k + 0.5) * amax / 127``), as a real model's activations often
    do (Gemma 3's layer 0: 0.3 % of the values, 170 times a uniform spread)."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.rand(rows, blocks, 1, generator=g) * 10 + 0.1
    k = torch.randint(-126, 126, (rows, blocks, block), generator=g).float()
    ties = (k + 0.5) * amax / 127
    plain = (torch.rand(rows, blocks, block, generator=g) * 2 - 1) * amax
    x = torch.where(torch.arange(block) % 2 == 0, ties, plain)
    x[..., 0] = amax[..., 0]  # the block's peak
    return x.reshape(rows, blocks * block)


def test_q8_0_rounding_is_the_avx2_kernel_bit_for_bit() -> None:
    """q8_blocks is quantize_row_q8_0's AVX2 path written in numpy's IEEE float32: ``id = 127.f /
    amax`` (one rounding: torch's ``127.0 / t`` is ``reciprocal(t) * 127``, an ulp off in a
    quarter of the blocks), ``round(x * id)`` half to even, ``d`` stored as F16."""
    x = _near_ties(64, 16, 32, seed=3)
    values, _, qsum = q8_blocks(x)
    blocks = x.numpy().reshape(64, 16, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    q = np.rint(blocks * (np.float32(127.0) / amax))  # IEEE float32 division, then half to even
    expected = q * (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    assert np.array_equal(values.numpy(), expected.reshape(64, 512))
    assert np.array_equal(qsum.numpy(), q.sum(-1))


def test_q8_k_rounding_is_the_reference_kernel_bit_for_bit() -> None:
    """q8_k is quantize_row_q8_K_ref in IEEE float32: ``iscale = -127.f / max`` (the signed
    peak), ``nearest_int(iscale * x)`` (half to even), capped at 127, times ``d = 1 / iscale``."""
    x = _near_ties(16, 4, 256, seed=4)
    ours = round_activations(x, VEC_DOT[GGMLType.Q4_K]).numpy()
    blocks = x.numpy().reshape(16, 4, 256)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
    iscale = np.float32(-127.0) / peak
    q = np.minimum(np.rint(iscale * blocks), 127)
    assert np.array_equal(ours, (q * (np.float32(1.0) / iscale)).reshape(16, 1024))


def _ggml_rms_norm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ggml_compute_forward_rms_norm_f32 in numpy: float32 squares summed in double, the mean
    rounded to float, ``1.0f / sqrtf(mean + eps)``, ``(x * scale) * w``."""
    sq = (x * x).astype(np.float64).sum(-1, keepdims=True)
    mean = (sq / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    return (x * scale) * w


def test_ggml_rms_norm_is_ggml_kernel_inside_a_ggml_forward_only() -> None:
    """Inside ggml_norms (a ggml decoder's forward) the decoders' rms_norm is ggml's kernel bit
    for bit; outside it is the exact path's float32 norm, unchanged; the switch is reset when
    the forward raises."""
    from ggufswap.runtime.models.blocks import norms
    from ggufswap.runtime.models.ggml_numerics import ggml_norms, ggml_norms_active

    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 640, generator=g) * torch.rand(512, 1, generator=g) * 40
    w = torch.rand(640, generator=g) + 0.5
    eps = 1e-6
    expected = _ggml_rms_norm_reference(x.numpy(), w.numpy(), eps)
    with ggml_norms():
        inside = norms.rms_norm(x, w, eps)
    assert np.array_equal(inside.numpy(), expected)
    exact = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w
    outside = norms.rms_norm(x, w, eps)
    assert torch.equal(outside, exact)
    assert not np.array_equal(outside.numpy(), expected), "the two norms differ somewhere"

    from ggufswap.runtime.models.ggml_numerics import with_ggml_norms

    def forward() -> None:
        assert ggml_norms_active()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with_ggml_norms(forward)()
    assert not ggml_norms_active()


def test_ggml_kv_cache_is_f16_inside_a_ggml_forward_unless_set_to_f32() -> None:
    """Inside a ggml decoder's forward, keys and values are held as llama-perplexity's default
    cache holds them (F16, round to nearest even, ggml's FP32->FP16); ``kv_cache_type(F32)``
    keeps them unrounded, as does any forward outside ggml numerics; other types are refused."""
    from ggufswap.runtime.models.ggml_numerics import (
        ggml_norms,
        kv_cache,
        kv_cache_name,
        kv_cache_type,
    )
    from ggufswap.shards.ggml_types import GGMLType

    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(1, 64, 1, 256, generator=g), torch.randn(1, 64, 1, 256, generator=g) * 30
    f16 = np.float16  # numpy's conversion rounds to nearest even, as F16C's _cvtss_sh(x, 0)
    with ggml_norms():
        assert kv_cache_name() == "f16"
        k16, v16 = kv_cache(k, v)
        assert np.array_equal(k16.numpy(), k.numpy().astype(f16).astype(np.float32))
        assert np.array_equal(v16.numpy(), v.numpy().astype(f16).astype(np.float32))
        assert not torch.equal(v16, v), "rounding changed some values"
        with kv_cache_type(GGMLType.F32):
            assert kv_cache_name() == "f32"
            k32, v32 = kv_cache(k, v)
            assert k32 is k
            assert v32 is v
    outside = kv_cache(k, v)
    assert outside[0] is k
    assert outside[1] is v
    with pytest.raises(ModelError, match="F16 or F32, not Q8_0"), kv_cache_type(GGMLType.Q8_0):
        pass


def test_a_ggml_decoder_attends_over_f16_keys_and_values_by_default(tmp_path: Path) -> None:
    """A ggml decoder's forward holds its keys and values as F16 (its logits differ from the same
    forward under ``kv_cache_type(F32)``, which the golden fixtures use); an exact decoder's
    forward never rounds them."""
    from ggufswap.runtime.models.ggml_numerics import kv_cache_type
    from ggufswap.shards.ggml_types import GGMLType

    path, _ = xcheck.write_case(CASES["tiny-dense/Q8_0"].spec, tmp_path)
    runtime = HotSwapRuntime.open(path, storage=Storage.NATIVE)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        config = HParams.from_metadata(runtime.shards.metadata)
        tokens = torch.tensor([list(xcheck.TOKENS)])
        logits = {}
        for numerics in ("ggml", "exact"):
            model = build_model(config, runtime.store, store=runtime.store, numerics=numerics)
            with torch.inference_mode():
                f16 = model(tokens)
                with kv_cache_type(GGMLType.F32):
                    f32 = model(tokens)
            logits[numerics] = (f16, f32)
        assert not torch.equal(*logits["ggml"]), "F16 keys and values change the ggml logits"
        assert torch.equal(*logits["exact"]), "exact numerics never round them"
    finally:
        runtime.close()
