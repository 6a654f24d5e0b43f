"""The benchmarks' result row: a figure as a ratio against its baseline measured in the same run."""

from __future__ import annotations

from typing import Any


def row(name: str, baseline_s: float, ours_s: float, target: float | None) -> dict[str, Any]:
    """``ratio`` = baseline / ours (higher is better); ``target``: the ratio to reach, if any."""
    return {
        "name": name,
        "baseline_s": baseline_s,
        "ours_s": ours_s,
        "ratio": baseline_s / ours_s if ours_s > 0 else float("inf"),
        "target": target,
    }
