"""``runtime.map_shards``: native CPU tensors served from their files' pages under read leases.

A mapped load computes what a copied one does; swaps and returns to the original content work on
mapped originals; a writer that opens a served shard in place waits while the runtime moves the
file's pages into memory of its own, and the served weights do not change (nor fault, when the
writer truncates the file); a file that cannot be leased is copied (``auto``) or refused
(``true``), naming it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    WAIT_S,
    ModelDir,
    Q,
    assert_swap_equals_fresh_load,
    logits,
    one_thread,
    open_runtime,
)

from ggufswap.config import MapShards, load_config_text
from ggufswap.runtime import HotSwapRuntime, MapRefused, SlotState, Storage, _pages
from ggufswap.runtime.models import Transformer
from ggufswap.runtime.serving.events import Event, Failed, Generation
from ggufswap.runtime.serving.generate import WEIGHTS_CHANGED, Batcher, BatcherOptions
from ggufswap.runtime.serving.sampling import Sampling
from ggufswap.runtime.serving.tokenizer import GgufTokenizer

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN0 = "blk.0.ffn_down_exps.weight"
ATTN_Q0 = "blk.0.attn_q.weight"
GATE0 = "blk.0.ffn_gate_exps.weight"  # Q4_0 in the mixed model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    return ModelDir.write(tmp_path_factory.mktemp("mapped") / "model")


@pytest.fixture
def own_model(tmp_path: Path) -> ModelDir:
    """A model of the test's own, for tests that change its files."""
    return ModelDir.write(tmp_path / "model")


@contextlib.contextmanager
def mapped(model_dir: ModelDir) -> Iterator[tuple[HotSwapRuntime, Transformer]]:
    """A runtime serving ``model_dir`` from mappings (not a fixture: pytest would keep the
    tensors, and so the mappings and their descriptors, alive past the leak check)."""
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
    try:
        yield runtime, model
    finally:
        runtime.close()


