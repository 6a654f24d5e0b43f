"""Pools account for every byte, placement keeps families together, and the store reports what
it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import ModelDir, Q, cpu_pools, loaded_bytes, one_thread, open_runtime

from ggufswap.runtime import (
    DerivedTensor,
    Placement,
    Pool,
    PoolFull,
    PoolSet,
    SlotState,
    Storage,
    family_of,
)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

CPU = torch.device("cpu")


def test_pool_accounts_allocations_and_refuses_past_its_budget() -> None:
    """A pool counts used and peak bytes, refuses past its budget naming itself, accepts credit,
    and a buffer released twice is returned once."""
    pool = Pool("dev", CPU, budget=1000)
    a = pool.allocate(100, torch.float32)  # 400 bytes
    b = pool.allocate(500, torch.uint8)
    assert (pool.used, pool.free) == (900, 100)
    with pytest.raises(PoolFull, match="'dev': 400 bytes requested, 100 free"):
        pool.allocate(100, torch.float32)
    c = pool.allocate(100, torch.float32, credit=400)  # the caller frees a afterwards
    a.release()
    a.release()
    b.release()
    assert (pool.used, pool.peak) == (400, 1300)
    c.release()
    assert pool.used == 0


def test_pool_set_defaults_and_refusals() -> None:
    """The fallback is the last CPU pool unless named; duplicate or unknown names are refused."""
    pools = PoolSet([Pool("a", CPU, budget=10), Pool("b", CPU)])
    assert pools.fallback.name == "b"
    assert PoolSet([Pool("a", CPU), Pool("b", CPU)], fallback="a").fallback.name == "a"
    assert PoolSet([]).fallback.name == "host"
    with pytest.raises(ValueError, match="duplicate"):
        PoolSet([Pool("a", CPU), Pool("a", CPU)])
    with pytest.raises(ValueError, match="'z' is not one of"):
        PoolSet([Pool("a", CPU)], fallback="z")


def test_load_places_families_as_units(tmp_path: Path) -> None:
    """With a first pool too small for the model, whole MoE families move to the next pool:
    no family is split, and each pool's usage is the sum of its slots' buffers."""
    model_dir = ModelDir.write(tmp_path / "model")
    total = loaded_bytes(model_dir.first, Storage.NATIVE)
    runtime, _ = open_runtime(model_dir.first, storage=Storage.NATIVE, pools=cpu_pools(total // 2))
    try:
        slots = runtime.store.slots
        homes = {name: slot.home.name for name, slot in slots.items()}
        assert set(homes.values()) == {"dev", "host"}
        for family, members in runtime.store.families.items():
            assert len({homes[m] for m in members}) == 1, family
            assert all(family_of(m) == family for m in members)
        assert len(runtime.store.families) == 4
        for name in ("dev", "host"):
            held = sum(s.original.nbytes for s in slots.values() if s.home.name == name)
            assert runtime.store.pools[name].used == held
        assert runtime.store.pools["dev"].used <= total // 2
    finally:
        runtime.close()


def test_placement_gpu_layers_and_experts_pool(tmp_path: Path) -> None:
    """gpu_layers counts as llama.cpp's -ngl (the output layer, then the last blocks, on the
    first pool; the rest and the input embedding on the fallback), and experts_pool sends every
    expert family to the named pool (tests/test_placement_llama.py has the whole table)."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, _ = open_runtime(
        model_dir.first, pools=cpu_pools(None), placement=Placement(gpu_layers=2)
    )
    try:
        slots = runtime.store.slots
        assert slots["output.weight"].home.name == "dev"
        assert slots["blk.3.attn_q.weight"].home.name == "dev"
        assert slots["blk.3.ffn_up_exps.weight"].home.name == "dev"
        assert slots["blk.2.attn_q.weight"].home.name == "host"
        assert slots["blk.0.ffn_up_exps.weight"].home.name == "host"
        assert slots["token_embd.weight"].home.name == "host"
    finally:
        runtime.close()
    runtime, _ = open_runtime(
        model_dir.first, pools=cpu_pools(None), placement=Placement(experts_pool="host")
    )
    try:
        for name, slot in runtime.store.slots.items():
            assert slot.home.name == ("host" if family_of(name) else "dev"), name
    finally:
        runtime.close()


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_store_holds_each_tensor_in_its_storage_mode(tmp_path: Path, storage: Storage) -> None:
    """Dequantized slots hold compute-dtype values, native slots the raw blocks; both give the
    model the same logical shapes, and slots start ON_ORIGINAL with their file's fingerprint."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, _ = open_runtime(model_dir.first, storage=storage)
    try:
        slot = runtime.store.slots["blk.0.ffn_down_exps.weight"]
        assert slot.state is SlotState.ON_ORIGINAL
        assert slot.is_original_content()
        assert slot.ggml_type == Q.Q8_0
        expected = torch.float32 if storage is Storage.DEQUANTIZED else torch.uint8
        assert slot.active.tensor.dtype == expected
        assert runtime.store.weight(slot.name).shape == (4, 64, 64)
        assert runtime.store.weight(slot.name).dtype == torch.float32
        assert runtime.store.state_counts()[SlotState.ON_ORIGINAL.value] == 51
        status = runtime.status()
        assert status["weight_version"] == 0
        assert status["storage"] == storage.value
        assert status["pending"] == 0
    finally:
        runtime.close()


def test_register_derived_checks_its_sources(tmp_path: Path) -> None:
    """A derived tensor needs known sources, and a value or a rebuild function."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, _ = open_runtime(model_dir.first)
    try:
        store = runtime.store
        with pytest.raises(KeyError, match="unknown sources"):
            store.register_derived(DerivedTensor("x", ("nope.weight",), rebuild=None))
        with pytest.raises(ValueError, match="give a value or a rebuild"):
            store.register_derived(DerivedTensor("x", ("output.weight",), rebuild=None))
        store.register_derived(
            DerivedTensor("x", ("output.weight",), rebuild=lambda s: s["output.weight"].T)
        )
        assert torch.equal(store.weight("x"), store.weight("output.weight").T)
        assert store.has("x")
    finally:
        runtime.close()
