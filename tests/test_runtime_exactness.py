"""Hot-swapped weights give, bit for bit, the logits of a fresh load of the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import TOKENS, ModelDir, Q, fresh_logits, logits, one_thread, open_runtime

from ggufswap.config import MapShards
from ggufswap.runtime import PlanState, SlotState, Storage
from ggufswap.shards import Layout, tiny_dense

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN0 = "blk.0.ffn_down_exps.weight"  # Q8_0 in the mixed model
GATE1 = "blk.1.ffn_gate_exps.weight"  # Q4_0
ATTN_Q2 = "blk.2.attn_q.weight"  # F16
EMBD = "token_embd.weight"  # Q8_0
OUTPUT = "output.weight"  # F16
SWAPPED = (DOWN0, GATE1, ATTN_Q2, EMBD, OUTPUT)
ORIG = None

# Each step sets some tensors to a re-encoded variant (or back to the original file); the order
# visits seven target types, returns to the originals twice, and changes several tensors at once.
STEPS: list[dict[str, Q | None]] = [
    {DOWN0: Q.Q4_0},
    {DOWN0: Q.F16, GATE1: Q.Q5_1, ATTN_Q2: Q.BF16},
    {EMBD: Q.Q4_1, OUTPUT: Q.Q5_0},
    {DOWN0: ORIG, OUTPUT: Q.Q8_0},
    {GATE1: ORIG, ATTN_Q2: Q.Q4_0, DOWN0: Q.Q5_0},
    dict.fromkeys(SWAPPED, ORIG),
    {OUTPUT: Q.BF16, DOWN0: Q.Q4_1, GATE1: Q.F16},
    dict.fromkeys(SWAPPED, ORIG),
]


@pytest.mark.parametrize("stable", [False, True], ids=["swap", "stable"])
@pytest.mark.parametrize(
    ("storage", "map_shards"),
    [
        (Storage.DEQUANTIZED, MapShards.OFF),
        (Storage.NATIVE, MapShards.OFF),
        (Storage.NATIVE, MapShards.ON),  # originals are views of the files' pages
    ],
    ids=["dequantized", "native", "native-mapped"],
)
def test_swaps_and_restores_equal_fresh_load(
    tmp_path: Path, storage: Storage, map_shards: MapShards, stable: bool
) -> None:
    """After every step of swaps to other quant types and back, logits equal a fresh load."""
    model_dir = ModelDir.write(tmp_path / "model")
    store = tmp_path / "variants"
    saved = {name: model_dir.save(name, store) for name in SWAPPED}
    variants = {
        (name, t): model_dir.variant(name, t, store)
        for step in STEPS
        for name, t in step.items()
        if t is not None
    }
    runtime, model = open_runtime(
        model_dir.first, storage=storage, stable_pointers=stable, map_shards=map_shards
    )
    try:
        files = {slot.record.path for slot in runtime.store.slots.values()}
        assert runtime.store.maps.mapped_files == (0 if map_shards is MapShards.OFF else len(files))
        baseline = logits(model)
        usage = runtime.store.pools.usage()
        pointers = {n: s.active.tensor.data_ptr() for n, s in runtime.store.slots.items()}
        assert torch.equal(baseline, fresh_logits(model_dir.first, storage=storage))
        for i, step in enumerate(STEPS):
            for name, t in step.items():
                model_dir.put(name, saved[name] if t is None else variants[name, t])
            ticket = runtime.apply(model_dir.plan(f"step-{i}", step))
            assert ticket.state is PlanState.COMMITTED, ticket.summary()
            got = logits(model)
            assert torch.equal(got, fresh_logits(model_dir.first, storage=storage)), f"step {i}"
            if all(t is None for t in step.values()):
                assert torch.equal(got, baseline), f"step {i}: originals restored"
                assert runtime.store.pools.usage() == usage
                assert set(runtime.store.state_counts().items()) >= {
                    (SlotState.ON_ORIGINAL.value, len(runtime.store.slots))
                }
            else:
                assert not torch.equal(got, baseline), f"step {i} changed the weights"
        if storage is Storage.DEQUANTIZED and stable:
            moved = [
                n
                for n, s in runtime.store.slots.items()
                if s.active.tensor.data_ptr() != pointers[n]
            ]
            assert moved == [], "stable pointers: every commit copies in place"
        if storage is Storage.DEQUANTIZED and not stable:
            assert runtime.store.slots[DOWN0].active.tensor.data_ptr() != pointers[DOWN0]
        assert runtime.weight_version == len(STEPS)
    finally:
        runtime.close()


def test_single_file_rewrite_swaps_one_tensor_exactly(tmp_path: Path) -> None:
    """In a single-file model rewritten whole (every offset after the tensor moves), a plan for
    the one changed tensor gives the fresh load's logits, and restoring gives the baseline."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_dense(), layout=Layout.SINGLE)
    name = "blk.1.ffn_gate.weight"
    saved = model_dir.save(name, tmp_path / "saved")
    variant = model_dir.variant(name, Q.Q4_1, tmp_path / "variants")
    runtime, model = open_runtime(model_dir.first, storage=Storage.DEQUANTIZED)
    try:
        baseline = logits(model)
        model_dir.put(name, variant)
        runtime.apply(model_dir.plan("down", [name]))
        assert torch.equal(
            logits(model), fresh_logits(model_dir.first, storage=Storage.DEQUANTIZED)
        )
        assert not torch.equal(logits(model), baseline)
        model_dir.put(name, saved)
        runtime.apply(model_dir.plan("back", [name]))
        assert torch.equal(logits(model), baseline)
    finally:
        runtime.close()


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_bfloat16_compute_dtype_swaps_equal_fresh_load(tmp_path: Path, storage: Storage) -> None:
    """With a bfloat16 compute dtype, a swapped tensor still equals a fresh bfloat16 load."""
    model_dir = ModelDir.write(tmp_path / "model")
    variant = model_dir.variant(DOWN0, Q.Q5_1, tmp_path / "variants")
    runtime, model = open_runtime(model_dir.first, storage=storage, compute_dtype=torch.bfloat16)
    try:
        model_dir.put(DOWN0, variant)
        runtime.apply(model_dir.plan("p", [DOWN0]))
        fresh, fresh_model = open_runtime(
            model_dir.first, storage=storage, compute_dtype=torch.bfloat16
        )
        try:
            assert torch.equal(logits(model, TOKENS), logits(fresh_model, TOKENS))
        finally:
            fresh.close()
    finally:
        runtime.close()