def _mapped_files() -> set[str]:
    """Paths of the files this process maps (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split()) > 5}


def test_a_mapped_load_serves_the_files_pages_and_computes_what_a_copied_one_does(
    model_dir: ModelDir,
) -> None:
    copied, copied_model = open_runtime(model_dir.first, storage=Storage.NATIVE)
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
    try:
        slots = runtime.store.slots
        assert all(slot.original.mapped for slot in slots.values())
        assert not any(slot.original.mapped for slot in copied.store.slots.values())
        assert {s.record.path for s in slots.values()} <= _mapped_files()
        assert runtime.store.maps.mapped_files == len({s.record.path for s in slots.values()})
        for name, slot in slots.items():
            assert slot.fingerprint == copied.store.slots[name].fingerprint, name
        assert runtime.store.pools.usage() == copied.store.pools.usage()
        assert torch.equal(logits(model), logits(copied_model))
    finally:
        runtime.close()
        copied.close()


def test_dequantized_storage_is_never_mapped(model_dir: ModelDir) -> None:
    runtime, _ = open_runtime(model_dir.first, storage=Storage.DEQUANTIZED, map_shards=MapShards.ON)
    try:
        assert not any(slot.original.mapped for slot in runtime.store.slots.values())
        assert runtime.store.maps.mapped_files == 0
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "ggml_type",
    [Q.IQ4_NL, Q.Q8_0],  # from Q4_0: the same byte size (into the original's place), and larger
    ids=lambda t: t.name,
)
def test_swaps_and_returns_on_mapped_originals_equal_a_fresh_load(
    own_model: ModelDir, tmp_path: Path, ggml_type: Q
) -> None:
    """A swap away from a mapped original and back to it; the file the original maps is
    replaced by rename meanwhile, and the return is exact."""
    saved = own_model.save(GATE0, tmp_path / "saved")
    variant = own_model.variant(GATE0, ggml_type, tmp_path / "variants")
    with mapped(own_model) as (runtime, model):
        assert_swap_equals_fresh_load(
            runtime, model, own_model, GATE0, variant, storage=Storage.NATIVE, saved=saved
        )
        slot = runtime.store.slots[GATE0]
        assert slot.state is SlotState.ON_ORIGINAL
        assert slot.active is slot.original


def _write_in_place(path: Path, offset: int, nbytes: int, *, truncate: bool) -> None:
    """Another process rewrites ``path`` in place: overwrites a tensor's bytes, or truncates
    the file to nothing (``open(..., "wb")``)."""
    code = (
        f"open({str(path)!r}, 'wb').close()"
        if truncate
        else f"f = open({str(path)!r}, 'r+b'); f.seek({offset}); f.write(b'\\xa5' * {nbytes})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=WAIT_S)


@pytest.mark.process
@pytest.mark.parametrize("truncate", [False, True], ids=["overwrite", "truncate"])
def test_a_writer_in_place_waits_while_the_file_moves_out_and_served_weights_stay(
    own_model: ModelDir, truncate: bool
) -> None:
    """The writer's ``open`` blocks on the lease until the runtime has moved the file's pages
    to memory of its own at the same addresses; the model then computes what it did before,
    bit for bit, though the file now holds other bytes (or none: no SIGBUS)."""
    with mapped(own_model) as (runtime, model):
        _check_writer_in_place(runtime, model, truncate=truncate)


def _check_writer_in_place(runtime: HotSwapRuntime, model: Transformer, *, truncate: bool) -> None:
    before = logits(model)
    slot = runtime.store.slots[DOWN0]
    address = slot.active.tensor.data_ptr()
    path = Path(slot.record.path)
    _write_in_place(path, slot.record.offset, slot.record.nbytes, truncate=truncate)
    assert runtime.store.maps.moved == 1
    mapped = runtime.status()["mapped_shards"]
    assert {k: mapped[k] for k in ("policy", "mapped", "copied", "copied_why", "moved")} == {
        "policy": "true",
        "mapped": len({s.record.path for s in runtime.store.slots.values()}) - 1,
        "copied": 0,
        "copied_why": None,
        "moved": 1,
    }
    assert mapped["compromised"] == 0, mapped  # the writer waited: nothing changed unseen
    assert str(path) not in _mapped_files()
    if truncate:
        assert path.stat().st_size == 0
    else:
        with open(path, "rb") as f:
            f.seek(slot.record.offset)
            assert f.read(16) == b"\xa5" * 16
    assert slot.active.tensor.data_ptr() == address
    assert torch.equal(logits(model), before)


def test_a_file_open_for_writing_at_load_is_refused_by_true_and_copied_by_auto(
    own_model: ModelDir,
) -> None:
    busy = own_model.shard_of(ATTN_Q0)
    with open(busy, "r+b"):
        with pytest.raises(MapRefused, match=str(busy)) as refused:
            HotSwapRuntime.open(own_model.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
        assert "open for writing" in str(refused.value)
        runtime, model = open_runtime(
            own_model.first, storage=Storage.NATIVE, map_shards=MapShards.AUTO
        )
    try:
        slots = runtime.store.slots
        assert not slots[ATTN_Q0].original.mapped
        assert all(s.original.mapped for n, s in slots.items() if s.record.path != str(busy))
        assert list(runtime.store.maps.refused) == [str(busy)]
        fresh, fresh_model = open_runtime(own_model.first, storage=Storage.NATIVE)
        try:
            assert torch.equal(logits(model), logits(fresh_model))
        finally:
            fresh.close()
    finally:
        runtime.close()


def test_without_the_sigbus_guard_true_refuses_and_auto_copies(
    model_dir: ModelDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the SIGBUS guard is not built (no C compiler at install), nothing is mapped: a
    truncation could not be defended against. ``true`` refuses the load saying so in one line,
    ``auto`` copies every file with that reason."""
    monkeypatch.setattr(_pages, "_SIGBUS", [None])  # as if the extension were not built
    with pytest.raises(MapRefused, match="SIGBUS guard") as refused:
        HotSwapRuntime.open(model_dir.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
    assert "\n" not in str(refused.value)
    runtime = HotSwapRuntime.open(
        model_dir.first, storage=Storage.NATIVE, map_shards=MapShards.AUTO
    )
    try:
        snapshot = runtime.store.maps.snapshot()
        assert snapshot["mapped"] == 0
        assert snapshot["copied"] == len({s.record.path for s in runtime.store.slots.values()})
        assert "SIGBUS guard" in str(snapshot["copied_why"])
    finally:
        runtime.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", MapShards.ON), ("false", MapShards.OFF), ("auto", MapShards.AUTO)],
)
def test_the_map_shards_key(tmp_path: Path, text: str, expected: MapShards) -> None:
    config = load_config_text(
        f"runtime:\n  model: {tmp_path / 'm.gguf'}\n  map_shards: {text}\n",
        source=tmp_path / "m.yaml",
    )
    assert config.runtime is not None
    assert config.runtime.map_shards is expected


def test_a_bad_map_shards_value_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"map_shards.*expected true, false or 'auto'"):
        load_config_text(
            f"runtime:\n  model: {tmp_path / 'm.gguf'}\n  map_shards: sometimes\n",
            source=tmp_path / "m.yaml",
        )


def test_a_request_whose_weights_change_under_it_sends_nothing_computed_from_them(
    own_model: ModelDir,
) -> None:
    """A served shard truncated while a request decodes (no lease break): the token computed
    across it is not sent, the request fails naming the change, and no request is admitted
    while the tensor is out of service."""
    with mapped(own_model) as (runtime, model):
        tokenizer = GgufTokenizer.from_file(own_model.first)
        batcher = Batcher(runtime, model, tokenizer, options=BatcherOptions())
        generation = batcher.submit(["a b"], Sampling(max_tokens=40, temperature=0.0))
        assert batcher.step()  # the prompt and the first token, from whole files
        sent = _drain(generation)
        assert not any(isinstance(e, Failed) for e in sent), sent
        path = own_model.shard_of(ATTN_Q0)
        os.close(os.open(path, os.O_RDONLY | os.O_TRUNC))  # read by every token
        batcher.step()
        after = _drain(generation)
        assert after == [Failed(WEIGHTS_CHANGED)], after
        later = batcher.submit(["a b"], Sampling(max_tokens=2, temperature=0.0))
        assert not batcher.step()  # WeightsLost at the boundary: nothing admitted
        assert _drain(later) == []
        assert ATTN_Q0 in runtime.store.lost


def _drain(generation: Generation) -> list[Event]:
    events: list[Event] = []
    with contextlib.suppress(queue.Empty):
        while True:
            events.append(generation.events.get_nowait())
    return events
