"""``runtime.numerics``: the served decoder's arithmetic, chosen in the configuration or with
``ggufswap runtime --numerics``; swaps keep each setting's fresh-load bit-identity."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from runtime_helpers import TOKENS, ModelDir, Q, logits, mixed_moe, one_thread

from ggufswap._cmd_runtime import with_numerics
from ggufswap.config import (
    ComputeDtype,
    Config,
    ConfigError,
    Numerics,
    Storage,
    load_config,
)
from ggufswap.main import build_parser
from ggufswap.runtime import PlanState
from ggufswap.runtime.kernels import _ggml
from ggufswap.runtime.models import ggml_numerics
from ggufswap.runtime.models.ggml_numerics import ggml_fast_path
from ggufswap.runtime.serving.daemon import open_runtime, served_model, served_numerics
from ggufswap.shards.ggml_types import GGMLType

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN0 = "blk.0.ffn_down_exps.weight"  # Q8_0 in the mixed model: the routed experts' product
ATTN_V1 = "blk.1.attn_v.weight"  # Q5_0: a dense layer product
SWAPPED = {DOWN0: Q.Q4_0, ATTN_V1: Q.Q8_0}
# The mixed model in types every libggml multiplies at its rows of 64 (ggml's numerics emulate
# F16 / BF16 products, and ik's fork multiplies Q4_1 / Q5_1 rows of multiples of 128 only).
QUANTIZED = mixed_moe().with_types(
    ffn_up_exps="q5_0", attn_q="q8_0", attn_k="q4_0", attn_o="q8_0", output="q5_0"
)


def config_of(tmp_path: Path, model: Path, extra: str = "") -> Config:
    """A runtime section serving ``model`` on the CPU, with ``extra`` keys."""
    path = tmp_path / "runtime.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            runtime:
              model: {model}
              pools: [{{name: host, device: cpu}}]
            """
        )
        + textwrap.indent(textwrap.dedent(extra), "  ")
    )
    return load_config(path, environ={"RUNTIME_DIRECTORY": str(tmp_path)})


def served_logits(config: Config) -> torch.Tensor:
    """The logits of a fresh load served as ``config`` says."""
    runtime = open_runtime(config)
    try:
        return logits(served_model(runtime, config.require_runtime().numerics), TOKENS)
    finally:
        runtime.close()


def test_numerics_is_read_and_checked_against_storage(tmp_path: Path) -> None:
    """``numerics`` defaults to auto and is read; ggml with dequantized storage or a bfloat16
    compute dtype is refused at their lines, naming the fix."""
    model = tmp_path / "m.gguf"
    model.touch()
    assert config_of(tmp_path, model).require_runtime().numerics is Numerics.AUTO
    rc = config_of(tmp_path, model, "numerics: ggml\n").require_runtime()
    assert (rc.numerics, rc.storage) == (Numerics.GGML, Storage.AUTO)
    with pytest.raises(ConfigError) as err:
        config_of(
            tmp_path, model, "numerics: ggml\nstorage: dequantized\ncompute_dtype: bfloat16\n"
        )
    problems = {p.key_path: p for p in err.value.problems}
    assert set(problems) == {"runtime.storage", "runtime.compute_dtype"}
    assert problems["runtime.storage"].line == 6
    assert "storage: native" in problems["runtime.storage"].message
    assert "float32" in problems["runtime.compute_dtype"].message


def test_the_flag_overrides_the_key_and_is_checked(tmp_path: Path) -> None:
    """``--numerics`` replaces ``runtime.numerics``; with the configuration's dequantized storage
    ggml is refused naming the flag and the key."""
    model = tmp_path / "m.gguf"
    model.touch()
    args = build_parser().parse_args(["runtime", "--config", "x", "--numerics", "ggml"])
    config = with_numerics(config_of(tmp_path, model), args.numerics)
    assert config.require_runtime().numerics is Numerics.GGML
    assert with_numerics(config, None) is config
    dequantized = config_of(tmp_path, model, "storage: dequantized\n")
    with pytest.raises(ConfigError) as err:
        with_numerics(dequantized, "ggml")
    assert [(p.file, p.key_path) for p in err.value.problems] == [("--numerics", "runtime.storage")]
    assert with_numerics(dequantized, "exact").require_runtime().numerics is Numerics.EXACT


