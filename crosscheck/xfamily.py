"""The cross-check families recorded in fixtures of their own, and their references.

Shared by ``families.py`` and ``converted_mla.py`` (``make crosscheck``) and by
``tests/test_crosscheck_families.py`` (``make test``, no reference needed). A family's variants
are cases as ``xcheck``'s (every matrix role in one type; ``xcheck.case_spec`` builds them) whose
golden data lives under ``tests/fixtures/crosscheck/<family>/``, so that adding a family touches no
other family's binary fixture; each family names its reference (``ENGINES``): llama.cpp, or
ik_llama.cpp for the files only ik reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import xcheck

from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.presets import (
    deepseek2_wide,
    tiny_deepseek2_ik,
    tiny_deepseek32,
    tiny_glm_dsa,
)
from ggufswap.shards.writer import ModelSpec


def _wide_mla(preset: Callable[..., ModelSpec]) -> Callable[..., ModelSpec]:
    """A latent-attention preset; widened as ``tiny-deepseek2`` is (``deepseek2_wide``) when
    asked for the K-quant rows of 256."""

    def build(**kw: Any) -> ModelSpec:
        if kw.get("n_embd") == xcheck.WIDE["n_embd"]:
            kw = deepseek2_wide(**kw)
        return preset(**kw)

    return build


FAMILIES: Final[Mapping[str, Mapping[str, Callable[..., ModelSpec]]]] = {
    # DeepSeek-V3.2 and GLM-5.x: deepseek2's blocks behind the DSA lightning indexer (top-k 4 of
    # the 12 positions), glm-dsa with shared indexer blocks
    "dsa": {"deepseek32": _wide_mla(tiny_deepseek32), "glm-dsa": _wide_mla(tiny_glm_dsa)},
    # DeepSeek-R1-0528 / V3-0324 as ik_llama.cpp's converter writes them: attn_kv_b and 2-D
    # attn_k_b / attn_v_b, ungrouped routing in ik
    "ik-mla": {"deepseek2-ik": _wide_mla(tiny_deepseek2_ik)},
}
ENGINES: Final[Mapping[str, str]] = {"dsa": "llama.cpp", "ik-mla": "ik_llama.cpp"}
# Types a family checks beyond xcheck.CHECK_TYPES: ik_llama.cpp's own, where ik is the reference.
EXTRA_TYPES: Final[Mapping[str, tuple[GGMLType, ...]]] = {
    "ik-mla": (GGMLType.Q6_0, GGMLType.IQ4_K),
}
# The converter-made files (converted_mla.py), kept with their references' logits.
CONVERTED: Final = xcheck.FIXTURES / "converted-mla"


def fixtures_of(family: str) -> Path:
    """Where a family's golden fixtures live."""
    return xcheck.FIXTURES / family


def case_spec(name: str) -> ModelSpec:
    """The spec of the family case ``variant/TYPE``."""
    variant, _, type_name = name.rpartition("/")
    build = next(v[variant] for v in FAMILIES.values() if variant in v)
    return xcheck.case_spec(variant, xcheck.type_named(type_name), build)


def all_cases(family: str) -> dict[str, ModelSpec]:
    """Every case of ``family``, by name (``variant/TYPE``), in a stable order."""
    types = (*xcheck.CHECK_TYPES, *EXTRA_TYPES.get(family, ()))
    names = [xcheck.case_name(v, t) for v in FAMILIES[family] for t in types]
    return {name: case_spec(name) for name in names}


def load_files(out_dir: Path) -> tuple[dict[str, Any], dict[str, tuple[Path, np.ndarray]]]:
    """A folder of files recorded with their reference's logits (``CONVERTED``): the manifest,
    and for each case whose file is kept, the file and the decoded logits at
    ``xcheck.GOLDEN_POSITIONS``."""
    manifest = json.loads((out_dir / xcheck.MANIFEST.name).read_text())
    out = {}
    with np.load(out_dir / xcheck.LOGITS.name) as arrays:
        for name, case in manifest["cases"].items():
            if not case.get("file"):
                continue
            key = case["logits_key"]
            codes = (arrays[f"{key}_codes"], arrays[f"{key}_offset"], arrays[f"{key}_step"])
            out[name] = (out_dir / case["file"], xcheck.decode_logits(*codes))
    return manifest, out
