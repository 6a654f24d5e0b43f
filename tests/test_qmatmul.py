"""Products from GGUF blocks: the compiled kernels decode every block exactly as gguf.quants does,
multiply to float32 rounding of a float64 reference, give the same bits on any thread count, and
the torch path stands in for them wherever they do not run. ggml's kernels (a libggml, when one
is installed) run before both, except under ``float_products`` (these float kernels' tests run
there; tests/test_ggml_golden.py checks ggml's against its recorded products)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q
from runtime_helpers import one_thread

from ggufswap.runtime import QuantizedExperts, QuantizedMatrix, float_products, routed_all
from ggufswap.runtime.kernels import _compiled, _ggml, qmatmul
from ggufswap.shards import _synth
from ggufswap.shards.ggml_types import GGMLType


@pytest.fixture(autouse=True)
def float_kernels() -> Iterator[None]:
    """The float kernels, whatever libggml is installed (ggml's products are tested apart)."""
    with float_products():
        yield


pytestmark = pytest.mark.usefixtures(one_thread.__name__)

# Mainline types (gguf.quants is their reference); ik's types are checked against ik's golden
# files in tests/test_ik_types.py, under both kernels.
IK_COMPILED = {
    GGMLType.IQ4_K,
    GGMLType.IQ5_K,
    GGMLType.IQ4_KS,
    GGMLType.IQ4_KSS,
    GGMLType.IQ2_KS,
    GGMLType.IQ3_KS,
}
COMPILED = sorted((t for t in _compiled.types() if t not in IK_COMPILED), key=int)
needs_kernels = pytest.mark.skipif(
    not COMPILED, reason="the compiled kernels were not built (no C compiler at install)"
)
ROWS, COLS = 24, 512


def blocks(ggml_type: Q, rows: int = ROWS, cols: int = COLS, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng([seed, int(ggml_type)])
    return torch.from_numpy(_synth.synth_tensor(rng, ggml_type, (cols, rows), mean=0.0, std=0.05))


def reference(raw: torch.Tensor, ggml_type: Q, rows: int = ROWS) -> torch.Tensor:
    values = quants.dequantize(raw.numpy().reshape(rows, -1), ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


@needs_kernels
def test_the_kernels_cover_the_common_types() -> None:
    """The K-quants, IQ4_NL/IQ4_XS, the legacy 32-blocks and the plain float types all have a
    kernel."""
    expected = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
    expected |= {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS}
    assert set(COMPILED) == expected
    assert set(_compiled.types()) == expected | IK_COMPILED


@needs_kernels
@pytest.mark.parametrize("ggml_type", COMPILED, ids=lambda t: t.name)
def test_compiled_decode_equals_gguf_quants_bit_for_bit(ggml_type: Q) -> None:
    kernels = _compiled.module()
    raw = blocks(ggml_type)
    out = torch.empty(ROWS * COLS)
    kernels.decode(raw.data_ptr(), int(ggml_type), ROWS * COLS, out.data_ptr())
    assert torch.equal(out.view(ROWS, COLS), reference(raw, ggml_type))


@needs_kernels
@pytest.mark.parametrize("ggml_type", COMPILED, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3])
def test_compiled_product_is_the_float64_product_to_float32_rounding(ggml_type: Q, n: int) -> None:
    raw = blocks(ggml_type)
    matrix = QuantizedMatrix(raw, ggml_type, (ROWS, COLS), "blk.0.ffn_up_exps.weight")
    assert matrix.compiled
    x = torch.randn(n, COLS, generator=torch.Generator().manual_seed(1))
    got = matrix.linear(x, dtype=torch.float32)
    exact = (x.double() @ reference(raw, ggml_type).double().T).float()
    assert got.shape == (n, ROWS)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_compiled_product_has_the_same_bits_on_any_thread_count() -> None:
    """Rows are split over threads, each row summed in one fixed order."""
    raw = blocks(Q.Q4_K, rows=97)
    matrix = QuantizedMatrix(raw, Q.Q4_K, (97, COLS), "blk.0.ffn_up_exps.weight")
    x = torch.randn(2, COLS, generator=torch.Generator().manual_seed(2))
    results = []
    for threads in (1, 2, 5):
        torch.set_num_threads(threads)
        results.append(matrix.linear(x, dtype=torch.float32))
    torch.set_num_threads(1)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_torch_path_decodes_and_multiplies_where_no_kernel_runs() -> None:
    """Without the extension (or for a type it lacks) the product is decode + F.linear, in the
    compute dtype asked for."""
    raw = blocks(Q.Q8_0)
    matrix = QuantizedMatrix(raw, Q.Q8_0, (ROWS, COLS), "blk.0.ffn_up_exps.weight")
    x = torch.randn(2, COLS, generator=torch.Generator().manual_seed(3))
    w = reference(raw, Q.Q8_0)
    with _compiled.disabled():
        assert not matrix.compiled
        assert torch.equal(matrix.linear(x, dtype=torch.float32), F.linear(x, w))
        half = matrix.linear(x, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_a_matrix_whose_bytes_do_not_fit_its_shape_is_refused() -> None:
    block_size, type_size = GGML_QUANT_SIZES[Q.Q8_0]
    raw = torch.zeros(ROWS * COLS // block_size * type_size - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"blk.0.x: Q8_0 \[24, 512\] needs 13056 bytes"):
        QuantizedMatrix(raw, Q.Q8_0, (ROWS, COLS), "blk.0.x")


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_many_rows_decode_in_bands_of_bounded_scratch(
    monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """A product with many activation rows and no decoded copy decodes the matrix a band of
    rows at a time (scratch bounded by SCRATCH_BYTES) and computes the whole product."""
    if compiled and not COMPILED:
        pytest.skip("the compiled kernels were not built")
    raw = blocks(Q.Q4_K, rows=40)
    matrix = QuantizedMatrix(raw, Q.Q4_K, (40, COLS), "output.weight")
    x = torch.randn(3, 16, COLS, generator=torch.Generator().manual_seed(4))
    expected = F.linear(x, reference(raw, Q.Q4_K, rows=40))
    monkeypatch.setattr(qmatmul, "SCRATCH_BYTES", 7 * COLS * 4)  # bands of 7 rows
    with contextlib.ExitStack() as stack:
        if not compiled:
            stack.enter_context(_compiled.disabled())
        got = matrix.linear(x, dtype=torch.float32)
    assert got.shape == (3, 16, 40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_ggml_multiplies_first_where_a_libggml_is_loaded() -> None:
    """With a libggml, a matrix of a type it multiplies goes through it for any number of rows
    (ggml's rounding: not the float product); float_products turns it off for the block."""
    library = _ggml.library()
    if library is None:
        pytest.skip(f"no libggml here: {_ggml.describe()}")
    raw = blocks(Q.Q4_K)
    matrix = QuantizedMatrix(raw, Q.Q4_K, (ROWS, COLS), "blk.0.ffn_up.weight")
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(5))
    floats = matrix.linear(x, dtype=torch.float32)
    token = _ggml._FLOAT_ONLY.set(False)  # leave this module's float_products for a moment
    try:
        assert matrix.ggml
        assert matrix.multiplies_blocks
        assert qmatmul.kernels().startswith(library.name)
        got = matrix.linear(x, dtype=torch.float32)
        assert torch.equal(got, library.mul_mat(raw, Q.Q4_K, (ROWS, COLS), x))
    finally:
        _ggml._FLOAT_ONLY.reset(token)
    assert not torch.equal(got, floats)
    torch.testing.assert_close(got, floats, rtol=0.05, atol=0.05)  # 8-bit activations


def test_matrices_sharing_activations_multiply_in_one_ggml_call_with_the_same_bits() -> None:
    """linear_all gives each matrix's own product bit for bit: one ggml call where a libggml
    multiplies them all, each matrix's linear otherwise."""
    raws = [blocks(Q.Q4_K, rows=32, seed=1), blocks(Q.Q8_0, rows=24, seed=2)]
    matrices = [
        QuantizedMatrix(raws[0], Q.Q4_K, (32, COLS), "blk.0.attn_q.weight"),
        QuantizedMatrix(raws[1], Q.Q8_0, (24, COLS), "blk.0.attn_k.weight"),
    ]
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(6))
    for ggml in (False, True):
        if ggml and _ggml.library() is None:
            continue
        token = _ggml._FLOAT_ONLY.set(not ggml)
        try:
            together = qmatmul.linear_all(x, matrices, dtype=torch.float32)
            alone = [m.linear(x, dtype=torch.float32) for m in matrices]
        finally:
            _ggml._FLOAT_ONLY.reset(token)
        assert [t.shape for t in together] == [(3, 32), (3, 24)]
        assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True)), ggml


@pytest.mark.skipif(_ggml.library() is None, reason="no libggml installed")
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "input-per-slot"])
def test_stacks_sharing_a_routing_multiply_in_one_ggml_call_with_the_same_bits(
    per_slot: bool,
) -> None:
    """routed_all gives each expert stack's own routed product bit for bit in one ggml call
    (a MoE layer's gate and up), and None inside float products (the caller then calls each)."""
    n_expert, rows = 4, 16
    stacks = [
        QuantizedExperts(blocks(t, rows=n_expert * rows, seed=s), t, (n_expert, rows, COLS), n)
        for t, s, n in ((Q.Q4_K, 3, "blk.0.ffn_gate_exps.weight"), (Q.Q8_0, 4, "blk.0.ffn_up"))
    ]
    ids = torch.tensor([[3, 0], [1, 3], [2, 2]])
    shape = (3, 2, COLS) if per_slot else (3, COLS)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    token = _ggml._FLOAT_ONLY.set(False)  # leave this module's float_products for a moment
    try:
        together = routed_all(stacks, x, ids)
        alone = [s.routed(x, ids, dtype=torch.float32) for s in stacks]
    finally:
        _ggml._FLOAT_ONLY.reset(token)
    assert together is not None
    assert [t.shape for t in together] == [(3, 2, rows)] * 2
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    with float_products():
        assert routed_all(stacks, x, ids) is None


@pytest.mark.parametrize("ggml_type", [Q.Q4_1, Q.Q5_1], ids=lambda t: t.name)
def test_batched_products_of_short_q4_1_and_q5_1_rows_are_right(ggml_type: Q) -> None:
    """A batch of 32 activation rows by 64 weight rows of 64 values (Q4_1/Q5_1: ik's libggml
    computes zeros there) gives the float product to 8-bit activation rounding: such matrices
    multiply elsewhere under ik's library, through ggml under mainline's."""
    rows, cols = 64, 64
    raw = blocks(ggml_type, rows=rows, cols=cols)
    matrix = QuantizedMatrix(raw, ggml_type, (rows, cols), "blk.0.ffn_up.weight")
    x = torch.randn(32, cols, generator=torch.Generator().manual_seed(7))
    expected = x @ reference(raw, ggml_type, rows).T
    token = _ggml._FLOAT_ONLY.set(False)  # whatever runs by default here
    try:
        library = _ggml.library()
        assert matrix.ggml == (library is not None and not library.ik)
        got = matrix.linear(x, dtype=torch.float32)
    finally:
        _ggml._FLOAT_ONLY.reset(token)
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)
