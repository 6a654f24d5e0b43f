"""The reference K-quant and IQ4 quantizers (``shards.kquants``) against bytes ggml wrote."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from ggufswap.shards import _synth, kquants

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "kquant_golden"
# Both implementations: the compiled one (shards/csrc/kquants.c) and the numpy one.
IMPLS = [
    pytest.param(
        True,
        id="compiled",
        marks=pytest.mark.skipif(
            not kquants.compiled_available(), reason="ggufswap.shards._kquants was not built"
        ),
    ),
    pytest.param(False, id="numpy"),
]


def _manifest() -> dict[str, object]:
    return dict(json.loads((GOLDEN / "manifest.json").read_text()))


def _source() -> np.ndarray:
    m = _manifest()
    data = np.fromfile(GOLDEN / "source.f32", dtype="<f4")
    return data.reshape(int(str(m["rows"])), int(str(m["n_per_row"])))


def _golden(ggml_type: Q) -> np.ndarray:
    return np.fromfile(GOLDEN / f"{ggml_type.name.lower()}.bin", dtype=np.uint8)


def _differing_rows(ours: np.ndarray, ggml: np.ndarray, ggml_type: Q) -> list[str]:
    """Descriptions of the source rows whose blocks differ (for the failure message)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    bad = np.nonzero(np.any(ours.reshape(-1, type_size) != ggml.reshape(-1, type_size), axis=1))[0]
    m = _manifest()
    descriptions = list(m["row_descriptions"])  # type: ignore[call-overload]
    n_per_row = int(str(m["n_per_row"]))
    return sorted({descriptions[b * block_size // n_per_row] for b in bad})


def test_golden_fixture_is_intact() -> None:
    """Every fixture file has the size and sha256 the manifest recorded when ggml wrote it."""
    files = _manifest()["files"]
    assert isinstance(files, dict)
    assert set(files) == {"source.f32", *(f"{t.name.lower()}.bin" for t in kquants.TYPES)}
    for name, entry in files.items():
        data = (GOLDEN / name).read_bytes()
        assert len(data) == entry["bytes"], name
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name


@pytest.mark.parametrize("compiled", IMPLS)
@pytest.mark.parametrize("ggml_type", kquants.TYPES, ids=lambda t: t.name)
def test_bytes_match_ggml_quantize_chunk(ggml_type: Q, compiled: bool) -> None:
    """Quantizing the golden rows gives exactly the bytes ggml_quantize_chunk wrote for them."""
    ours = kquants.quantize(_source(), ggml_type, compiled=compiled)
    ggml = _golden(ggml_type)
    assert ours.dtype == np.uint8
    assert ours.shape == ggml.shape
    assert not _differing_rows(ours, ggml, ggml_type)
    assert bytes(ours) == bytes(ggml)


@pytest.mark.parametrize("ggml_type", kquants.TYPES, ids=lambda t: t.name)
def test_chunked_passes_give_the_same_bytes(ggml_type: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantizing in passes of one block at a time writes the same bytes as one pass."""
    monkeypatch.setattr(kquants, "_CHUNK_ELEMENTS", 1)
    source = _source()[:4]
    ggml = _golden(ggml_type)[: kquants.quantize(source, ggml_type, compiled=False).size]
    assert bytes(kquants.quantize(source, ggml_type, compiled=False)) == bytes(ggml)


@pytest.mark.parametrize("ggml_type", kquants.TYPES, ids=lambda t: t.name)
def test_requantizing_dequantized_values_is_stable(ggml_type: Q) -> None:
    """Dequantized ggml bytes quantize again to values within a step of themselves."""
    values = np.asarray(dequantize(_golden(ggml_type), ggml_type), dtype=np.float32)
    again = np.asarray(
        dequantize(kquants.quantize(values, ggml_type), ggml_type), dtype=np.float32
    ).reshape(values.shape)
    assert np.all(np.isfinite(again))
    scale = float(np.sqrt(np.mean(values**2)))
    rel = float(np.sqrt(np.mean((again - values) ** 2))) / scale
    assert rel < 0.1, rel


def test_encode_floats_uses_the_reference_quantizers() -> None:
    """_synth.encode_floats quantizes the K-quant and IQ4 types through kquants."""
    rows = _source()[:3]
    for ggml_type in kquants.TYPES:
        assert ggml_type in _synth.QUANTIZABLE_TYPES
        assert bytes(_synth.encode_floats(rows, ggml_type)) == bytes(
            _golden(ggml_type)[: kquants.quantize(rows, ggml_type).size]
        )
    assert not set(kquants.TYPES) & set(_synth.WRITABLE_TYPES) - set(_synth.SYNTHESIZED_TYPES)


def test_bad_requests_are_refused_with_the_reason() -> None:
    """A type without a quantizer, or a size that is not whole blocks, raises ValueError."""
    with pytest.raises(ValueError, match=r"no reference quantizer for IQ3_S; .*Q4_K"):
        kquants.quantize(np.zeros(256, dtype=np.float32), Q.IQ3_S)
    with pytest.raises(ValueError, match=r"Q4_K: 300 values .* block size 256"):
        kquants.quantize(np.zeros(300, dtype=np.float32), Q.Q4_K)


def _random_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """``[13, n]`` float32 rows of the kinds a quantizer gets wrong: zeros, tiny, huge, constant,
    sparse, one sign, denormal, fp16-overflowing, outliers, values on a grid."""
    normal = rng.standard_normal(n).astype(np.float32)
    sparse = np.zeros(n, dtype=np.float32)
    sparse[rng.choice(n, size=7, replace=False)] = rng.standard_normal(7)
    outliers = normal * np.float32(0.02)
    outliers[rng.choice(n, size=3, replace=False)] = [40.0, -25.0, 3.0]
    rows = [
        normal * np.float32(0.02),
        np.zeros(n),
        normal * np.float32(1e-7),
        normal * np.float32(1e-30),  # below GROUP_MAX_EPS: zero blocks
        normal * np.float32(1e-40),  # float32 denormals
        normal * np.float32(1e4),
        normal * np.float32(1e6),  # fp16 scales overflow to inf
        np.full(n, -0.75),
        sparse,
        np.abs(normal) + np.float32(2),
        -np.abs(normal),
        outliers,
        np.round(normal * 7) / np.float32(7),
    ]
    return np.stack([np.asarray(r, dtype=np.float32) for r in rows])


@pytest.mark.skipif(not kquants.compiled_available(), reason="_kquants was not built")
@pytest.mark.parametrize("ggml_type", kquants.TYPES, ids=lambda t: t.name)
def test_compiled_and_numpy_write_the_same_bytes(ggml_type: Q) -> None:
    """The compiled quantizers (one thread or three) and the numpy ones agree byte for byte on
    random data with zeros, tiny, huge, denormal, constant and sparse rows, and on rows holding
    NaN and infinities."""
    rng = np.random.default_rng(int(ggml_type))
    rows = _random_rows(rng, 1024)
    special = rows[:4].copy()
    special[0, 5] = np.nan
    special[1, 300] = np.inf
    special[2, 700] = -np.inf
    special[3, 1:40] = np.nan
    for values in (rows, special, rng.standard_normal((64, 2048)).astype(np.float32)):
        numpy_bytes = kquants.quantize(values, ggml_type, compiled=False)
        compiled_bytes = kquants.quantize(values, ggml_type, compiled=True, threads=1)
        assert compiled_bytes.shape == numpy_bytes.shape
        threaded = kquants.quantize(values, ggml_type, compiled=True, threads=3)
        assert bytes(threaded) == bytes(compiled_bytes)
        _block, type_size = GGML_QUANT_SIZES[ggml_type]
        bad = np.nonzero(
            np.any(compiled_bytes.reshape(-1, type_size) != numpy_bytes.reshape(-1, type_size), 1)
        )[0]
        assert bad.size == 0, f"{bad.size} blocks differ, first {bad[:8].tolist()}"


def test_compiled_quantizer_checks_its_buffers() -> None:
    """The compiled entry point refuses partial blocks and a wrongly sized output buffer."""
    if not kquants.compiled_available():
        with pytest.raises(RuntimeError, match="Q4_K: the compiled quantizers"):
            kquants.quantize(np.zeros(256, dtype=np.float32), Q.Q4_K, compiled=True)
        return
    from ggufswap.shards import _kquants  # type: ignore[attr-defined]

    assert set(_kquants.types()) == {int(t) for t in kquants.TYPES}
    with pytest.raises(ValueError, match="whole blocks of 256"):
        _kquants.quantize(int(Q.Q4_K), np.zeros(300, dtype=np.float32), bytearray(144))
    with pytest.raises(ValueError, match="dst holds 100 bytes, 1 blocks need 144"):
        _kquants.quantize(int(Q.Q4_K), np.zeros(256, dtype=np.float32), bytearray(100))
    with pytest.raises(ValueError, match="no compiled quantizer for GGML type 8"):
        _kquants.quantize(8, np.zeros(32, dtype=np.float32), bytearray(34))


@pytest.mark.process
def test_numpy_fallback_when_the_extension_is_missing() -> None:
    """Without the compiled extension (an install with no C compiler), kquants still imports,
    says so, and quantizes with numpy to ggml's golden bytes."""
    script = (
        "import sys\n"
        "sys.modules['ggufswap.shards._kquants'] = None  # the import fails as if never built\n"
        "import numpy as np\n"
        "from gguf import GGMLQuantizationType as Q\n"
        "from ggufswap.shards import kquants\n"
        "assert not kquants.compiled_available() and not kquants.COMPILED_TYPES\n"
        f"src = np.fromfile({str(GOLDEN / 'source.f32')!r}, dtype='<f4')[:1024]\n"
        "sys.stdout.write(bytes(kquants.quantize(src, Q.Q4_K)).hex())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert bytes.fromhex(done.stdout) == bytes(_golden(Q.Q4_K)[: 4 * 144])
