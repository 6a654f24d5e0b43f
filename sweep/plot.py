"""The sweep's PNG plot: per tensor (or group), the damage of each target quant type.

Two panels over the same x axis (the units in natural order, one bar per quant type): the mean
KL divergence against the baseline (log scale) and ln(PPL/PPL_base), each bar with its ± (the
standard errors llama-perplexity prints: a bar shorter than its ± is not told apart from zero).
matplotlib is an optional extra (``pip install 'ggufswap[plot]'``): without it
:func:`write_plot` writes nothing and says so in one line; the sweep's CSVs and table do not
need it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ggufswap.sweep.results import natural_key

PLOT_PNG: Final = "sweep.png"
NO_MATPLOTLIB: Final = (
    "no plot: matplotlib is not installed "
    "(pip install 'ggufswap[plot]', or pip install matplotlib, then run the sweep again)"
)
KLD_FLOOR: Final = 1e-9  # a zero KLD on the log axis


@dataclass(frozen=True, slots=True)
class PlotResult:
    """The plot's path, or None with the one-line reason it was not written."""

    path: Path | None
    note: str


def _pyplot() -> Any | None:
    """matplotlib's pyplot on the file-only Agg backend, or None when it is not installed."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def write_plot(
    records: Iterable[Mapping[str, Any]], path: Path, *, title: str = "ggufswap sweep"
) -> PlotResult:
    """Plot the recorded rounds to ``path`` (PNG); nothing is written when there is no round or
    no matplotlib (the note says which)."""
    rows = list(records)
    if not rows:
        return PlotResult(None, "no plot: no round recorded")
    plt = _pyplot()
    if plt is None:
        return PlotResult(None, NO_MATPLOTLIB)
    units = sorted({str(r["unit"]) for r in rows}, key=natural_key)
    qtypes = sorted({str(r["qtype"]) for r in rows})
    by_key = {(str(r["unit"]), str(r["qtype"])): r["metrics"] for r in rows}
    width = 0.8 / len(qtypes)
    fig, (ax_kld, ax_ppl) = plt.subplots(
        2, 1, sharex=True, figsize=(max(6.0, 1.2 * len(units) * len(qtypes) ** 0.5 + 2), 6.5)
    )
    for i, q in enumerate(qtypes):
        xs: list[float] = []
        klds: list[float] = []
        kld_err: list[list[float]] = [[], []]  # below, above
        ratios: list[float] = []
        ratio_err: list[float] = []
        for u, unit in enumerate(units):
            m = by_key.get((unit, q))
            if m is None:
                continue
            xs.append(u - 0.4 + width * (i + 0.5))
            kld = max(float(m["kld_mean"]), KLD_FLOOR)
            unc = float(m.get("kld_unc", 0.0))
            klds.append(kld)
            kld_err[0].append(min(unc, kld - KLD_FLOOR))  # the log axis has no room below 0
            kld_err[1].append(unc)
            ratios.append(float(m["ln_ppl_ratio"]))
            ratio_err.append(float(m.get("ln_ppl_ratio_unc", 0.0)))
        bar = {"width": width, "label": q, "capsize": 2, "error_kw": {"elinewidth": 0.8}}
        ax_kld.bar(xs, klds, yerr=kld_err, **bar)
        ax_ppl.bar(xs, ratios, yerr=ratio_err, **bar)
    ax_kld.set_yscale("log")
    ax_kld.set_ylabel("mean KLD (nats) ± err")
    ax_kld.legend(title="target type", fontsize=8)
    ax_kld.set_title(title)
    ax_ppl.axhline(0.0, color="grey", linewidth=0.8)
    ax_ppl.set_ylabel("ln(PPL / PPL_base) ± err")
    ax_ppl.set_xticks(range(len(units)))
    ax_ppl.set_xticklabels(units, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)
    return PlotResult(path, f"plot: {path}")
