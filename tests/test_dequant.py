"""Torch dequantization kernels against gguf's numpy reference, bit for bit."""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import structlog
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from ggufswap.runtime.errors import UnsupportedTypeError
from ggufswap.runtime.kernels import _compiled
from ggufswap.runtime.kernels import dequant as dq
from ggufswap.runtime.kernels._ik import IK_KERNELS
from ggufswap.runtime.kernels._ik_interleaved import INTERLEAVED
from ggufswap.runtime.kernels.dequant import KERNEL_TYPES, dequantize, has_kernel
from ggufswap.shards._synth import synth_ik_tensor
from ggufswap.shards.ggml_types import GGMLType

T = GGMLQuantizationType


@pytest.fixture(autouse=True, params=["compiled", "torch"])
def cpu_kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs with the compiled decoder (where the install built it) and with the torch
    kernels alone: both must equal gguf.quants bit for bit."""
    if request.param == "compiled":
        if not _compiled.available():
            pytest.skip("the compiled kernels were not built (no C compiler at install)")
        yield request.param
        return
    with _compiled.disabled():
        yield request.param


# ik_llama.cpp's types (and Q1_0) have no gguf reference: tests/test_ik_types.py checks them.
KERNEL_LIST = sorted(KERNEL_TYPES - IK_KERNELS.keys() - INTERLEAVED.keys(), key=lambda t: t.name)
# Types gguf can quantize, so real-looking data can be round-tripped through them.
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# Byte offsets of each block's fp16 scale fields.
F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ1_S: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
}
# Issue 13's types (grids, ternary, FP4): no fp16 field at a fixed offset for IQ1_M and none at
# all for MXFP4/NVFP4, whose scale bytes random_bytes constrains itself.
IQ_TYPES = [
    T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
    T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4,
]  # fmt: skip


def random_bytes(
    ggml_type: GGMLQuantizationType, ne: tuple[int, ...], seed: int, *, finite: bool = True
) -> np.ndarray:
    """Random GGUF bytes for a tensor of shape ``ne``, as ``[rows, row_bytes]`` uint8."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rows = math.prod(ne[1:])
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, ne[0] // block_size * type_size), dtype=np.uint8)
    if finite:
        blocks = data.reshape(-1, type_size)
        for off in F16_FIELDS.get(ggml_type, ()):
            scales = rng.uniform(-4.0, 4.0, size=(blocks.shape[0], 1)).astype(np.float16)
            scales[::7] = 0.0  # exact zeros exercise signed-zero products
            blocks[:, off : off + 2] = scales.view(np.uint8)
        if ggml_type == T.IQ1_M:
            # the fp16 d is the top nibbles of the four scale words at 48 (bits 0-3 first)
            d = rng.uniform(-4.0, 4.0, size=blocks.shape[0]).astype(np.float16).view(np.uint16)
            d[::7] = 0
            for i, byte in enumerate((49, 51, 53, 55)):
                nibble = ((d >> (4 * i)) & 0x0F).astype(np.uint8)
                blocks[:, byte] = (blocks[:, byte] & 0x0F) | (nibble << 4)
        if ggml_type == T.MXFP4:
            # E8M0 scales up to 2**124, below where gguf's largest codes overflow to inf
            blocks[:, 0] = rng.integers(0, 253, size=blocks.shape[0], dtype=np.uint8)
        if ggml_type in (T.F16, T.BF16, T.F32):
            floats = rng.standard_normal(size=(rows, ne[0])).astype(np.float32)
            data = quants.quantize(floats, ggml_type).view(np.uint8).reshape(rows, -1)
    return data


