"""The sweep's PNG plot: a valid PNG when matplotlib is installed; without it, one clear line and
no failure (the sweep's results do not depend on it)."""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from ggufswap.sweep import SweepOptions, run_sweep
from ggufswap.sweep.plot import NO_MATPLOTLIB, PLOT_PNG, write_plot
from ggufswap.sweep.recipe import Recipe

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# matplotlib's font cache keeps the font files it read open for the process's life
FONTS_STAY_OPEN = pytest.mark.leaks_ok("matplotlib keeps its cached font files open")


def _record(unit: str, qtype: str, kld: float, ratio: float) -> dict[str, Any]:
    return {"unit": unit, "qtype": qtype, "metrics": {"kld_mean": kld, "ln_ppl_ratio": ratio}}


RECORDS = [
    _record("blk.10.ffn_gate.weight", "q4_0", 0.0025, 0.011),
    _record("blk.2.attn_q.weight", "q4_0", 0.0007, -0.002),
    _record("blk.2.attn_q.weight", "q8_0", 0.0, 0.0),  # a zero KLD on the log axis
    _record("all_ffn_up", "q4_K", 0.004, 0.02),
]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG whose every chunk's CRC is right and whose image data inflates;
    AssertionError otherwise."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path}: not a PNG signature"
    pos, chunks, idat = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in chunk {kind!r}"
        chunks.append(kind)
        if kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert chunks[0] == b"IHDR", chunks
    assert chunks[-1] == b"IEND", chunks
    width, height = struct.unpack(">II", data[16:24])
    assert len(zlib.decompress(idat)) > width * height, "image data does not cover the image"
    return width, height


@FONTS_STAY_OPEN
def test_plot_is_a_valid_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs `pip install 'ggufswap[plot]'`")
    path = tmp_path / "sub" / PLOT_PNG
    result = write_plot(RECORDS, path)
    assert result.path == path
    assert result.note == f"plot: {path}"
    width, height = png_size(path)
    assert width >= 300
    assert height >= 300
    assert not list(path.parent.glob(".*")), "no temp file left beside the plot"


def test_without_matplotlib_one_line_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = tmp_path / PLOT_PNG
    result = write_plot(RECORDS, path)
    assert result.path is None
    assert result.note == NO_MATPLOTLIB
    assert "\n" not in result.note
    assert "pip install" in result.note
    assert not path.exists()


def test_no_rounds_no_plot(tmp_path: Path) -> None:
    result = write_plot([], tmp_path / PLOT_PNG)
    assert result.path is None
    assert "no round" in result.note


@FONTS_STAY_OPEN
def test_sweep_writes_the_plot_or_says_why(tmp_path: Path) -> None:
    """A real sweep over the tiny model ends with the plot (or the note without matplotlib)."""
    from runtime_helpers import ModelDir
    from test_sweep import CHUNKS, CTX, english

    from ggufswap.shards import tiny_dense

    model = ModelDir.write(tmp_path / "model", tiny_dense())
    recipe = Recipe.from_document({"quants": ["q4_0"], "tensors": [{"match": r"^blk\.0\.attn_q"}]})
    out = tmp_path / "out"
    report = run_sweep(
        model.first, text=english(), recipe=recipe, out_dir=out,
        options=SweepOptions(n_ctx=CTX, max_chunks=CHUNKS, plot=True),
    )  # fmt: skip
    assert report.plot is not None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert report.plot.path is None
        assert report.plot.note == NO_MATPLOTLIB
        assert not (out / PLOT_PNG).exists()
    else:
        assert report.plot.path == out / PLOT_PNG
        png_size(out / PLOT_PNG)
