"""A llama MoE file in Mixtral's form, as llama.cpp's converter writes it, loads, serves and
hot-swaps: ``llama.feed_forward_length`` is the per-expert width and there is no
``llama.expert_feed_forward_length`` (llama.cpp sizes llama's expert tensors by the former).
Old Mixtral files, one ``blk.N.ffn_{gate,up,down}.M.weight`` per expert, load, compute what the
stacked file of the same values computes, and hot-swap one expert at a time, the per-expert
tensors of a block kept together as a family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    ModelDir,
    Q,
    assert_swap_equals_fresh_load,
    cpu_pools,
    fresh_logits,
    loaded_bytes,
    logits,
    one_thread,
    open_runtime,
    slot_states,
)
from test_http import assert_swap_round_trip_while_serving

from ggufswap.runtime import PlanState, SlotState, Storage
from ggufswap.runtime.models import HParams, MissingWeightError, Transformer
from ggufswap.runtime.models.blocks import DictWeightProvider
from ggufswap.shards import ModelSpec, read_header, tiny_moe

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

EXPERT = "blk.1.ffn_down_exps.weight"


def mixtral(**overrides: object) -> ModelSpec:
    """``make-model --preset tiny-moe --arch llama``: 4 blocks, 4 experts of width 64, 2 used;
    plain-piece tokens so that completions are text."""
    return tiny_moe(arch="llama", n_vocab=1024, context_length=512, **overrides)


def test_the_file_is_in_the_converters_form(tmp_path: Path) -> None:
    """The metadata is the converter's Mixtral form, and the config sizes experts from it."""
    spec = mixtral()
    assert spec.n_ff != spec.n_ff_expert, "a dense width that differs would be ignored"
    first = ModelDir.write(tmp_path / "model", spec).first
    md = read_header(first).metadata
    assert md["llama.feed_forward_length"] == spec.n_ff_expert
    assert "llama.expert_feed_forward_length" not in md
    config = HParams.from_metadata(md)
    assert (config.n_ff_exp, config.n_expert, config.n_expert_used) == (64, 4, 2)
    assert not config.has_shared_expert


def test_llama_ignores_expert_feed_forward_length_as_llama_cpp_does() -> None:
    """An expert_feed_forward_length in a llama file does not size its experts (llama.cpp never
    reads it for llama), so the project's old layout, experts narrower than feed_forward_length,
    is refused naming the expert tensors, as llama.cpp refuses it."""
    md = {
        "general.architecture": "llama",
        "llama.block_count": 1,
        "llama.embedding_length": 32,
        "llama.feed_forward_length": 48,
        "llama.expert_feed_forward_length": 16,
        "llama.expert_count": 4,
        "llama.expert_used_count": 2,
        "llama.attention.head_count": 4,
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
        "llama.context_length": 64,
        "llama.vocab_size": 8,
    }
    config = HParams.from_metadata(md)
    assert config.n_ff_exp == 48
    weights = {
        "token_embd.weight": torch.zeros(8, 32),
        "output_norm.weight": torch.ones(32),
        "blk.0.attn_norm.weight": torch.ones(32),
        "blk.0.ffn_norm.weight": torch.ones(32),
        "blk.0.ffn_gate_inp.weight": torch.zeros(4, 32),
        **{f"blk.0.attn_{p}.weight": torch.zeros(32, 32) for p in ("q", "k", "v", "output")},
        **{f"blk.0.ffn_{p}_exps.weight": torch.zeros(4, 16, 32) for p in ("gate", "up")},
        "blk.0.ffn_down_exps.weight": torch.zeros(4, 32, 16),
    }
    with pytest.raises(MissingWeightError, match=r"blk\.0\.ffn_up_exps\.weight: expected shape"):
        Transformer(config, DictWeightProvider(weights))


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_an_expert_swap_equals_a_fresh_load_and_restores(tmp_path: Path, storage: Storage) -> None:
    """Through HotSwapRuntime: re-quantizing one stacked expert tensor and committing its plan
    gives a fresh load's logits bit for bit; the original file back gives the first logits."""
    model_dir = ModelDir.write(tmp_path / "model", mixtral())
    saved = model_dir.save(EXPERT, tmp_path / "saved")
    variant = model_dir.variant(EXPERT, Q.Q4_0, tmp_path / "variants")
    runtime, model = open_runtime(model_dir.first, storage=storage)
    try:
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, EXPERT, variant, storage=storage, saved=saved
        )
    finally:
        runtime.close()


def test_the_server_answers_across_an_expert_swap(tmp_path: Path) -> None:
    """The HTTP server runs the file; a committed expert swap is named by the next response, and
    swapping back gives the first completion again."""
    models = ModelDir.write(tmp_path / "model", mixtral())
    saved = models.save(EXPERT, tmp_path / "saved")
    variant = models.variant(EXPERT, Q.Q4_0, tmp_path / "variants")
    assert_swap_round_trip_while_serving(models, EXPERT, variant, saved)


