"""glm4moe (GLM-4.5/4.6/4.7): loads with its NextN/MTP block in the store but never computed, hot-
swaps exactly, reports swaps of tensors it never computes with, and refuses malformed files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import ModelDir, Q, one_thread
from structlog.testing import capture_logs

from ggufswap.runtime import HotSwapRuntime, PlanState, Storage
from ggufswap.runtime.models import (
    Glm4MoeTransformer,
    HParams,
    HParamsError,
    MissingWeightError,
    build_model,
    unused_tensors,
)
from ggufswap.runtime.models.blocks import DictWeightProvider
from ggufswap.runtime.models.hparams import Gating
from ggufswap.runtime.serving.daemon import report_unused
from ggufswap.shards import read_header
from ggufswap.shards.presets import tiny_glm4moe, tiny_moe
from ggufswap.shards.writer import write_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

TOKENS = torch.tensor([[1, 17, 33, 250, 4, 99, 7, 128], [200, 3, 45, 45, 12, 0, 9, 64]])
NEXTN = 3  # tiny_glm4moe: blocks 0-2, then the NextN block
NEXTN_TENSORS = (f"blk.{NEXTN}.nextn.eh_proj.weight", f"blk.{NEXTN}.ffn_up_exps.weight")


def open_model(first: Path, storage: Storage) -> tuple[HotSwapRuntime, Glm4MoeTransformer]:
    runtime = HotSwapRuntime.open(first, storage=storage)
    assert runtime.shards is not None, "open() keeps the shard set"
    model = build_model(
        HParams.from_metadata(runtime.shards.metadata), runtime.store, store=runtime.store
    )
    assert isinstance(model, Glm4MoeTransformer)
    return runtime, model


def logits(model: Glm4MoeTransformer) -> torch.Tensor:
    with torch.inference_mode():
        return model(TOKENS)


def test_the_nextn_block_is_loaded_but_never_computed(tmp_path: Path) -> None:
    """The NextN block's tensors are in the store, and exactly those are the unused ones."""
    runtime, model = open_model(write_model(tiny_glm4moe(), tmp_path)[0], Storage.DEQUANTIZED)
    try:
        assert model.config.n_layer == 4
        assert model.config.n_layer_nextn == 1
        assert len(model.layers) == 3
        unused = unused_tensors(model, runtime.store.slots)
        assert unused == model.unused(runtime.store.slots)
        assert unused, "the NextN block is loaded"
        assert all(name.startswith(f"blk.{NEXTN}.") for name in unused)
        assert set(NEXTN_TENSORS) <= set(unused)
        in_block = [n for n in runtime.store.slots if n.startswith(f"blk.{NEXTN}.")]
        assert sorted(in_block) == unused
    finally:
        runtime.close()


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_swaps_equal_a_fresh_load_and_unused_only_plans_are_reported(
    storage: Storage, tmp_path: Path
) -> None:
    """A routed-expert and a shared-expert swap give a fresh load's logits bit for bit; a plan
    that changes only NextN tensors commits, leaves the logits as they were and is reported as
    touching only unused tensors (a trunk plan is not)."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_glm4moe())
    runtime, model = open_model(model_dir.first, storage)
    try:
        assert report_unused(runtime, model)
        before = logits(model)
        with capture_logs() as logs:
            for name in NEXTN_TENSORS:
                model_dir.put(name, model_dir.variant(name, Q.Q4_0, tmp_path / "variants"))
            ticket = runtime.apply(model_dir.plan("nextn", NEXTN_TENSORS))
            assert ticket.state is PlanState.COMMITTED, ticket.summary()
            assert set(ticket.changed) == set(NEXTN_TENSORS)
            assert torch.equal(logits(model), before)
            trunk = ("blk.2.ffn_down_exps.weight", "blk.1.ffn_gate_shexp.weight")
            for name in trunk:
                model_dir.put(name, model_dir.variant(name, Q.Q4_0, tmp_path / "variants"))
            ticket = runtime.apply(model_dir.plan("trunk", trunk))
            assert ticket.state is PlanState.COMMITTED, ticket.summary()
        swapped = logits(model)
        assert not torch.equal(swapped, before)
        fresh_runtime, fresh = open_model(model_dir.first, storage)
        try:
            assert torch.equal(swapped, logits(fresh))
        finally:
            fresh_runtime.close()
        reported = [e for e in logs if e["event"] == "plan.unused_only"]
        assert [e["plan_id"] for e in reported] == ["nextn"]
        assert sorted(reported[0]["tensors"]) == sorted(NEXTN_TENSORS)
    finally:
        runtime.close()


def test_models_without_unused_tensors_report_nothing(tmp_path: Path) -> None:
    """Every tensor of a model without NextN blocks is computed with: nothing is reported."""
    runtime, model = open_model(
        write_model(tiny_glm4moe(n_nextn=0), tmp_path)[0], Storage.DEQUANTIZED
    )
    try:
        assert report_unused(runtime, model) == frozenset()
    finally:
        runtime.close()


def _md(tmp_path: Path, **extra: object) -> dict[str, object]:
    md = dict(read_header(write_model(tiny_glm4moe(), tmp_path)[0]).metadata)
    for name, value in extra.items():
        key = f"glm4moe.{name}"
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


def test_reads_llama_cpps_keys(tmp_path: Path) -> None:
    """Partial rotary dims, the NextN count, leading dense blocks, shared experts and the routing
    keys; without expert_gating_func glm4moe gates by sigmoid."""
    config = HParams.from_metadata(_md(tmp_path, expert_gating_func=None))
    assert (config.head_dim, config.n_rot, config.n_layer_nextn) == (32, 16, 1)
    assert (config.n_layer_dense_lead, config.n_expert_shared, config.n_ff_shexp) == (1, 1, 32)
    assert config.gating is Gating.SIGMOID
    assert (config.norm_topk, config.expert_weights_scale) == (True, 2.5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope.dimension_sections": [8, 8, 0, 0]}, "multimodal RoPE"),
        ({"expert_shared_count": None}, "missing required key 'glm4moe.expert_shared_count'"),
        ({"expert_feed_forward_length": None}, "expert_feed_forward_length"),
        ({"nextn_predict_layers": 4}, "nextn_predict_layers 4"),
        ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "'yarn'"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_malformed_metadata_is_refused(
    change: dict[str, object], message: str, tmp_path: Path
) -> None:
    """Each file the reference decoder cannot run as llama.cpp does is refused, naming the key."""
    with pytest.raises(HParamsError, match=message):
        HParams.from_metadata(_md(tmp_path, **change))


def test_a_moe_block_without_its_selection_bias_is_refused(tmp_path: Path) -> None:
    """exp_probs_b is required in glm4moe's MoE blocks, as llama.cpp creates it."""
    runtime, model = open_model(write_model(tiny_glm4moe(), tmp_path)[0], Storage.DEQUANTIZED)
    try:
        weights = {name: runtime.store.weight(name) for name in runtime.store.slots}
    finally:
        runtime.close()
    del weights["blk.1.exp_probs_b.bias"]
    with pytest.raises(MissingWeightError, match=r"blk\.1\.exp_probs_b\.bias: missing"):
        Glm4MoeTransformer(model.config, DictWeightProvider(weights))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tiny_glm4moe(expert_probs_bias=False), "needs expert_probs_bias"),
        (lambda: tiny_glm4moe(n_expert=0, n_expert_used=0, shared_expert=False), "n_expert > 0"),
        (lambda: tiny_glm4moe(n_expert_shared=0), "must match n_expert_shared"),
        (lambda: tiny_moe(n_nextn=1), "glm4moe's"),
        (lambda: tiny_moe(attn_bias=True), "glm4moe's"),
    ],
    ids=["no-bias", "dense", "shared-count", "nextn-elsewhere", "attn-bias-elsewhere"],
)
def test_the_writer_refuses_what_llama_cpp_refuses(build: object, message: str) -> None:
    """A glm4moe spec llama.cpp would refuse, or glm4moe's options elsewhere, are refused."""
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
