"""A sweep's records on disk: the journal of verified rounds, the CSVs, the terminal table.

The journal (``rounds.jsonl``) is append-only: one JSON object per verified round, written and
fsync'd before the next round starts, so a kill loses at most the round in progress (never a
verified one) and a restart repeats none. A torn last line (a kill mid-write) is cut off on open.

The CSVs and logs in the GGUF Tool Suite's formats are :mod:`.suite`'s.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Final

from ggufswap.shards import atomic_write

JOURNAL: Final = "rounds.jsonl"
PPL_CSV: Final = "ppl_results.csv"
KLD_CSV: Final = "kld_results.csv"


class Journal:
    """The append-only record of verified rounds, keyed by ``record["key"]``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good = 0  # bytes up to the end of the last complete, parseable line
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                record = json.loads(line)
            except ValueError:
                break
            self.records[str(record["key"])] = record
            good += len(line)
        if good != len(data):  # a torn tail from a kill mid-write: drop it
            with self.path.open("r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def append(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records[str(record["key"])] = dict(record)


def natural_key(text: str) -> list[Any]:
    """``sort -V``-like order: ``blk.2`` before ``blk.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def write_text(path: Path, text: str) -> None:
    """Atomically replace ``path`` with ``text`` (UTF-8)."""

    def write(f: BinaryIO) -> None:
        f.write(text.encode())

    atomic_write(path, write)


def render_table(
    records: Iterable[Mapping[str, Any]], *, ppl_base: float, protocol: Mapping[str, Any]
) -> list[str]:
    """The rounds as a fixed-width table, with the figures llama-perplexity prints, under a line
    saying how they were measured."""
    header = (
        "unit",
        "qtype",
        "PPL",
        "ln(PPL/base)",
        "mean KLD",
        "KLD median",
        "KLD 99%",
        "KLD max",
        "Δp mean",
        "Δp RMS",
        "same top",
        "swap+restore",  # making the tensors, both commits: the round's time without evaluation
    )
    rows = [("baseline", "-", f"{ppl_base:.4f}", "0", "0", "0", "0", "0", "0", "0", "100 %", "-")]
    for r in sorted(records, key=lambda r: (natural_key(r["unit"]), r["qtype"])):
        m, t = r["metrics"], r["timings"]
        rows.append(
            (
                r["unit"],
                r["qtype"],
                f"{m['ppl']:.4f} ± {m['ppl_unc']:.4f}",
                f"{m['ln_ppl_ratio']:+.5f} ± {m['ln_ppl_ratio_unc']:.5f}",
                f"{m['kld_mean']:.6f} ± {m['kld_unc']:.6f}",
                f"{m.get('kld_median', float('nan')):.6f}",
                f"{m['kld_p99']:.5f}",
                f"{m['kld_max']:.5f}",
                f"{100 * m.get('dp_mean', float('nan')):+.3f} ± "
                f"{100 * m.get('dp_mean_unc', float('nan')):.3f} %",
                f"{100 * m['dp_rms']:.3f} %",
                f"{100 * m['same_top']:.2f} ± {100 * m['same_top_unc']:.2f} %",
                f"{t['swap_s'] + t['restore_s']:.3f} s",
            )
        )
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(0, "  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)))
    lines.insert(1, "  ".join("-" * w for w in widths))
    p = protocol
    lines.insert(
        0,
        f"numerics {p.get('numerics')} ({p.get('products')}, KV cache {p.get('kv_cache')}), "
        f"ctx {p.get('n_ctx')}, "
        f"{chunks(p.get('n_chunk'))} "
        f"({p.get('scored_per_chunk')} scored each), text sha256 "
        f"{str(p.get('text_sha256'))[:16]}..., baseline {p.get('baseline_file')} of "
        f"{p.get('baseline_model')}",
    )
    return [line.rstrip() for line in lines]


def chunks(n: Any) -> str:
    """``1 chunk``, ``4 chunks``."""
    return f"{n} chunk" if n == 1 else f"{n} chunks"