@pytest.mark.parametrize("numerics", list(Numerics), ids=lambda n: n.value)
def test_swaps_equal_a_fresh_load_with_the_same_numerics(
    tmp_path: Path, numerics: Numerics
) -> None:
    """Served with each numerics, a swap gives the fresh load's logits of the swapped files and a
    swap back the first logits, bit for bit; ggml's arithmetic differs from the default's."""
    model_dir = ModelDir.write(tmp_path / "model")
    saved = {name: model_dir.save(name, tmp_path / "saved") for name in SWAPPED}
    variants = {name: model_dir.variant(name, t, tmp_path / "v") for name, t in SWAPPED.items()}
    config = config_of(tmp_path, model_dir.first, f"numerics: {numerics.value}\n")
    runtime = open_runtime(config)
    try:
        if numerics is Numerics.GGML:
            assert runtime.store.storage is Storage.NATIVE, "auto storage is native for ggml"
        model = served_model(runtime, config.require_runtime().numerics)
        baseline = logits(model, TOKENS)
        assert torch.equal(baseline, served_logits(config))
        for name, variant in variants.items():
            model_dir.put(name, variant)
        assert runtime.apply(model_dir.plan("to", SWAPPED)).state is PlanState.COMMITTED
        swapped = logits(model, TOKENS)
        assert not torch.equal(swapped, baseline)
        assert torch.equal(swapped, served_logits(config))
        for name, copy in saved.items():
            model_dir.put(name, copy)
        assert runtime.apply(model_dir.plan("back", SWAPPED)).state is PlanState.COMMITTED
        assert torch.equal(logits(model, TOKENS), baseline)
        if numerics is Numerics.GGML:
            exact = config_of(tmp_path, model_dir.first, "storage: native\nnumerics: exact\n")
            assert not torch.equal(baseline, served_logits(exact))
            assert config.require_runtime().compute_dtype is ComputeDtype.FLOAT32
    finally:
        runtime.close()


def test_auto_serves_ggml_numerics_where_every_product_is_libggml(tmp_path: Path) -> None:
    """``auto`` serves ggml's numerics (llama.cpp's arithmetic, the fast path) where the store is
    native on the CPU and the libggml multiplies every matrix: the logits are ``ggml``'s, bit for
    bit, and stay so after a swap to a type it does not multiply (chosen at the load, never
    changed by a swap). With dequantized storage it serves the store's float products, whose
    logits differ, and says why."""
    if _ggml.library() is None:
        pytest.skip(f"no libggml here ({_ggml.describe()})")
    model_dir = ModelDir.write(tmp_path / "model", QUANTIZED)
    first = model_dir.first
    auto = config_of(tmp_path, first, "storage: native\n")
    ggml = config_of(tmp_path, first, "numerics: ggml\n")
    runtime = open_runtime(auto)
    try:
        served = served_numerics(runtime.store, Numerics.AUTO)
        assert served == (Numerics.GGML, "every product is libggml's")
        model = served_model(runtime)
        got = logits(model, TOKENS)
        assert torch.equal(got, served_logits(ggml))
        model_dir.put(ATTN_V1, model_dir.variant(ATTN_V1, Q.F16, tmp_path / "v"))
        assert runtime.apply(model_dir.plan("f16", [ATTN_V1])).state is PlanState.COMMITTED
        assert served_numerics(runtime.store, Numerics.AUTO)[0] is Numerics.AUTO  # a fresh load's
        swapped = logits(model, TOKENS)
        assert not torch.equal(swapped, got)
        assert torch.equal(swapped, served_logits(ggml))
    finally:
        runtime.close()
    dequantized = config_of(tmp_path, first, "storage: dequantized\n")
    runtime = open_runtime(dequantized)
    try:
        served = served_numerics(runtime.store, Numerics.AUTO)
        assert served == (Numerics.AUTO, "storage is dequantized")
    finally:
        runtime.close()
    assert not torch.equal(served_logits(ggml), served_logits(dequantized))


def test_ggml_fast_path_names_what_keeps_auto_off_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ggml's numerics are not the fast path, the reason names it: no libggml, or the
    first matrix the libggml does not multiply (its name, type and device): the mixed model's
    F16 ones with the libggml installed."""
    model_dir = ModelDir.write(tmp_path / "model")
    if _ggml.library() is not None:
        mixed = config_of(tmp_path, model_dir.first, "storage: native\n")
        runtime = open_runtime(mixed)
        try:
            numerics, why = served_numerics(runtime.store, Numerics.AUTO)
        finally:
            runtime.close()
        assert numerics is Numerics.AUTO
        assert re.search(r"multiply \S+ \((F16|BF16) on cpu\)$", why), why
    first = ModelDir.write(tmp_path / "quantized", QUANTIZED).first
    config = config_of(tmp_path, first, "storage: native\n")
    runtime = open_runtime(config)
    try:
        monkeypatch.setattr(ggml_numerics, "ggml_library", lambda: None)
        assert ggml_fast_path(runtime.store) == "no libggml is loaded"
        only_q8_0 = _ggml.Library(Path("libggml.so"), False, frozenset({GGMLType.Q8_0}), None)
        monkeypatch.setattr(ggml_numerics, "ggml_library", lambda: only_q8_0)
        refused = ggml_fast_path(runtime.store)
        assert refused is not None
        assert re.fullmatch(r"ggml does not multiply blk\.\S+ \((Q4_0|Q5_0) on cpu\)", refused)
        assert served_numerics(runtime.store, Numerics.AUTO) == (Numerics.AUTO, refused)
    finally:
        runtime.close()
