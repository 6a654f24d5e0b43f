"""How many cases each fuzz and property test runs: its own default in ``make test``; the number
in ``GGUFSWAP_FUZZ_EXAMPLES`` when set: ``make check`` sets 60 (the fast tier runs every test,
with fewer cases), ``make fuzz`` 20,000."""

from __future__ import annotations

import os

ENV = "GGUFSWAP_FUZZ_EXAMPLES"


def examples(default: int) -> int:
    """The number of cases for a test whose own default is ``default``."""
    value = os.environ.get(ENV, "").strip()
    return int(value) if value else default