def reference(
    data: np.ndarray, ggml_type: GGMLQuantizationType, ne: tuple[int, ...]
) -> torch.Tensor:
    """gguf's dequantization of ``data``, in the logical torch shape."""
    with np.errstate(invalid="ignore", over="ignore"):
        values = quants.dequantize(data, ggml_type)
    ref = np.ascontiguousarray(values, dtype=np.float32)
    return torch.from_numpy(ref).reshape(tuple(reversed(ne)))


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor, *, allow_nan: bool = False) -> None:
    """Equal float32 bit patterns everywhere (NaN payloads aside where both are NaN)."""
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    both_nan = torch.isnan(ours) & torch.isnan(ref)
    if not allow_nan:
        assert not bool(both_nan.any()), "finite input produced NaN"
    same = (ours.view(torch.int32) == ref.view(torch.int32)) | both_nan
    bad = (~same).nonzero()
    assert bad.numel() == 0, (
        f"{bad.shape[0]} elements differ, first at {bad[0].tolist()}: "
        f"{ours[tuple(bad[0])].item()!r} != {ref[tuple(bad[0])].item()!r}"
    )


def run(
    data: np.ndarray,
    ggml_type: GGMLQuantizationType,
    ne: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    strict: bool = False,
) -> torch.Tensor:
    """Our dequantization of ``data`` (a private copy, so the test owns the bytes)."""
    raw = torch.from_numpy(data.reshape(-1).copy())
    return dequantize(raw, ggml_type, ne, dtype=dtype, strict=strict)


@pytest.mark.parametrize("ggml_type", KERNEL_LIST, ids=lambda t: t.name)
def test_random_blocks_match_gguf_bit_for_bit(ggml_type: GGMLQuantizationType) -> None:
    """Random blocks with finite scales dequantize to exactly gguf's float32 bits."""
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    ne = (block_size * 5, 7)
    data = random_bytes(ggml_type, ne, seed=1)
    assert_same_bits(run(data, ggml_type, ne), reference(data, ggml_type, ne))


@pytest.mark.parametrize("ggml_type", KERNEL_LIST, ids=lambda t: t.name)
def test_unconstrained_bytes_match_gguf_including_nan_and_inf(
    ggml_type: GGMLQuantizationType,
) -> None:
    """Fully random bytes (inf/NaN scales included) give gguf's bits, NaN exactly where gguf's."""
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    ne = (block_size * 4, 64)
    data = random_bytes(ggml_type, ne, seed=2, finite=False)
    assert_same_bits(run(data, ggml_type, ne), reference(data, ggml_type, ne), allow_nan=True)


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_real_looking_data_matches_gguf(ggml_type: GGMLQuantizationType) -> None:
    """Weights quantized by gguf itself (heavy-tailed, per-row scales) dequantize identically."""
    rng = np.random.default_rng(3)
    rows, cols = 48, 512
    weights = rng.standard_t(df=4, size=(rows, cols)).astype(np.float32)
    weights *= rng.uniform(0.001, 0.2, size=(rows, 1)).astype(np.float32)
    weights[0, :32] = 0.0  # an all-zero block (d == 0)
    data = quants.quantize(weights, ggml_type).view(np.uint8).reshape(rows, -1)
    ne = (cols, rows)
    ours = run(data, ggml_type, ne)
    assert_same_bits(ours, reference(data, ggml_type, ne))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q5_0, T.Q6_K, T.F16])
