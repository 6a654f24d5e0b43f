"""A sweep's results in the GGUF Tool Suite's formats, so its tools read ``--out`` unchanged.

What the Suite's ``benchmark_each_tensor.sh`` leaves in a directory and ``collect_ppl_results.sh``
and ``quant_assign.py`` read (their code read at ``Thireus/GGUF-Tool-Suite``, MIT):

- ``tensors.<qtype>.map`` per target type: one line per tensor of the model,
  ``file:sha256:name:shape=(ne0, ne1):dtype=<qtype>:elements=N:bytes=N`` (the collector takes the
  tensor names and the qtype list from them, ``quant_assign.py`` the sizes). Here ``dtype`` is the
  type the tensor would have in a model of that type (the target when its rows hold whole blocks,
  else its own type), ``file`` the swept model's shard holding it and ``sha256`` zeros: these
  maps describe sizes, not downloads.
- per round, ``bench_ppl_kld_result.<tensor>.<qtype>.<chunks>.txt``: llama-perplexity's
  ``--kl-divergence`` summary (``Mean PPL(Q)``, ``Mean    KLD:``, the percentiles, Δp, same top).
  A tensor the model never computes with gets ``....txt.unused`` (the Suite's quarantine note,
  collected as baseline-equivalent); a target equal to the tensor's own type gets a log of the
  baseline's own figures (KLD 0). ``bench_ppl_kld_result.baseline.<qtype>.<chunks>.txt`` holds
  the baseline's ``Final estimate: PPL = ... +/- ...`` (``--auto-baseline <qtype>``).
- ``ppl_results.csv`` / ``kld_results.csv``: ``QTYPE,<tensor>,...``, one row per target type;
  ``404`` where no round was recorded (refused, or not run yet: the Suite's "unmeasured" cell,
  which ``quant_assign.py`` fills with the class mean), the baseline's PPL and KLD ``0`` for
  baseline-equivalent cells. PPL cells optionally as the Suite's percent deltas (``+1.23%``).
- groups go to ``group0/`` as the Suite lays out its group runs: the mapping file
  ``bench_ppl_kld_group_mapping.<qtype>.<chunks>.txt`` (``groupN:regex,...``, the recipe's N-th
  group, its members as anchored names), the per-round logs ``bench_ppl_kld_result.groupN...``,
  the maps and CSVs with ``groupN`` columns (``group0/kld_results.csv`` of a recipe whose first
  group is every tensor is ``quant_assign.py``'s ``--quant-degradation-csv``).
- ``protocol.json``: how every figure was measured (numerics, context, chunks, text digest,
  baseline file and model), beside the CSVs that have no room for it.

``<qtype>`` of the baseline files is the baseline model's predominant weight type.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from ggufswap.shards import TensorRecord
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType, tensor_nbytes
from ggufswap.sweep.qtypes import qtype_name
from ggufswap.sweep.recipe import Recipe, Round, Skip
from ggufswap.sweep.results import KLD_CSV, PPL_CSV, natural_key, write_text
from ggufswap.sweep.sources import SCRATCH

GROUP_DIR: Final = "group0"
ORIGINALS: Final = "originals"
PROTOCOL_JSON: Final = "protocol.json"
MISSING: Final = "404"
ZERO_SHA: Final = "0" * 64


@dataclass(frozen=True, slots=True)
class Cell:
    """A baseline-equivalent cell: ``unused`` (the model ignores the unit) or ``same`` (the
    target is the unit's own type)."""

    kind: str
    reason: str


@dataclass(kw_only=True)
class SuiteLayout:
    """What the Suite's files of one sweep hold, besides the recorded rounds."""

    tensor_units: list[str]
    groups: dict[str, tuple[int, tuple[str, ...]]]  # group name -> (N, members)
    qtypes: list[str]
    equivalent: dict[tuple[str, str], Cell] = field(default_factory=dict)  # (unit, qtype)
    originals: Mapping[str, TensorRecord]
    ppl_base: float
    ppl_base_unc: float
    protocol: dict[str, Any]
    baseline_qtype: str
    ppl_percent: bool = False

    @classmethod
    def of(  # noqa: PLR0917 (the sweep's plan and baseline, each a separate record)
        cls,
        recipe: Recipe,
        rounds: list[Round],
        skipped: list[Skip],
        originals: Mapping[str, TensorRecord],
        base_record: Mapping[str, Any],
        options: Any,
    ) -> SuiteLayout:
        groups: dict[str, tuple[int, tuple[str, ...]]] = {
            r.group: (int(r.group_index or 0), ()) for r in recipe.rules if r.group is not None
        }
        for r in rounds:
            if r.unit in groups:
                groups[r.unit] = (groups[r.unit][0], r.tensors)
        units = {r.unit for r in rounds if r.unit not in groups}
        equivalent: dict[tuple[str, str], Cell] = {}
        for s in skipped:
            for q in s.equivalent:
                # an unused unit is skipped for every target ("*"), a same-type one for its type
                kind = "unused" if s.target == "*" else "same"
                equivalent[(s.unit, q)] = Cell(kind, s.reason)
                if s.unit not in groups:
                    units.add(s.unit)
        qtypes = {qtype_name(q) for rule in recipe.rules for q in rule.quants}
        return cls(
            tensor_units=sorted(units, key=natural_key),
            groups=groups,
            qtypes=sorted(qtypes),
            equivalent=equivalent,
            originals=originals,
            ppl_base=float(base_record["ppl"]),
            ppl_base_unc=float(base_record.get("ppl_unc", 0.0)),
            protocol=dict(base_record.get("protocol", {})),
            baseline_qtype=predominant_type(originals),
            ppl_percent=bool(getattr(options, "ppl_percent", False)),
        )

    @property
    def chunks(self) -> int:
        return int(self.protocol.get("n_chunk", 0))

    def remove_scratch(self, out_dir: Path) -> None:
        """Remove the sweep's scratch and saved originals (``--keep-scratch`` keeps them)."""
        for name in (SCRATCH, ORIGINALS):
            shutil.rmtree(out_dir / name, ignore_errors=True)


def predominant_type(originals: Mapping[str, TensorRecord]) -> str:
    """The weight type holding the most bytes among the model's matrices."""
    sizes: Counter[int] = Counter()
    for rec in originals.values():
        if len(rec.ne) >= 2:
            sizes[int(rec.ggml_type)] += rec.nbytes
    return qtype_name(sizes.most_common(1)[0][0]) if sizes else "f32"


def number(value: float) -> str:
    """A cell value: 7 significant digits, never in exponent form (0.000003123456)."""
    return np.format_float_positional(value, precision=7, fractional=False, trim="-")


# --- the CSVs ------------------------------------------------------------------------------------


def _cells(
    layout: SuiteLayout, columns: list[str], values: Mapping[tuple[str, str], Mapping[str, Any]]
) -> tuple[str, str]:
    """``(ppl csv, kld csv)`` text over ``columns`` (units), one row per target type."""
    ppl_rows, kld_rows = ["QTYPE," + ",".join(columns)], ["QTYPE," + ",".join(columns)]
    for q in layout.qtypes:
        ppl_cells, kld_cells = [q], [q]
        for unit in columns:
            metrics = values.get((unit, q))
            cell = layout.equivalent.get((unit, q))
            if metrics is not None:
                ppl, kld = float(metrics["ppl"]), float(metrics["kld_mean"])
            elif cell is not None:
                ppl, kld = layout.ppl_base, 0.0
            else:
                ppl_cells.append(MISSING + ("%" if layout.ppl_percent else ""))
                kld_cells.append(MISSING)
                continue
            if layout.ppl_percent:
                ppl_cells.append(f"{(ppl - layout.ppl_base) / layout.ppl_base * 100:+.2f}%")
            else:
                ppl_cells.append(number(ppl))
            kld_cells.append(number(kld))
        ppl_rows.append(",".join(ppl_cells))
        kld_rows.append(",".join(kld_cells))
    return "\n".join(ppl_rows) + "\n", "\n".join(kld_rows) + "\n"


def write_outputs(
    out_dir: Path,
    layout: SuiteLayout,
    records: Iterable[Mapping[str, Any]],
    refused: list[dict[str, Any]],
) -> None:
    """Rewrite the CSVs, maps and baseline files; write the logs of rounds that have none."""
    rows = list(records)
    values = {(str(r["unit"]), str(r["qtype"])): r["metrics"] for r in rows}
    ppl, kld = _cells(layout, layout.tensor_units, values)
    write_text(out_dir / PPL_CSV, ppl)
    write_text(out_dir / KLD_CSV, kld)
    write_text(out_dir / PROTOCOL_JSON, json.dumps(layout.protocol, indent=1) + "\n")
    _write_side_files(out_dir, layout)
    for r in rows:
        if r["unit"] in layout.groups:
            continue
        _write_log(out_dir, layout, str(r["unit"]), str(r["qtype"]), r["metrics"])
    for (unit, q), cell in layout.equivalent.items():
        if unit not in layout.groups:
            _write_equivalent(out_dir, layout, unit, q, cell)
    if not layout.groups:
        return
    group_dir = out_dir / GROUP_DIR
    group_dir.mkdir(exist_ok=True)
    named = {name: f"group{n}" for name, (n, _) in layout.groups.items()}
    by_suite = {(named[u], q): m for (u, q), m in values.items() if u in named}
    glayout = dataclasses.replace(
        layout,
        equivalent={(named[u], q): c for (u, q), c in layout.equivalent.items() if u in named},
    )
    columns = sorted(named.values(), key=natural_key)
    ppl, kld = _cells(glayout, columns, by_suite)
    write_text(group_dir / PPL_CSV, ppl)
    write_text(group_dir / KLD_CSV, kld)
    by_index = sorted(layout.groups.items(), key=lambda g: g[1][0])
    mapping = [f"{named[name]}:{','.join(_anchored(m) for m in ms)}" for name, (_, ms) in by_index]
    write_text(
        group_dir / _name(layout, "group_mapping", layout.baseline_qtype), "\n".join(mapping) + "\n"
    )
    _write_side_files(group_dir, glayout)
    for (unit, q), metrics in by_suite.items():
        _write_log(group_dir, glayout, unit, q, metrics)
    for (unit, q), cell in glayout.equivalent.items():
        _write_equivalent(group_dir, glayout, unit, q, cell)


def _anchored(name: str) -> str:
    return "^" + re.escape(name) + "$"


def _name(layout: SuiteLayout, what: str, unit_or_q: str, qtype: str | None = None) -> str:
    middle = unit_or_q if qtype is None else f"{unit_or_q}.{qtype}"
    return f"bench_ppl_kld_{what}.{middle}.{layout.chunks}.txt"


# --- maps and logs -------------------------------------------------------------------------------


def map_lines(
    originals: Mapping[str, TensorRecord],
    qtype: str,
    *,
    files: Mapping[str, str] | None = None,
) -> list[str]:
    """``tensors.<qtype>.map``: every tensor of the model as it would be in that type, in
    natural order; ``files``: each tensor's file name (default: the model's shard holding it)."""
    target = GGMLType[qtype.upper()]
    block = LAYOUTS[target].block_size
    lines = []
    for name, rec in sorted(originals.items(), key=lambda kv: natural_key(kv[0])):
        fits = len(rec.ne) >= 2 and rec.ne[0] % block == 0
        dtype = target if fits else GGMLType(int(rec.ggml_type))
        nbytes = tensor_nbytes(dtype, rec.ne)
        shape = "(" + ", ".join(str(n) for n in rec.ne) + ")"
        file = files[name] if files is not None else Path(rec.path).name
        lines.append(
            f"{file}:{ZERO_SHA}:{name}:shape={shape}:dtype={qtype_name(dtype)}:"
            f"elements={math.prod(rec.ne)}:bytes={nbytes}"
        )
    return lines


def _write_side_files(directory: Path, layout: SuiteLayout) -> None:
    for q in layout.qtypes:
        write_text(directory / f"tensors.{q}.map", "\n".join(map_lines(layout.originals, q)) + "\n")
    base = directory / _name(layout, "result", "baseline", layout.baseline_qtype)
    p = layout.protocol
    write_text(
        base,
        f"{_header(layout, 'baseline', layout.baseline_qtype)}"
        f"perplexity: calculating perplexity over {p.get('n_chunk')} chunks, n_ctx={p.get('n_ctx')}"
        f"\nFinal estimate: PPL = {layout.ppl_base:.4f} +/- {layout.ppl_base_unc:.5f}\n",
    )


def _header(layout: SuiteLayout, unit: str, qtype: str) -> str:
    p = layout.protocol
    return (
        f"ggufswap sweep: {unit} -> {qtype} (llama-perplexity's protocol and output)\n"
        f"ggufswap sweep: numerics {p.get('numerics')} ({p.get('products')}, "
        f"KV cache {p.get('kv_cache')}), "
        f"n_ctx {p.get('n_ctx')}, "
        f"{p.get('n_chunk')} chunks ({p.get('scored_per_chunk')} scored each), "
        f"text sha256 {p.get('text_sha256')}, baseline {p.get('baseline_file')} "
        f"(model {p.get('baseline_model')})\n\n"
    )


def kld_log(metrics: Mapping[str, Any]) -> str:
    """The summary llama-perplexity prints at the end of a ``--kl-divergence`` run."""
    m = metrics
    sq = m["ppl_unc"] / m["ppl"] if m["ppl"] else 0.0
    sb = m["ppl_base_unc"] / m["ppl_base"] if m.get("ppl_base") else 0.0
    cov = (sq * sq + sb * sb - m["ln_ppl_ratio_unc"] ** 2) / 2
    cor = cov / (sq * sb) if sq > 0 and sb > 0 else 0.0
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {m['ppl']:10.6f} ± {m['ppl_unc']:10.6f}",
        f"Mean PPL(base)                : {m['ppl_base']:10.6f} ± {m['ppl_base_unc']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {m['ln_ppl_ratio']:10.6f} ± "
        f"{m['ln_ppl_ratio_unc']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {m['ppl_ratio']:10.6f} ± {m['ppl_ratio_unc']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {m['ppl_diff']:10.6f} ± {m['ppl_diff_unc']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {m['kld_mean']:12.9f} ± {m['kld_unc']:12.9f}",
        f"Maximum KLD: {m['kld_max']:10.6f}",
        *(f"{label}   KLD: {m['kld_' + key]:10.6f}" for label, key in _KLD_ROWS[:4]),
        f"Median  KLD: {m['kld_median']:10.6f}",
        *(f"{label}   KLD: {m['kld_' + key]:10.6f}" for label, key in _KLD_ROWS[4:]),
        f"Minimum KLD: {m['kld_min']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * m['dp_mean']:6.3f} ± {100 * m['dp_mean_unc']:5.3f} %",
        f"Maximum Δp: {100 * m['dp_max']:6.3f}%",
        *(f"{label}   Δp: {100 * m['dp_' + key]:6.3f}%" for label, key in _DP_ROWS[:5]),
        f"Median  Δp: {100 * m['dp_median']:6.3f}%",
        *(f"{label}   Δp: {100 * m['dp_' + key]:6.3f}%" for label, key in _DP_ROWS[5:]),
        f"Minimum Δp: {100 * m['dp_min']:6.3f}%",
        f"RMS Δp    : {100 * m['dp_rms']:6.3f} ± {100 * m['dp_rms_unc']:5.3f} %",
        f"Same top p: {100 * m['same_top']:6.3f} ± {100 * m['same_top_unc']:5.3f} %",
    ]
    return "\n".join(lines) + "\n"


