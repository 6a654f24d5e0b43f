"""ik_llama.cpp's quant types: the type table, and dequantization against ik's own ggml output."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from ggufbytes import TI, build, kv_str

from ggufswap.runtime import float_products
from ggufswap.runtime.errors import UnsupportedTypeError
from ggufswap.runtime.kernels import _compiled, dequant, qmatmul
from ggufswap.runtime.kernels._ik import IK_KERNELS
from ggufswap.runtime.kernels._ik_interleaved import INTERLEAVED
from ggufswap.shards import TensorLayoutError, TruncatedError, read_header
from ggufswap.shards.ggml_types import (
    LAYOUTS,
    GGMLType,
    Origin,
    ggml_type,
    row_nbytes,
    tensor_nbytes,
)

GOLDEN = Path(__file__).parent / "fixtures" / "ik_golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
HEADER = struct.Struct("<8sIi16siiQIIII")  # crosscheck/ik/golden.c's 64-byte header


def read_golden(path: Path) -> dict[str, Any]:
    """One golden file (the layout of crosscheck/ik/make_golden.py's read_golden)."""
    data = path.read_bytes()
    magic, hsize, code, name, n_per_row, rows, row_size, flags, blck, tsize, meta = (
        HEADER.unpack_from(data)
    )
    assert magic == b"IKGOLD1\0", f"{path}: not a golden file"
    assert hsize == HEADER.size, f"{path}: header size {hsize}"
    qbytes = rows * row_size
    return {
        "code": code,
        "name": name.rstrip(b"\0").decode(),
        "n_per_row": n_per_row,
        "rows": rows,
        "row_size": row_size,
        "blck_size": blck,
        "type_size": tsize,
        "row_meta_size": meta,
        "interleave": flags >> 8 & 0xFF,
        "quant": np.frombuffer(data, dtype=np.uint8, count=qbytes, offset=hsize),
        "dequant": np.frombuffer(data, dtype="<f4", offset=hsize + qbytes).reshape(rows, -1),
    }


GOLDEN_TYPES = sorted(MANIFEST["types"])
# Golden files whose type has no decoder (none at present; a new golden type starts here).
UNDECODED: set[str] = set()
DECODED_TYPES = [name for name in GOLDEN_TYPES if name not in UNDECODED]


def _golden(name: str) -> dict[str, Any]:
    return read_golden(GOLDEN / MANIFEST["types"][name]["file"])


@pytest.fixture(params=["compiled", "torch"])
def cpu_kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """With the compiled decoder (where the install built it; it handles COMPILED_IK) and with the
    torch kernels alone: both must give ik's floats bit for bit."""
    if request.param == "compiled":
        if not _compiled.available():
            pytest.skip("the compiled kernels were not built (no C compiler at install)")
        yield request.param
        return
    with _compiled.disabled():
        yield request.param


COMPILED_IK = (
    GGMLType.IQ4_KS,
    GGMLType.IQ4_KSS,
    GGMLType.IQ4_K,
    GGMLType.IQ5_K,
    GGMLType.IQ2_KS,
    GGMLType.IQ3_KS,
)


@pytest.mark.parametrize("t", COMPILED_IK, ids=lambda t: t.name)
def test_compiled_decoder_handles_ik_types(t: GGMLType) -> None:
    """The compiled decoder takes these ik types (row header included) where it was built, so
    the golden tests run them under both kernels."""
    if not _compiled.available():
        pytest.skip("the compiled kernels were not built (no C compiler at install)")
    assert t in _compiled.types()
    assert _compiled.handles(t, 512, torch.device("cpu"))


def test_mainline_codes_match_gguf() -> None:
    """Every gguf type is in the table under the same code and name, with gguf's sizes, and its
    member compares and hashes equal to gguf's."""
    for t, (block, size) in gguf.GGML_QUANT_SIZES.items():
        ours = ggml_type(int(t))
        assert ours is not None
        assert ours.name == t.name
        assert (LAYOUTS[ours].block_size, LAYOUTS[ours].type_size) == (block, size)
        assert LAYOUTS[ours].row_meta == 0
        assert ours == t
        assert hash(ours) == hash(t)
        assert {t: 1}[ours] == 1


@pytest.mark.parametrize("name", GOLDEN_TYPES)
def test_golden_layout_matches_table(name: str) -> None:
    """The table's block size, block bytes and row header agree with ik's ggml for each type."""
    g = _golden(name)
    t = ggml_type(g["code"])
    assert t is not None
    layout = LAYOUTS[t]
    assert (layout.block_size, layout.type_size, layout.row_meta) == (
        g["blck_size"],
        g["type_size"],
        g["row_meta_size"],
    )
    assert row_nbytes(t, g["n_per_row"]) == g["row_size"]
    assert tensor_nbytes(t, (g["n_per_row"], g["rows"])) == g["quant"].size


def test_undecoded_golden_types() -> None:
    """Exactly the golden types listed as undecoded lack a kernel (a new kernel moves its type
    out of the list, and so under the bit-for-bit tests)."""
    assert UNDECODED <= set(GOLDEN_TYPES)
    for name in GOLDEN_TYPES:
        t = ggml_type(MANIFEST["types"][name]["code"])
        assert t is not None
        assert dequant.has_kernel(t) == (name not in UNDECODED), name


@pytest.mark.parametrize("name", DECODED_TYPES)
def test_golden_dequantize_bitwise(name: str, cpu_kernels: str) -> None:
    """Dequantization equals ik_llama.cpp's float output bit for bit."""
    g = _golden(name)
    t = ggml_type(g["code"])
    assert t in IK_KERNELS or t in INTERLEAVED
    assert dequant.has_kernel(t)
    raw = torch.from_numpy(g["quant"].copy())
    got = dequant.dequantize(raw, t, (g["n_per_row"], g["rows"]), strict=True)
    want = torch.from_numpy(g["dequant"].copy())
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert bad.numel() == 0, (
        f"{name}: {bad.shape[0]} of {want.numel()} values differ, first at {bad[0].tolist()}: "
        f"{got[tuple(bad[0])].item()!r} != {want[tuple(bad[0])].item()!r}"
    )


@pytest.mark.parametrize("name", DECODED_TYPES)
def test_golden_dequantize_rows_independent(name: str, cpu_kernels: str) -> None:
    """Rows (row-interleaved types: groups of rows) decoded one at a time, into a given ``out``
    and as bfloat16, match the whole tensor."""
    g = _golden(name)
    t = ggml_type(g["code"])
    assert t is not None
    want = torch.from_numpy(g["dequant"].copy())
    step = max(g["interleave"], 1)
    for r in range(0, g["rows"], step):
        part = g["quant"][r * g["row_size"] : (r + step) * g["row_size"]]
        rows = torch.from_numpy(part.copy())
        out = torch.empty(step, g["n_per_row"])
        dequant.dequantize(rows, t, (g["n_per_row"], step), out=out)
        assert torch.equal(out.view(torch.int32), want[r : r + step].view(torch.int32))
        half = dequant.dequantize(rows, t, (g["n_per_row"], step), dtype=torch.bfloat16)
        assert torch.equal(half, want[r : r + step].to(torch.bfloat16))


@pytest.mark.parametrize("name", ["q4_0_r8", "iq4_ks_r4", "q6_k_r4"])
def test_interleaved_rows_must_fill_groups(name: str) -> None:
    """A row-interleaved tensor whose row count is not a multiple of its interleave is refused,
    naming the type (a group is the unit ik stores)."""
    g = _golden(name)
    t = ggml_type(g["code"])
    assert t is not None
    rows = g["interleave"] + 1
    raw = torch.from_numpy(g["quant"][: rows * g["row_size"]].copy())
    with pytest.raises(ValueError, match=f"{t.name} stores rows in groups of {g['interleave']}"):
        dequant.dequantize(raw, t, (g["n_per_row"], rows))


@pytest.mark.parametrize("name", ["iq4_ks", "iq1_bn", "q6_0", "iq2_kt"])
def test_truncated_buffer_refused(name: str) -> None:
    """A buffer one byte short of the tensor (or one byte long) is refused, naming the type."""
    g = _golden(name)
    t = ggml_type(g["code"])
    assert t is not None
    raw = torch.from_numpy(g["quant"].copy())
    for bad in (raw[:-1], torch.cat((raw, raw[:1]))):
        with pytest.raises(ValueError, match=t.name):
            dequant.dequantize(bad, t, (g["n_per_row"], g["rows"]))


def test_row_header_counts_in_sizes() -> None:
    """Types with a per-row header count it once per row, not per block."""
    assert row_nbytes(GGMLType.IQ4_KS, 512) == 4 + 2 * 136
    assert tensor_nbytes(GGMLType.IQ1_KT, (1024, 3, 2)) == 6 * (4 + 4 * 56)
    assert tensor_nbytes(GGMLType.Q6_0, (64, 5)) == 5 * 2 * 26
    assert LAYOUTS[GGMLType.IQ2_KS].origin is Origin.IK


def test_unknown_code_refused() -> None:
    """A code neither mainline nor ik_llama.cpp defines is refused, with its number."""
    assert ggml_type(4) is None
    assert ggml_type(9999) is None
    with pytest.raises(UnsupportedTypeError, match="9999"):
        dequant.dequantize(torch.zeros(4, dtype=torch.uint8), 9999, (4,))  # type: ignore[arg-type]


# --- the reader --------------------------------------------------------------------------------

ARCH = kv_str("general.architecture", "llama")


@pytest.mark.parametrize("name", ["iq1_kt", "iq4_ks", "q6_0", "iq2_bn"])
def test_reader_accepts_ik_types(gguf_file: Callable[..., Path], name: str) -> None:
    """A shard holding an ik_llama.cpp type reads, with the row header counted in its size."""
    g = _golden(name)
    ne = (g["n_per_row"], g["rows"])
    tensors = [TI("w", ne, ggml_type=g["code"], data=g["quant"].tobytes()), TI("n", (32,))]
    header = read_header(gguf_file(build(kvs=[ARCH], tensors=tensors)))
    rec = header.tensors[0]
    assert rec.ggml_type is ggml_type(g["code"])
    assert rec.nbytes == g["quant"].size
    assert header.tensors[1].offset >= rec.end


def test_reader_refuses_truncated_ik_tensor(gguf_file: Callable[..., Path]) -> None:
    """An IQ1_KT tensor cut short of its last row header is refused as truncated."""
    g = _golden("iq1_kt")
    tensors = [TI("w", (g["n_per_row"], g["rows"]), ggml_type=g["code"], data=g["quant"].tobytes())]
    whole = build(kvs=[ARCH], tensors=tensors).data
    end = read_header(gguf_file(whole)).tensors[0].end
    path = gguf_file(whole[: end - 1], "cut.gguf")
    with pytest.raises(TruncatedError) as info:
        read_header(path)
    assert str(path) in str(info.value)


def test_reader_refuses_unknown_code(gguf_file: Callable[..., Path]) -> None:
    """A code in neither table (159, past IQ1_KT) is refused, naming the file and the code."""
    tensors = [TI("w", (256,), ggml_type=159, data=bytes(64))]
    path = gguf_file(build(kvs=[ARCH], tensors=tensors))
    with pytest.raises(TensorLayoutError) as info:
        read_header(path)
    assert str(path) in str(info.value)
    assert "w: unknown ggml type 159" in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", DECODED_TYPES)
def test_golden_dequantize_cuda(name: str) -> None:
    """The same kernels on a CUDA device give ik_llama.cpp's CPU floats bit for bit."""
    g = _golden(name)
    t = ggml_type(g["code"])
    assert t is not None
    raw = torch.from_numpy(g["quant"].copy()).cuda()
    got = dequant.dequantize(raw, t, (g["n_per_row"], g["rows"]), strict=True).cpu()
    want = torch.from_numpy(g["dequant"].copy())
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


def test_docs_list_every_type_with_its_layout() -> None:
    """docs/types.md has one row per type of the table, with its code, layout and, for the types
    with golden files, that source of truth."""
    docs = (Path(__file__).parent.parent / "docs" / "types.md").read_text()
    rows = {}
    for line in docs.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit():
            rows[int(cells[0])] = cells
    assert set(rows) == {int(t) for t in LAYOUTS}
    for t, layout in LAYOUTS.items():
        _code, name, origin, block, size, meta, source, _decoders = rows[int(t)]
        assert name == f"`{t.name}`"
        assert origin == layout.origin.value
        assert (int(block), int(size)) == (layout.block_size, layout.type_size)
        assert meta == (f"{layout.row_meta} B" if layout.row_meta else "—")
        if t in IK_KERNELS or t in INTERLEAVED:
            assert source == "golden files"
    assert MANIFEST["commit"] in docs


@pytest.mark.parametrize(
    "name",
    [
        "q4_0_r8",
        "iq4_ks_r4",
        "iq1_s_r4",
        "q8_k_r8",
        "iq4_ks",
        "iq4_kss",
        "iq4_k",
        "iq5_k",
        "iq2_ks",
        "iq3_ks",
    ],
)
def test_native_product_of_ik_matrix(
    monkeypatch: pytest.MonkeyPatch, name: str, cpu_kernels: str
) -> None:
    """Native storage's float kernels multiply an ik-typed matrix (IQ4_KS: the compiled fused
    product where built) as its decoded values do; a row-interleaved one is decoded in bands of
    whole groups (here 16 rows per band of a 32-row matrix)."""
    g = _golden(name)
    t = ggml_type(g["code"])
    assert t is not None
    quant = np.concatenate((g["quant"], g["quant"]))
    rows, cols = 2 * g["rows"], g["n_per_row"]
    raw = torch.from_numpy(quant)
    w = dequant.dequantize(raw, t, (cols, rows), strict=True)
    half = torch.from_numpy(g["dequant"].copy())
    assert torch.equal(w[: g["rows"]], half)
    assert torch.equal(w[g["rows"] :], half)
    monkeypatch.setattr(qmatmul, "SCRATCH_BYTES", 1)  # the smallest band: 16 rows
    matrix = qmatmul.QuantizedMatrix(raw, t, (rows, cols), "blk.0.ffn_up.weight")
    ilv = max(g["interleave"], 1)
    assert torch.equal(matrix.decode(torch.float32, ilv, 2 * ilv), w[ilv : 2 * ilv])
    for n in (1, 16):
        x = torch.randn(n, cols)
        with float_products():  # the float kernels (ggml's: tests/test_ggml_golden.py)
            y = matrix.linear(x, dtype=torch.float32)
        assert torch.allclose(y, x @ w.T, rtol=1e-5, atol=1e-4)
