"""Run every benchmark in bench/ and print one table of ratios against their targets.

    python bench/run_all.py [--quick] [--only NAME ...]

A benchmark is a module in this folder exposing ``run(quick: bool) -> list[dict]``; each row has
``name``, ``baseline_s``, ``ours_s``, ``ratio`` (baseline time / ours, measured in the same run, so
higher is better) and ``target`` (the ratio to reach, or None). The known benchmarks run first in
a fixed order, then any other module found here. A missing module is noted, a failing one is
reported with its error, and the others still run. Exit status: 1 if any benchmark failed to
run, else 0 (a missed target is a finding, reported in the table, not a crash).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

BENCH_DIR = Path(__file__).resolve().parent
KNOWN = (
    "parse",
    "dequant",
    "kernels",
    "commit_stall",
    "latency",
    "scan",
    "state_sync",
    "engine",
    "llama_ratio",
    "quantize",
    "sweep_ray",
)
ROW_KEYS = ("name", "baseline_s", "ours_s", "ratio", "target")


@dataclass
class Outcome:
    module: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""  # "not present", or the error that stopped it
    failed: bool = False
    seconds: float = 0.0


def discover(only: Sequence[str] = ()) -> list[str]:
    """Known benchmarks in order, then other modules of this folder (never run_all itself)."""
    others = sorted(
        p.stem
        for p in BENCH_DIR.glob("*.py")
        if p.stem not in KNOWN and p.stem != "run_all" and not p.stem.startswith("_")
    )
    names = [*KNOWN, *others]
    return [n for n in names if not only or n in only]


def load(name: str) -> ModuleType | None:
    """Import ``bench/NAME.py`` under a private name; None when the file does not exist."""
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"_ggufswap_bench_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _checked_rows(name: str, rows: Any) -> list[dict[str, Any]]:
    if not isinstance(rows, list):
        raise TypeError(f"bench/{name}.py: run() returned {type(rows).__name__}, expected a list")
    problems = [
        f"row {i}: missing {', '.join(k for k in ROW_KEYS if k not in row)}"
        for i, row in enumerate(rows)
        if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS)
    ]
    if problems:
        raise ValueError(
            f"bench/{name}.py: rows need {', '.join(ROW_KEYS)}; " + "; ".join(problems)
        )
    return rows


def run_one(name: str, *, quick: bool, say: Callable[[str], None]) -> Outcome:
    outcome = Outcome(name)
    started = time.perf_counter()
    try:
        module = load(name)
        if module is None:
            outcome.note = "not present (skipped)"
            return outcome
        run = getattr(module, "run", None)
        if not callable(run):
            outcome.note = "has no run(quick) function (skipped)"
            return outcome
        say(f"running bench/{name}.py ...")
        outcome.rows = _checked_rows(name, run(quick))
    except Exception as exc:  # noqa: BLE001 - one broken benchmark must not stop the others
        outcome.failed = True
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(last.filename).name}:{last.lineno}"
        outcome.note = f"FAILED: {type(exc).__name__}: {exc} (at {where})"
    finally:
        outcome.seconds = time.perf_counter() - started
    return outcome


def verdict(row: dict[str, Any]) -> str:
    target, ratio = row.get("target"), row.get("ratio")
    if target is None:
        return "(no target)"
    if not isinstance(ratio, (int, float)):
        return "no ratio"
    return "met" if ratio >= target else "NOT MET"


def _ms(value: Any) -> str:
    return f"{value * 1e3:.3f}" if isinstance(value, (int, float)) else "-"


def render(outcomes: Sequence[Outcome]) -> list[str]:
    header = ("bench", "name", "baseline ms", "ours ms", "ratio", "target", "verdict")
    table: list[tuple[str, ...]] = []
    for outcome in outcomes:
        for row in outcome.rows:
            ratio, target = row.get("ratio"), row.get("target")
            table.append(
                (
                    outcome.module,
                    str(row["name"]),
                    _ms(row.get("baseline_s")),
                    _ms(row.get("ours_s")),
                    f"{ratio:.2f}x" if isinstance(ratio, (int, float)) else "-",
                    f">= {target:g}x" if isinstance(target, (int, float)) else "-",
                    verdict(row),
                )
            )
    widths = [max(len(r[i]) for r in (header, *table)) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in (header, *table)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for outcome in outcomes:
        if outcome.note:
            lines.append(f"{outcome.module}: {outcome.note}")
    rows = [row for o in outcomes for row in o.rows]
    met = sum(verdict(r) == "met" for r in rows)
    targeted = sum(r.get("target") is not None for r in rows)
    failed = sum(o.failed for o in outcomes)
    lines.append(f"targets met: {met}/{targeted}; benchmarks failed: {failed}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every benchmark; one table of ratios.")
    parser.add_argument("--quick", action="store_true", help="smaller inputs, fewer repeats")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=(), help="e.g. parse dequant")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(BENCH_DIR))  # benchmarks may share helpers in this folder
    structlog.configure(  # library log lines would interleave with the table
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    outcomes = []
    for name in discover(args.only):
        outcome = run_one(name, quick=args.quick, say=say)
        if outcome.rows or outcome.failed:
            say(f"  bench/{name}.py: {len(outcome.rows)} row(s) in {outcome.seconds:.1f} s")
        outcomes.append(outcome)
    print("\n".join(render(outcomes)))
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