def test_tensor_spanning_several_chunks_matches_gguf(ggml_type: GGMLQuantizationType) -> None:
    """A tensor larger than one CPU chunk (uneven last chunk) is exact across chunk seams."""
    cols = 4096
    rows = (dq._CPU_CHUNK_ELEMENTS * 5 // 2) // cols + 1
    ne = (cols, rows)
    data = random_bytes(ggml_type, ne, seed=4)
    assert_same_bits(run(data, ggml_type, ne), reference(data, ggml_type, ne))


@pytest.mark.parametrize("code", [-1, 127])
def test_every_fp16_scale_decodes_to_gguf_value(code: int) -> None:
    """Q8_0 blocks whose scales take all 65536 fp16 bit patterns (normal, subnormal, zero, inf,
    NaN) times a code decode to gguf's values."""
    blocks = np.zeros((1 << 16, 34), dtype=np.uint8)
    blocks[:, :2] = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = np.uint8(code & 0xFF)
    ne = (32, 1 << 16)
    assert_same_bits(run(blocks, T.Q8_0, ne), reference(blocks, T.Q8_0, ne), allow_nan=True)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_large_result_on_any_thread_count_matches_gguf(
    ggml_type: GGMLQuantizationType, threads: int
) -> None:
    """A result of several huge pages (not a whole number of them) decoded by 1-3 threads, each
    taking the next piece, has gguf's bits."""
    ne = (4096, 1100)  # 17.2 MiB of float32: 8.6 huge pages, 9 pieces
    data = random_bytes(ggml_type, ne, seed=21)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = run(data, ggml_type, ne)
    finally:
        torch.set_num_threads(before)
    assert_same_bits(ours, reference(data, ggml_type, ne))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q6_K, GGMLType.IQ4_KS], ids=lambda t: t.name)
def test_compiled_decoder_pieces_of_any_size_give_the_same_bits(
    cpu_kernels: str, ggml_type: GGMLType
) -> None:
    """The compiled decoder's threads may take any number of blocks at a time (mid-row for a type
    with a row header): every piece size and thread count writes the same values."""
    if cpu_kernels != "compiled":
        pytest.skip("the compiled decoder's own work split")
    ne = (512, 37)
    if ggml_type == GGMLType.IQ4_KS:
        data = synth_ik_tensor(np.random.default_rng(22), ggml_type, ne, std=1.0).reshape(-1)
    else:
        data = random_bytes(GGMLQuantizationType(int(ggml_type)), ne, seed=22).reshape(-1)
    raw = torch.from_numpy(data.copy())
    expected = dequantize(raw, ggml_type, ne).reshape(-1)
    kernels, block = _compiled.module(), _compiled.module().block_size(int(ggml_type))
    for threads, piece in [(1, 1), (2, 1), (3, 5), (4, 7), (2, 3 * ne[0] // block - 1), (8, 10**6)]:
        out = torch.full_like(expected, float("nan"))
        kernels.decode(
            raw.data_ptr(), int(ggml_type), out.numel(), out.data_ptr(), threads, ne[0], piece
        )
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32)), (threads, piece)


