"""The reliability matrix's table (docs/reliability.md) is read and written back faithfully.

That the doc lists every row a session recorded is checked when the session's tests have run
(``pytest_runtestloop`` in conftest.py), whatever order they ran in.
"""

from __future__ import annotations

import render_reliability


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