PER_EXPERT = "blk.1.ffn_down.2.weight"
FAMILY1 = tuple(f"blk.1.ffn_{r}.{e}.weight" for e in range(4) for r in ("gate", "up", "down"))


def test_per_expert_file_computes_the_stacked_files_logits(tmp_path: Path) -> None:
    """The per-expert layout holds the stacked tensors' bytes expert by expert: both files give
    the same logits bit for bit, in both storages."""
    stacked = ModelDir.write(tmp_path / "stacked", mixtral()).first
    split = ModelDir.write(tmp_path / "split", mixtral(per_expert_tensors=True)).first
    names = set(read_header(split).tensor_map()) | {
        n for p in split.parent.iterdir() for n in read_header(p).tensor_map()
    }
    assert PER_EXPERT in names
    assert not any(n.endswith("_exps.weight") for n in names)
    for storage in (Storage.DEQUANTIZED, Storage.NATIVE):
        ours = fresh_logits(split, storage=storage)
        assert torch.equal(ours, fresh_logits(stacked, storage=storage)), storage


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_a_per_expert_swap_equals_a_fresh_load_and_restores(
    tmp_path: Path, storage: Storage
) -> None:
    """Re-quantizing one expert's tensor of an old Mixtral file and committing it gives a fresh
    load's logits bit for bit; the original file back gives the first logits. The block's 12
    per-expert tensors form one family."""
    model_dir = ModelDir.write(tmp_path / "model", mixtral(per_expert_tensors=True))
    saved = model_dir.save(PER_EXPERT, tmp_path / "saved")
    variant = model_dir.variant(PER_EXPERT, Q.Q4_0, tmp_path / "variants")
    runtime, model = open_runtime(model_dir.first, storage=storage)
    try:
        assert sorted(runtime.store.families["blk.1.ffn_exps"]) == sorted(FAMILY1)
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, PER_EXPERT, variant, storage=storage, saved=saved
        )
    finally:
        runtime.close()


def test_per_expert_family_falls_back_together(tmp_path: Path) -> None:
    """In native storage, one per-expert tensor growing past its full pool (Q8_0 -> F16) moves
    all 12 tensors of its block's family to host memory in one commit, outputs equal to a fresh
    load; the original back returns them all."""
    model_dir = ModelDir.write(tmp_path / "model", mixtral(per_expert_tensors=True))
    pools = cpu_pools(loaded_bytes(model_dir.first, Storage.NATIVE) + 1024)
    saved = model_dir.save(PER_EXPERT, tmp_path / "saved")
    big = model_dir.variant(PER_EXPERT, Q.F16, tmp_path / "variants")
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, pools=pools)
    try:
        others = tuple(n for n in runtime.store.slots if n not in FAMILY1)
        model_dir.put(PER_EXPERT, big)
        ticket = runtime.apply(model_dir.plan("big", [PER_EXPERT]))
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        assert slot_states(runtime, FAMILY1) == {SlotState.FALLBACK_CPU}
        assert slot_states(runtime, others) == {SlotState.ON_ORIGINAL}
        assert torch.equal(logits(model), fresh_logits(model_dir.first, storage=Storage.NATIVE))
        model_dir.put(PER_EXPERT, saved)
        runtime.apply(model_dir.plan("back", [PER_EXPERT]))
        assert slot_states(runtime, tuple(runtime.store.slots)) == {SlotState.ON_ORIGINAL}
    finally:
        runtime.close()


def test_a_per_expert_file_missing_an_expert_is_refused_naming_it(tmp_path: Path) -> None:
    """Every expert of every block must be in an old Mixtral file: a missing one is named."""
    first = ModelDir.write(tmp_path / "model", mixtral(per_expert_tensors=True)).first
    runtime, _ = open_runtime(first)
    try:
        weights = {n: runtime.store.weight(n) for n in runtime.store.slots if n != PER_EXPERT}
        config = HParams.from_metadata(read_header(first).metadata)
    finally:
        runtime.close()
    with pytest.raises(MissingWeightError, match=r"blk\.1\.ffn_down\.2\.weight: missing"):
        Transformer(config, DictWeightProvider(weights))


def test_the_writer_keeps_the_per_expert_layout_to_llama() -> None:
    """Only llama MoE files ever had one tensor per expert: other specs are refused."""
    with pytest.raises(ValueError, match="per_expert_tensors is the old Mixtral layout"):
        tiny_moe(per_expert_tensors=True)
    with pytest.raises(ValueError, match="per_expert_tensors is the old Mixtral layout"):
        ModelSpec(arch="llama", per_expert_tensors=True)


def test_the_server_answers_across_a_per_expert_swap(tmp_path: Path) -> None:
    """An old Mixtral file is served; a committed swap of one expert's tensor is named by the
    next response, and swapping back gives the first completion again."""
    models = ModelDir.write(tmp_path / "model", mixtral(per_expert_tensors=True))
    saved = models.save(PER_EXPERT, tmp_path / "saved")
    variant = models.variant(PER_EXPERT, Q.Q4_0, tmp_path / "variants")
    assert_swap_round_trip_while_serving(models, PER_EXPERT, variant, saved)
