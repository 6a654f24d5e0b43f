"""The demo's records (options, steps, results, the report) and how they are shown.

``demo.py`` runs the sweep; this module is what it produces: one :class:`SwapResult` per step in
a :class:`DemoReport`, the progress line of a step, the final table and the exactness check.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from gguf import GGMLQuantizationType

from ggufswap.shards.keys import TensorNames

SWEPT_TENSOR: Final = TensorNames.FFN_DOWN_EXPS
STEP_TIMEOUT_S: Final = 60.0


class Planner(enum.Enum):
    AGENT = "agent"  # the real path: inotify -> agent -> plan
    DIRECT = "direct"  # stand-in while the agent command is missing: the demo sends plans


class StepKind(enum.Enum):
    QUANT = "quant"
    RESTORE = "restore"
    SANITY = "sanity"


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    workdir: Path | None = None
    layers: int | None = None  # None: the preset's own depth
    quick: bool = False  # the tiny model (n_embd 64) instead of demo_moe (n_embd 256)
    keep: bool = False
    low_type: GGMLQuantizationType = GGMLQuantizationType.Q4_0
    planner: Planner | None = None  # None: the agent when installed, else DIRECT
    step_timeout_s: float = STEP_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class Step:
    kind: StepKind
    layer: int

    @property
    def tensor(self) -> str:
        return SWEPT_TENSOR.format(self.layer)


@dataclass(frozen=True, kw_only=True)
class SwapResult:
    index: int
    step: Step
    ggml_type: str  # the tensor's type on disk after the step
    weight_version: int
    perplexity: float
    delta: float  # perplexity - baseline
    latency_ms: float | None  # rename -> committed event received; None when nothing committed
    stall_ms: float | None
    note: str = ""


@dataclass(kw_only=True)
class DemoReport:
    model: str
    planner: Planner
    baseline: float | None = None
    swaps: list[SwapResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    shutdown: list[str] = field(default_factory=list)
    workdir: Path | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.baseline is not None and not self.failures


def progress_line(r: SwapResult) -> str:
    head = f"{r.step.kind.value:<7} {r.step.tensor} ({r.ggml_type})"
    if r.note:
        commit = r.note
    elif r.latency_ms is None:
        commit = f"no commit, still v{r.weight_version}"
    else:
        commit = f"committed v{r.weight_version} {r.latency_ms:.0f} ms after the rename"
    return f"{head}: {commit}, perplexity {r.perplexity:.6f} ({r.delta:+.6f})"


def exactness_failures(report: DemoReport) -> list[str]:
    """Every restore and the sanity slot must give the baseline perplexity exactly (==)."""
    failures = []
    for r in report.swaps:
        if r.step.kind is StepKind.QUANT:
            continue
        if r.perplexity != report.baseline:
            failures.append(
                f"swap {r.index} ({r.step.kind.value} {r.step.tensor}): perplexity "
                f"{r.perplexity!r} != baseline {report.baseline!r}"
            )
    if not any(r.step.kind is StepKind.SANITY for r in report.swaps):
        failures.append("the sanity slot did not run")
    return failures


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(report: DemoReport) -> list[str]:
    header = (
        "#",
        "step",
        "tensor",
        "type",
        "ver",
        "perplexity",
        "Δ vs base",
        "detect→commit",
        "stall",
    )
    rows = [("0", "baseline", "-", "-", "0", _fmt(report.baseline, ".6f"), "-", "-", "-")]
    for r in report.swaps:
        rows.append(
            (
                str(r.index),
                r.step.kind.value,
                r.step.tensor,
                r.ggml_type,
                str(r.weight_version),
                f"{r.perplexity:.6f}",
                "0 (==)" if r.perplexity == report.baseline else f"{r.delta:+.6f}",
                _fmt(r.latency_ms, ".0f") + (" ms" if r.latency_ms is not None else ""),
                _fmt(r.stall_ms, ".3f") + (" ms" if r.stall_ms is not None else ""),
            )
        )
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in (header, *rows)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