def test_large_cpu_result_is_memory_of_its_own() -> None:
    """A result past the mapped-allocation size starts on a huge-page boundary, shares memory
    with no other live result, and stays valid, exact and writable after the other is gone."""
    ne = (4096, 300)  # 4.7 MiB of float32
    data = random_bytes(T.Q8_0, ne, seed=23)
    first, second = run(data, T.Q8_0, ne), run(data, T.Q8_0, ne)
    assert first.numel() * 4 >= dq._MAPPED_MIN_BYTES
    if dq._MADV_HUGEPAGE is not None:
        assert first.data_ptr() % dq._HUGE_PAGE == 0
    ref = reference(data, T.Q8_0, ne)
    second.zero_()  # a write to the other result leaves this one alone
    assert_same_bits(first, ref)
    del second
    gc.collect()
    assert_same_bits(first, ref)
    first.zero_()  # writable
    assert not bool(first.any())


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_1, T.Q2_K])
def test_scale_groups_of_chunks_are_exact_across_seams(
    ggml_type: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With scales computed two chunks at a time, a five-chunk tensor is still exact."""
    monkeypatch.setattr(dq, "_CHUNKS_PER_SCALE_GROUP", 2)
    cols = 4096
    ne = (cols, dq._CPU_CHUNK_ELEMENTS * 9 // 2 // cols + 1)
    data = random_bytes(ggml_type, ne, seed=14)
    assert_same_bits(run(data, ggml_type, ne), reference(data, ggml_type, ne))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0, T.BF16])
def test_half_output_is_the_rounded_float32_result(
    ggml_type: GGMLQuantizationType, dtype: torch.dtype
) -> None:
    """A bf16/f16 result equals the float32 result converted afterwards, across chunks."""
    cols = 2048
    ne = (cols, dq._CPU_CHUNK_ELEMENTS // cols + 3)
    data = random_bytes(ggml_type, ne, seed=5)
    ours = run(data, ggml_type, ne, dtype=dtype)
    assert ours.dtype == dtype
    assert torch.equal(
        ours.view(torch.int16), reference(data, ggml_type, ne).to(dtype).view(torch.int16)
    )


@settings(max_examples=40, deadline=None)
@given(
    ggml_type=st.sampled_from(KERNEL_LIST),
    blocks_per_row=st.integers(1, 4),
    rows=st.integers(1, 6),
    planes=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_shape_matches_gguf(
    ggml_type: GGMLQuantizationType, blocks_per_row: int, rows: int, planes: int, seed: int
) -> None:
    """For every kernel type and 3-D shape, the result has shape reversed(ne) and gguf's bits."""
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    ne = (block_size * blocks_per_row, rows, planes)
    data = random_bytes(ggml_type, ne, seed=seed)
    ours = run(data, ggml_type, ne)
    assert ours.shape == (planes, rows, block_size * blocks_per_row)
    assert_same_bits(ours, reference(data, ggml_type, ne))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_buffer_is_filled_in_place(dtype: torch.dtype) -> None:
    """With out=, the given buffer is filled with the same values and returned itself."""
    ne = (256, 9)
    data = random_bytes(T.Q4_K, ne, seed=11)
    out = torch.full((9, 256), 7.0, dtype=dtype)
    raw = torch.from_numpy(data.reshape(-1).copy())
    result = dequantize(raw, T.Q4_K, ne, dtype=dtype, out=out)
    assert result is out
    assert torch.equal(out, reference(data, T.Q4_K, ne).to(dtype))


def test_out_buffer_of_wrong_shape_and_dtype_is_refused() -> None:
    """An out= buffer that does not fit is refused, listing every mismatch."""
    raw = torch.zeros(34 * 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"shape \(4, 32\).*dtype torch\.float16"):
        dequantize(raw, T.Q8_0, (64, 2), out=torch.empty(4, 32, dtype=torch.float16))


def test_concurrent_calls_from_two_threads_stay_exact() -> None:
    """Two threads dequantizing different tensors at once each get gguf's bits."""
    ne = (4096, 300)  # more than one CPU chunk, so scratch is reused while the other runs
    cases = [
        (T.Q4_K, random_bytes(T.Q4_K, ne, seed=12)),
        (T.Q6_K, random_bytes(T.Q6_K, ne, seed=13)),
    ]
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def work(i: int) -> None:
        ggml_type, data = cases[i]
        results[i].extend(run(data, ggml_type, ne) for _ in range(3))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "dequantize thread did not finish"
    for i, (ggml_type, data) in enumerate(cases):
        ref = reference(data, ggml_type, ne)
        assert len(results[i]) == 3
        for ours in results[i]:
            assert_same_bits(ours, ref)


def test_unaligned_raw_view_is_read_correctly() -> None:
    """Bytes that start at an odd offset inside a larger buffer still dequantize exactly."""
    ne = (256, 3)
    data = random_bytes(T.Q6_K, ne, seed=6)
    buf = torch.zeros(data.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(data.reshape(-1))
    assert_same_bits(dequantize(buf[1:], T.Q6_K, ne), reference(data, T.Q6_K, ne))


def test_strided_raw_bytes_are_read_correctly() -> None:
    """A non-contiguous 1-D byte view (every other byte) dequantizes like its contiguous copy."""
    ne = (64, 3)
    data = random_bytes(T.Q8_0, ne, seed=15)
    spread = torch.zeros(2 * data.size, dtype=torch.uint8)
    spread[::2] = torch.from_numpy(data.reshape(-1))
    assert_same_bits(dequantize(spread[::2], T.Q8_0, ne), reference(data, T.Q8_0, ne))


def test_result_does_not_alias_raw_bytes() -> None:
    """Overwriting the raw buffer afterwards leaves an F32 result unchanged."""
    raw = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8).copy())
    out = dequantize(raw, T.F32, (4, 2))
    raw.zero_()
    assert out.tolist() == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]


