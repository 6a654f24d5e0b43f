"""The published reliability matrix (docs/reliability.md) lists every row the tests record.

Named ``test_zz_…`` so that pytest, which runs files in name order, runs it after the tests that
record rows: it checks the rows recorded so far in this session. Rows of tests that did not run
are not checked (a partial run checks what it ran). The table itself is regenerated from the JSON
written at the end of the session: ``python tests/render_reliability.py``.
"""

from __future__ import annotations

import json

import pytest
import reliability
import render_reliability


def test_every_row_recorded_this_session_is_in_the_doc() -> None:
    """Each (area, fault, test) recorded before this test appears in the doc's table."""
    rows = reliability.rows()
    if not rows:
        pytest.skip("no reliability rows were recorded earlier in this session")
    have = render_reliability.doc_keys(render_reliability.DOC.read_text())
    missing = sorted(
        {render_reliability.key_of(vars(r)) for r in rows} - have, key=lambda k: (k[0], k[1])
    )
    assert not missing, (
        f"{len(missing)} recorded row(s) are not in docs/reliability.md; after this session "
        "ends run `python tests/render_reliability.py` and commit the doc:\n"
        + "\n".join(json.dumps(k) for k in missing)
    )


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
