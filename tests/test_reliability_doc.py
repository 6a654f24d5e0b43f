"""The reliability matrix's table (docs/reliability.md) is read and written back faithfully.

That the doc lists every row a session recorded is checked when the session's tests have run
(``pytest_runtestloop`` in conftest.py), whatever order they ran in, and in whichever xdist
worker.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import render_reliability

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


def test_render_roundtrip() -> None:
    """A rendered table is read back to the same keys (pipes in cells escaped)."""
    rows = [
        {"area": "a", "fault": "x | y", "tries": 3, "outcome": "ok", "test": "t.py::t"},
        {"area": "b", "fault": "z", "tries": 1, "outcome": "o|k", "test": "t.py::u"},
    ]
    doc = f"text\n{render_reliability.BEGIN}\nold\n{render_reliability.END}\nmore\n"
    out = render_reliability.rewrite(doc, rows)
    assert out.startswith("text\n")
    assert out.endswith("more\n")
    assert render_reliability.doc_keys(out) == {render_reliability.key_of(r) for r in rows}


def test_rows_missing_from_the_doc_are_named_whatever_their_tries() -> None:
    """A recorded row is missing from the doc unless its area, fault and test are in the table;
    its number of tries and outcome do not matter."""
    listed = {"area": "a", "fault": "x", "tries": 3, "outcome": "ok", "test": "t.py::t"}
    doc = render_reliability.rewrite(
        f"{render_reliability.BEGIN}\n{render_reliability.END}\n", [listed]
    )
    rerun = dict(listed, tries=30, outcome="ok, 30 times")
    new = dict(listed, fault="y")
    assert render_reliability.missing_from_doc([rerun], doc) == []
    assert render_reliability.missing_from_doc([rerun, new], doc) == [("a", "y", "t.py::t")]


INNER = """
import pytest
import reliability


@pytest.fixture(scope="module")
def shared():
    return 1


@pytest.mark.reliability("area-x", "marked fault", tries=2, outcome="held")
def test_marked():
    pass


def test_records_itself(request):
    test = request.node.nodeid
    reliability.record("area-x", "recorded fault", tries=3, outcome="held", test=test)


@pytest.mark.reliability("area-x", "grouped fault", tries=1, outcome="held")
def test_in_a_group(shared):
    pass


@pytest.mark.reliability("area-x", "failed fault", tries=1, outcome="held")
def test_fails():
    assert False
"""


@pytest.mark.process
def test_rows_recorded_in_xdist_workers_reach_the_controller(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``-n 2 --dist loadgroup`` (make test) the rows recorded in the workers, by marker
    or by the test, are checked against the doc and written to the report once, by the
    controller, with plain node ids (no xdist group suffix); a failed test records nothing."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini(
        "[pytest]\n"
        "markers =\n    reliability(area, fault, tries, outcome): a row\n"
        "    leaks_ok(reason): may leak\n"
        "addopts = -p no:cacheprovider\n"
    )
    pytester.makepyfile(test_inner=INNER)
    report = pytester.path / "reliability.json"
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the conftest's helper modules
    monkeypatch.setenv("GGUFSWAP_RELIABILITY_REPORT", str(report))
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadgroup", timeout=120)
    result.assert_outcomes(passed=3, failed=1)
    keys = [
        ("area-x", "grouped fault", "test_inner.py::test_in_a_group"),
        ("area-x", "marked fault", "test_inner.py::test_marked"),
        ("area-x", "recorded fault", "test_inner.py::test_records_itself"),
    ]
    # The doc lacks these rows: the controller names them (the workers' own checks see none).
    result.stdout.fnmatch_lines(["*docs/reliability.md is out of date*", "*3 row(s)*"])
    result.stdout.fnmatch_lines_random([f"  {key}" for key in keys])
    rows = json.loads(report.read_text())
    assert sorted(render_reliability.key_of(row) for row in rows) == keys
    assert sorted(row["tries"] for row in rows) == [1, 2, 3]