def test_wrong_byte_count_names_expected_and_found() -> None:
    """A byte count that does not match ne is refused with both figures in the message."""
    raw = torch.zeros(34 * 4 - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"needs 136 bytes, found 135 bytes"):
        dequantize(raw, T.Q8_0, (64, 2))


def test_exact_byte_count_is_accepted() -> None:
    """The paired case: exactly the expected bytes dequantize without complaint."""
    raw = torch.zeros(34 * 4, dtype=torch.uint8)
    assert dequantize(raw, T.Q8_0, (64, 2)).shape == (2, 64)


def test_row_not_multiple_of_block_is_refused() -> None:
    """ne[0] that is not a whole number of blocks is refused, naming the block size."""
    with pytest.raises(ValueError, match="block size 256"):
        dequantize(torch.zeros(210, dtype=torch.uint8), T.Q6_K, (128, 2))


def test_non_uint8_raw_is_refused() -> None:
    """Raw input must be 1-D uint8 bytes; anything else is refused with what was found."""
    with pytest.raises(ValueError, match=r"torch\.int8"):
        dequantize(torch.zeros(34, dtype=torch.int8), T.Q8_0, (32,))


def test_has_kernel_reports_the_kernel_set() -> None:
    """has_kernel is true for the listed kernel types and false for a type without one."""
    assert all(has_kernel(t) for t in (T.Q8_0, T.Q4_K, T.Q6_K, T.F16, T.IQ4_XS, *IQ_TYPES))
    assert not has_kernel(T.Q8_1)


def test_strict_mode_refuses_a_type_without_kernel() -> None:
    """strict=True raises UnsupportedTypeError naming the type and the supported ones."""
    ne = (256, 2)
    data = random_bytes(T.Q8_1, ne, seed=7, finite=False)
    with pytest.raises(UnsupportedTypeError, match=r"Q8_1 .*IQ2_XXS.*Q4_K"):
        run(data, T.Q8_1, ne, strict=True)


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_strict_mode_accepts_every_kernel_type(ggml_type: GGMLQuantizationType) -> None:
    """strict=True dequantizes issue 13's types (they have kernels now), with gguf's bits."""
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    ne = (block_size * 2, 3)
    data = random_bytes(ggml_type, ne, seed=16)
    assert_same_bits(run(data, ggml_type, ne, strict=True), reference(data, ggml_type, ne))


