"""The reference K-quant and IQ4 quantizers (``shards.kquants``) against bytes ggml wrote."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from ggufswap.shards import _synth, kquants

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "kquant_golden"


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


@pytest.mark.parametrize("ggml_type", kquants.TYPES, ids=lambda t: t.name)
def test_bytes_match_ggml_quantize_chunk(ggml_type: Q) -> None:
    """Quantizing the golden rows gives exactly the bytes ggml_quantize_chunk wrote for them."""
    ours = kquants.quantize(_source(), ggml_type)
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
    ggml = _golden(ggml_type)[: kquants.quantize(source, ggml_type).size]
    assert bytes(kquants.quantize(source, ggml_type)) == bytes(ggml)


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