_KLD_ROWS: Final = (
    ("99.9%", "p999"), ("99.0%", "p99"), ("95.0%", "p95"), ("90.0%", "p90"),
    ("10.0%", "p10"), (" 5.0%", "p5"), (" 1.0%", "p1"), (" 0.1%", "p01"),
)  # fmt: skip
_DP_ROWS: Final = (
    ("99.9%", "p999"), ("99.0%", "p99"), ("95.0%", "p95"), ("90.0%", "p90"),
    ("75.0%", "p75"), ("25.0%", "p25"), ("10.0%", "p10"), (" 5.0%", "p5"),
    (" 1.0%", "p1"), (" 0.1%", "p01"),
)  # fmt: skip


def _write_log(
    directory: Path, layout: SuiteLayout, unit: str, qtype: str, metrics: Mapping[str, Any]
) -> None:
    path = directory / _name(layout, "result", unit, qtype)
    if not path.exists():  # a recorded round's figures never change
        write_text(path, _header(layout, unit, qtype) + kld_log(metrics))


def _write_equivalent(
    directory: Path, layout: SuiteLayout, unit: str, qtype: str, cell: Cell
) -> None:
    path = directory / _name(layout, "result", unit, qtype)
    if cell.kind == "unused":
        write_text(
            path.with_name(path.name + ".unused"),
            "=== Benchmark skipped (recorded by ggufswap sweep) ===\n"
            "All target tensors of this benchmark are ignored by the loaded model\n"
            f"({cell.reason}).\n"
            "Swapping them has no effect on PPL/KLD, so no meaningful result can be produced.\n"
            "Consider locking these tensors in USER_REGEX:\n"
            f"  - {unit}\n"
            "=== End of note ===\n",
        )
        return
    write_text(
        path,
        _header(layout, unit, qtype)
        + f"ggufswap sweep: {cell.reason}: the model is the baseline, figures are the baseline's\n"
        + f"Final estimate: PPL = {layout.ppl_base:.4f} +/- {layout.ppl_base_unc:.5f}\n"
        + f"Mean    KLD: {0.0:12.9f} ± {0.0:12.9f}\n",
    )