def test_fallback_matches_gguf_and_warns_once_per_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without strict, a kernel-less type is dequantized by gguf on the CPU, warned about once."""
    monkeypatch.delitem(dq.KERNELS, T.TQ2_0)  # every type gguf decodes has a kernel now
    dq._warned_types.discard(T.TQ2_0)
    ne = (256, 3)
    data = random_bytes(T.TQ2_0, ne, seed=8, finite=False)
    with structlog.testing.capture_logs() as logs:
        first = run(data, T.TQ2_0, ne)
        run(data, T.TQ2_0, ne)
    warnings = [e for e in logs if e["event"] == "dequant_cpu_fallback"]
    assert [w["ggml_type"] for w in warnings] == ["TQ2_0"]
    assert_same_bits(first, reference(data, T.TQ2_0, ne), allow_nan=True)


def test_fallback_honours_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback path returns the requested dtype in the logical shape."""
    monkeypatch.delitem(dq.KERNELS, T.TQ1_0)
    ne = (256, 2)
    data = random_bytes(T.TQ1_0, ne, seed=9, finite=False)
    out = run(data, T.TQ1_0, ne, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out.shape == (2, 256)


def _iq_shape(ggml_type: GGMLQuantizationType, kind: str) -> tuple[int, ...]:
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    if kind == "one-block":
        return (block_size,)
    if kind == "partial-chunk":  # many rows, fewer blocks than one CPU chunk holds
        return (block_size * 2, 301)
    cols = 4096  # several chunks, the last one partial
    return (cols, dq._CPU_CHUNK_ELEMENTS * 5 // 2 // cols + 1)


@pytest.mark.parametrize("kind", ["one-block", "partial-chunk", "several-chunks"])
@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_iq_types_match_gguf_on_every_chunking(ggml_type: GGMLQuantizationType, kind: str) -> None:
    """One block, a partial chunk and several chunks of issue 13's types: gguf's bits."""
    ne = _iq_shape(ggml_type, kind)
    data = random_bytes(ggml_type, ne, seed=17)
    assert_same_bits(run(data, ggml_type, ne), reference(data, ggml_type, ne))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_iq_types_fill_out_buffers_in_every_dtype(
    ggml_type: GGMLQuantizationType, dtype: torch.dtype
) -> None:
    """out= of issue 13's types is filled in place with the float32 result rounded to dtype."""
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    ne = (block_size * 3, dq._CPU_CHUNK_ELEMENTS // (block_size * 3) + 5)  # past one chunk
    data = random_bytes(ggml_type, ne, seed=18)
    out = torch.full(tuple(reversed(ne)), 7.0, dtype=dtype)
    raw = torch.from_numpy(data.reshape(-1).copy())
    assert dequantize(raw, ggml_type, ne, dtype=dtype, out=out) is out
    ref = reference(data, ggml_type, ne).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), ref.view(bits))


@pytest.mark.parametrize(
    "name", ["IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"], ids=str
)
def test_grid_tables_unpack_to_gguf_grids(name: str) -> None:
    """The kernels' grids, unpacked from gguf's hex tables in Python, equal gguf's numpy grids."""
    from ggufswap.runtime.kernels import _iq as _iq_kernels

    cls = getattr(quants, name)
    cls.init_grid()
    expected = np.asarray(cls.grid).reshape(cls.grid_shape)
    assert np.array_equal(np.array(_iq_kernels._grid_rows(cls), dtype=np.float32), expected)


def test_mxfp4_top_scale_byte_is_2_pow_127_and_overflows_as_gguf() -> None:
    """E8M0 0xFF (NaN in the OCP spec) decodes as gguf decodes it, 2**127, so 6 * 2 * 2**127
    and up overflow to inf; 0x00 and 0x01 decode to gguf's subnormal-range halves."""
    codes = np.arange(16, dtype=np.uint8)
    qs = (codes | (codes[::-1] << 4)).astype(np.uint8)
    data = np.stack([np.concatenate([[e], qs]).astype(np.uint8) for e in (0xFF, 0xFE, 0, 1)])
    ne = (32, 4)
    ours = run(data, T.MXFP4, ne)
    assert_same_bits(ours, reference(data, T.MXFP4, ne))
    assert ours[0, 1].item() == 2.0**127  # code 1: kvalue 1 (0.5 doubled) times 2**127
    # kvalues +-2 .. +-12 overflow: 12 of the 16 codes, in both nibbles
    assert torch.isinf(ours[0]).sum().item() == 24
    assert not torch.isinf(ours[2:]).any()  # 0x00, 0x01: tiny scales


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ggml_type", KERNEL_LIST, ids=lambda t: t.name)
def test_cuda_kernels_match_gguf(ggml_type: GGMLQuantizationType) -> None:
    """On a CUDA device the result stays on the device and has gguf's bits."""
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    ne = (block_size * 8, 33)
    data = random_bytes(ggml_type, ne, seed=10)
    raw = torch.from_numpy(data.reshape(-1).copy()).cuda()
    ours = dequantize(raw, ggml_type, ne)
    assert ours.device.type == "cuda"
    assert_same_bits(ours.cpu(), reference(data, ggml_type, ne))
