"""Quant type names as llama.cpp, ik_llama.cpp and the GGUF Tool Suite spell them.

Every type of the project's table (``shards/ggml_types.py``: mainline ggml's and ik_llama.cpp's)
can be named, case-insensitively: ``Q4_K``, ``q4_k`` and ``q4_K`` are the same type. Every output
(CSV rows, journal keys, file names, logs) uses the one canonical spelling, the Tool Suite's rule
(``collect_ppl_results.sh``'s ``canonical_qtype``, which matches file names case-sensitively):
``q*_K`` and ``q*_KV`` end in a capital ``K``/``KV`` (``q4_K``, ``q6_K``, ``q8_KV``), everything
else is lower case (``q8_0``, ``iq4_k``, ``iq4_ks``, ``iq2_kt``, ``q4_k_r4``, ``q8_k_r8``,
``bf16``).
"""

from __future__ import annotations

import re
from typing import Final

from ggufswap.shards.ggml_types import LAYOUTS, GGMLType, Origin

_K_SUFFIX: Final = re.compile(r"^q[^_]+_k$")
_KV_SUFFIX: Final = re.compile(r"^q[^_]+_kv$")
# Not a tensor's storage type: integers, F64, matmul intermediates (nothing quantizes to them).
NOT_STORAGE: Final = frozenset(
    {GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64, GGMLType.F64, GGMLType.Q8_1}
)


def qtype_name(ggml_type: int) -> str:
    """The canonical spelling of a type (``q4_K``, ``q8_0``, ``iq4_ks``, ``q4_k_r4``, ``bf16``)."""
    name = GGMLType(int(ggml_type)).name.lower()
    if _K_SUFFIX.match(name):
        return name[:-2] + "_K"
    if _KV_SUFFIX.match(name):
        return name[:-3] + "_KV"
    return name


def parse_qtype(text: str | int) -> GGMLType:
    """The type named ``text`` (any case) or coded ``text``; ValueError naming the near ones."""
    if isinstance(text, int):
        try:
            return GGMLType(int(text))
        except ValueError:
            raise ValueError(f"unknown GGML type code {text}") from None
    key = text.strip().upper()
    member = GGMLType.__members__.get(key)
    if member is None or member not in LAYOUTS:
        raise ValueError(f"unknown GGML type {text!r}{_near(key)}")
    if member in NOT_STORAGE:
        raise ValueError(f"{qtype_name(member)} is not a weight type (nothing quantizes to it)")
    return member


def is_ik_type(ggml_type: int) -> bool:
    """Whether only ik_llama.cpp defines the type (its own ``llama-quantize`` writes it)."""
    layout = LAYOUTS.get(GGMLType(int(ggml_type)))
    return layout is not None and layout.origin is Origin.IK


def _near(key: str) -> str:
    import difflib

    names = [qtype_name(t) for t in LAYOUTS if t not in NOT_STORAGE]
    near = difflib.get_close_matches(key.lower(), [n.lower() for n in names], n=4, cutoff=0.6)
    spelled = [n for n in names if n.lower() in near]
    return f" (did you mean {', '.join(spelled)}?)" if spelled else " (see docs/types.md)"
