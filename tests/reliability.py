"""The reliability matrix: tests record every fault and bad input they tried, and the outcome.

A test calls :func:`record` once per kind of fault after checking its invariants (so a recorded
row is a passed check). At the end of the session ``conftest.py`` writes the rows to
``build/reliability.json``; ``python tests/render_reliability.py`` turns that file into the table
in ``docs/reliability.md``, so the published matrix is generated from a test run.

Under pytest-xdist the rows are recorded in the worker processes: ``conftest.py`` sends each
test's new rows (:func:`take_new`) to the controller in that test's reports, and the controller
alone adds them (:func:`add`), checks them against the doc and writes the file.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

# GGUFSWAP_RELIABILITY_REPORT moves the file (tests of this machinery write theirs in tmp_path).
REPORT = Path(
    os.environ.get("GGUFSWAP_RELIABILITY_REPORT")
    or Path(__file__).resolve().parent.parent / "build" / "reliability.json"
)


@dataclass(frozen=True)
class Row:
    area: str  # "faults", "bad input", "security", "soak", ...
    fault: str  # what was done, in a few words
    tries: int  # how many times (iterations, cases, frames...)
    outcome: str  # what held: "nothing lost, model unchanged", "refused with a clear error", ...
    test: str  # the test that checked it


_rows: list[Row] = []
_unsent: list[Row] = []  # recorded since the last take_new()
_lock = threading.Lock()


def current_test() -> str:
    """The node id of the running test (for helpers shared by many tests)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def record(area: str, fault: str, *, tries: int, outcome: str, test: str) -> None:
    """Add a row; call it only after the test's invariants were checked."""
    with _lock:
        _rows.append(Row(area, fault, tries, outcome, test))
        _unsent.append(_rows[-1])


def rows() -> list[Row]:
    with _lock:
        return list(_rows)


def take_new() -> list[dict[str, object]]:
    """The rows recorded since the last call, as plain dicts (what an xdist worker sends)."""
    with _lock:
        new = list(_unsent)
        _unsent.clear()
    return [asdict(row) for row in new]


def add(sent: list[dict[str, object]]) -> None:
    """Add rows that :func:`take_new` returned in another process."""
    with _lock:
        for r in sent:
            _rows.append(
                Row(
                    str(r["area"]),
                    str(r["fault"]),
                    int(str(r["tries"])),
                    str(r["outcome"]),
                    str(r["test"]),
                )
            )


def write(path: Path = REPORT) -> None:
    """Merge this session's rows into ``path`` (rows of tests not run this time are kept)."""
    current = rows()
    if not current:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # Two sessions at once (two checkouts' `make test`, a run beside `make fuzz`) merge in turn.
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged: dict[tuple[str, str], dict[str, object]] = {}
        if path.exists():
            for row in json.loads(path.read_text()):
                merged[(row["test"], row["fault"])] = row
        for row in current:
            merged[(row.test, row.fault)] = asdict(row)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(
            json.dumps(sorted(merged.values(), key=lambda r: (r["area"], r["fault"])), indent=1)
        )
        os.replace(tmp, path)
