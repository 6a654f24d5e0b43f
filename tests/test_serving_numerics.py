"""``runtime.numerics``: the served decoder's arithmetic, chosen in the configuration or with
``ggufswap runtime --numerics``; swaps keep each setting's fresh-load bit-identity."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from runtime_helpers import TOKENS, ModelDir, Q, logits, one_thread

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
from ggufswap.runtime.serving.daemon import open_runtime, served_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN0 = "blk.0.ffn_down_exps.weight"  # Q8_0 in the mixed model: the routed experts' product
ATTN_V1 = "blk.1.attn_v.weight"  # Q5_0: a dense layer product
SWAPPED = {DOWN0: Q.Q4_0, ATTN_V1: Q.Q8_0}


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
        return logits(served_model(runtime, config.require_runtime()), TOKENS)
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
        model = served_model(runtime, config.require_runtime())
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
            auto = config_of(tmp_path, model_dir.first, "storage: native\n")
            assert not torch.equal(baseline, served_logits(auto))
            assert config.require_runtime().compute_dtype is ComputeDtype.FLOAT32
    finally:
        runtime.close()
