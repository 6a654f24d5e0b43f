"""Loading at disk speed and quantized-resident reads: each tensor read once into its buffer and
fingerprinted in the same pass, file changes during a load refused, experts decoded one at a
time (only the routed ones), dense tensors decoded once into a bounded cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import (
    ModelDir,
    Q,
    cpu_pools,
    float_kernels,
    logits,
    one_thread,
    open_runtime,
)
from test_runtime_split import dev_budget

from ggufswap.runtime import (
    HotSwapRuntime,
    Placement,
    Pool,
    PoolSet,
    QuantizedMatrix,
    Storage,
    loading,
)
from ggufswap.runtime import placement as placement_module
from ggufswap.runtime.kernels import _compiled, ggml_library
from ggufswap.runtime.kernels import experts as experts_module
from ggufswap.runtime.kernels.scratch import role_scratch
from ggufswap.runtime.loading import Loader, LoadJob, Segment
from ggufswap.runtime.models import HParams, Transformer, build_model
from ggufswap.runtime.resident import DecodedCache
from ggufswap.runtime.store import TensorStore
from ggufswap.shards import FileChangedError, TensorRecord, open_shard_set
from ggufswap.shards.errors import TruncatedError
from ggufswap.shards.fingerprint import fingerprint
from ggufswap.shards.presets import tiny_moe

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN0 = "blk.0.ffn_down_exps.weight"


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_load_fingerprints_every_tensor_as_a_separate_hash_of_the_file_would(
    tmp_path: Path, storage: Storage
) -> None:
    """The fingerprint computed while loading equals the agent's (a separate read of the file),
    and native slots hold exactly the file's bytes."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, _ = open_runtime(model_dir.first, storage=storage)
    try:
        for name, slot in runtime.store.slots.items():
            assert slot.fingerprint == fingerprint(slot.record), name
            if storage is Storage.NATIVE:
                with open(slot.record.path, "rb") as f:
                    f.seek(slot.record.offset)
                    expected = f.read(slot.record.nbytes)
                assert bytes(slot.active.tensor.numpy()[: slot.record.nbytes]) == expected, name
    finally:
        runtime.close()


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_chunked_split_load_computes_what_a_whole_load_does(
    tmp_path: Path, storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny chunks (a row or two) cut at expert-range boundaries over two pools give the same
    logits as one chunk per tensor on one pool."""
    model_dir = ModelDir.write(tmp_path / "model")
    whole, model = open_runtime(model_dir.first, storage=storage)
    try:
        expected = logits(model)
    finally:
        whole.close()
    monkeypatch.setattr(loading, "CHUNK_BYTES", 100)
    split, model = open_runtime(
        model_dir.first,
        storage=storage,
        pools=cpu_pools(dev_budget(model_dir, storage, experts_on_dev=2)),
        placement=Placement(split_experts=True),
    )
    try:
        assert any(slot.is_split for slot in split.store.slots.values()), "nothing was split"
        assert torch.equal(logits(model), expected)
    finally:
        split.close()


def test_a_file_replaced_during_the_load_is_refused_naming_it(tmp_path: Path) -> None:
    """A shard replaced between reading the header and reading its data fails the load with
    the file and tensor named; nothing is left running."""
    model_dir = ModelDir.write(tmp_path / "model")
    shards = open_shard_set(model_dir.first)
    record = shards.tensors[DOWN0]
    model_dir.put(DOWN0, model_dir.variant(DOWN0, Q.Q4_0, tmp_path / "variants"))
    loader = Loader(
        decode=lambda raw, rec, lo, hi, dest: None,
        row_slice=lambda rec, seg, lo, hi: seg.flat,
        direct=lambda seg: False,
    )
    jobs = [
        LoadJob(r, (Segment(0, r.n_elements // r.ne[0], torch.empty(0)),))
        for r in shards.tensors.values()
    ]
    with pytest.raises(FileChangedError, match=DOWN0) as caught:
        list(loader.run(jobs))
    assert os.path.basename(record.path) in str(caught.value)


def test_a_failed_load_gives_its_pools_back_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that fails halfway through reading (here the tenth read finds the file truncated)
    raises naming the file, and the pools it was given account for no bytes afterwards."""
    model_dir = ModelDir.write(tmp_path / "model")
    calls = []
    real = loading.read_range

    def failing(fd: int, record: TensorRecord, start: int, out: memoryview) -> None:
        calls.append(record.name)
        if len(calls) == 10:
            raise TruncatedError(record.path, f"{record.name}: file ends inside the tensor data")
        real(fd, record, start, out)

    monkeypatch.setattr(loading, "read_range", failing)
    pools = [Pool("host", torch.device("cpu"))]
    with pytest.raises(TruncatedError, match="file ends inside"):
        HotSwapRuntime.open(model_dir.first, pools=pools)
    assert len(calls) == 10
    assert pools[0].used == 0


def dequantized_and_native_logits(first: Path, token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``token``'s logits from a fresh load in dequantized storage, then in native storage."""
    out = []
    for storage in (Storage.DEQUANTIZED, Storage.NATIVE):
        runtime, model = open_runtime(first, storage=storage)
        try:
            out.append(logits(model, token))
        finally:
            runtime.close()
    return tuple(out)


@pytest.mark.usefixtures(float_kernels.__name__)
def test_native_moe_reads_only_the_routed_experts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In native storage (float kernels) a one-token forward reads exactly n_expert_used experts
    of each of gate, up and down per block, each as that expert's blocks alone, and computes what
    dequantized storage computes (to float32 rounding: the sums run in another order) and
    exactly what a fresh native load computes."""
    spec = tiny_moe(n_expert=16, n_expert_used=2)
    model_dir = ModelDir.write(tmp_path / "model", spec)
    token = torch.tensor([[3]])
    expected, fresh = dequantized_and_native_logits(model_dir.first, token)
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE)
    read: list[tuple[str, tuple[int, int]]] = []
    real = experts_module.QuantizedMatrix

    def counting(raw: torch.Tensor, ggml_type: Q, shape: tuple[int, int], name: str) -> object:
        read.append((name, shape))
        return real(raw, ggml_type, shape, name)

    monkeypatch.setattr(experts_module, "QuantizedMatrix", counting)
    try:
        got = logits(model, token)
        assert torch.equal(got, fresh)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert len(read) == spec.n_layers * spec.n_expert_used * 3
        per_expert = {(64, 64)}  # n_ff_expert x n_embd and back: one expert, never the stack
        assert {shape for _, shape in read} == per_expert
    finally:
        runtime.close()


def test_native_moe_with_ggml_is_one_routed_product_per_projection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a libggml, a native one-token forward multiplies gate and up of a block by one
    mul_mat_id each in one ggml call (the activations quantized once) and down by one more, over
    the routed experts' ids, computes what a fresh native load computes bit for bit, and what
    dequantized storage computes up to ggml's 8-bit activation rounding."""
    library = ggml_library()
    if library is None:
        pytest.skip("no libggml here")
    spec = tiny_moe(n_expert=16, n_expert_used=2)
    model_dir = ModelDir.write(tmp_path / "model", spec)
    token = torch.tensor([[3]])
    expected, fresh = dequantized_and_native_logits(model_dir.first, token)
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE)
    calls: list[tuple[int, ...]] = []
    real, real_pair = type(library).mul_mat_id, library.module.mul_mat_ids

    def counting(self: object, raw: torch.Tensor, t: int, shape: tuple[int, int, int],
                 x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
        calls.append(tuple(ids.shape))
        return real(self, raw, t, shape, x, ids)  # type: ignore[arg-type]

    def counting_pair(*args: Any) -> None:
        calls.append((args[2], args[4], len(args[7])))  # tokens, slots, stacks
        real_pair(*args)

    monkeypatch.setattr(type(library), "mul_mat_id", counting)
    monkeypatch.setattr(library.module, "mul_mat_ids", counting_pair)
    try:
        got = logits(model, token)
        assert torch.equal(got, fresh)
        block = [(1, spec.n_expert_used, 2), (1, spec.n_expert_used)]  # gate and up; down
        assert calls == block * spec.n_layers
        error = (got - expected).norm() / expected.norm()
        assert 0 < error < 0.02, error
    finally:
        runtime.close()


@pytest.mark.usefixtures(float_kernels.__name__)
def test_native_dense_tensors_are_decoded_once_and_again_after_a_swap(tmp_path: Path) -> None:
    """The second forward decodes no dense tensor; a committed swap of one tensor decodes that
    one again, and the model computes what a fresh load of the new files computes."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE)
    try:
        logits(model)
        cache = runtime.store.decoded
        misses = cache.misses
        logits(model)
        assert cache.misses == misses
        name = "blk.1.attn_q.weight"
        model_dir.put(name, model_dir.variant(name, Q.Q8_0, tmp_path / "variants"))
        runtime.apply(model_dir.plan("p", [name]))
        swapped = logits(model)
        assert cache.misses == misses + 1
        with HotSwapRuntime.open(model_dir.first, storage=Storage.NATIVE) as fresh:
            assert fresh.shards is not None
            fresh_model = Transformer(HParams.from_metadata(fresh.shards.metadata), fresh.store)
            assert torch.equal(swapped, logits(fresh_model))
    finally:
        runtime.close()


def test_decoded_cache_keeps_at_most_its_budget() -> None:
    """Least recently used out first; an entry bigger than the budget is never kept; a new
    content for a name replaces its old entry; a negative budget is refused."""
    cache = DecodedCache(budget=3 * 400)
    made: list[str] = []

    def decode(name: str, numel: int = 100) -> torch.Tensor:
        made.append(name)
        return torch.zeros(numel)

    for name in ("a", "b", "c"):
        cache.get((name, "f1", 8), lambda n=name: decode(n))  # type: ignore[misc]
    cache.get(("a", "f1", 8), lambda: decode("a"))  # hit: a is now the most recent
    cache.get(("d", "f1", 8), lambda: decode("d"))  # evicts b
    assert made == ["a", "b", "c", "d"]
    cache.get(("b", "f1", 8), lambda: decode("b"))
    assert made[-1] == "b"
    assert cache.used <= cache.budget
    cache.get(("a", "f2", 8), lambda: decode("a"))  # new content for a
    assert made[-1] == "a"
    cache.get(("big", "f1", 8), lambda: decode("big", 1000))
    cache.get(("big", "f1", 8), lambda: decode("big", 1000))
    assert made[-2:] == ["big", "big"]
    assert cache.snapshot()["entries"] == 3
    with pytest.raises(ValueError, match=">= 0 bytes"):
        DecodedCache(budget=-1)


def test_role_scratch_is_one_buffer_per_role_and_thread() -> None:
    """Blocks share a role's buffer; roles do not share; it grows for a bigger shape."""
    cpu = torch.device("cpu")
    a = role_scratch("blk.0.ffn_up_exps.weight", (4, 8), torch.float32, cpu)
    b = role_scratch("blk.5.ffn_up_exps.weight", (4, 8), torch.float32, cpu)
    c = role_scratch("blk.0.ffn_gate_exps.weight", (4, 8), torch.float32, cpu)
    assert a.data_ptr() == b.data_ptr() != c.data_ptr()
    big = role_scratch("blk.0.ffn_up_exps.weight", (8, 8), torch.float32, cpu)
    assert big.shape == (8, 8)


@pytest.mark.parametrize("ggml", [False, True], ids=["no-libggml", "libggml"])
def test_storage_auto_goes_native_where_it_does_not_fit_or_ggml_multiplies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ggml: bool
) -> None:
    """``auto`` loads native where the pools cannot hold the float tensors; where they can, native
    when ggml's kernels multiply the model's quantized matrices on the CPU (faster and at GGUF
    size), else dequantized; the status says which; a store is never built with ``auto``."""
    library = ggml_library()
    if ggml and library is None:
        pytest.skip("no libggml here")
    if not ggml:
        monkeypatch.setattr(placement_module, "ggml_library", lambda: None)
    model_dir = ModelDir.write(tmp_path / "model")
    shards = open_shard_set(model_dir.first)
    float_bytes = sum(r.n_elements * 4 for r in shards.tensors.values())
    file_bytes = sum(r.nbytes for r in shards.tensors.values())
    assert file_bytes < float_bytes // 2
    fits = Storage.NATIVE if ggml else Storage.DEQUANTIZED
    for budget, expected in ((float_bytes, fits), (file_bytes, Storage.NATIVE)):
        pools = [Pool("host", torch.device("cpu"), budget=budget)]
        runtime, model = open_runtime(model_dir.first, storage=Storage.AUTO, pools=pools)
        try:
            assert runtime.status()["storage"] == expected.value
            logits(model)
        finally:
            runtime.close()
    with pytest.raises(ValueError, match="auto"):
        TensorStore(
            pools=PoolSet([]), storage=Storage.AUTO, compute_dtype=torch.float32, strict=False
        )


@pytest.mark.usefixtures(float_kernels.__name__)
def test_native_dense_matrices_multiply_from_blocks_when_the_cache_cannot_hold_them(
    tmp_path: Path,
) -> None:
    """With a decoded cache too small for the dense matrices, the model multiplies them from
    their blocks (nothing is decoded into the cache); it computes what dequantized storage
    computes to float32 rounding, and a swap computes what a fresh load with the same settings
    computes, bit for bit."""
    model_dir = ModelDir.write(tmp_path / "model")
    dequantized_rt, dequantized_model = open_runtime(model_dir.first)
    try:
        expected = logits(dequantized_model)
    finally:
        dequantized_rt.close()
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, decoded_cache=0)
    try:
        matrix = runtime.store.matrix("blk.1.attn_k.weight")
        assert isinstance(matrix, QuantizedMatrix) == bool(_compiled.types())
        torch.testing.assert_close(logits(model), expected, rtol=1e-4, atol=1e-4)
        assert runtime.store.decoded.snapshot()["entries"] <= 1  # token_embd, for the lookup
        name = "blk.1.attn_q.weight"
        model_dir.put(name, model_dir.variant(name, Q.Q4_0, tmp_path / "variants"))
        runtime.apply(model_dir.plan("p", [name]))
        swapped = logits(model)
    finally:
        runtime.close()
    fresh_rt, fresh_model = open_runtime(model_dir.first, storage=Storage.NATIVE, decoded_cache=0)
    try:
        assert torch.equal(swapped, logits(fresh_model))
    finally:
        fresh_rt.close()


@pytest.mark.skipif(not _compiled.types(), reason="needs the compiled kernels")
def test_native_decode_steps_multiply_from_blocks_and_batches_use_the_decoded_cache(
    tmp_path: Path,
) -> None:
    """A one-token step decodes no dense matrix (only token_embd's rows are looked up through
    the cache); a batch of many rows decodes each matrix once into the cache."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE)
    try:
        logits(model, torch.tensor([[5]]))
        assert runtime.store.decoded.snapshot()["entries"] <= 2  # token_embd, output (F16)
        logits(model, torch.arange(32).view(2, 16))
        assert runtime.store.decoded.snapshot()["entries"] > 2
    finally:
        runtime.close()


def test_native_embedding_lookups_decode_only_the_rows_asked_for(tmp_path: Path) -> None:
    """store.rows gives, for ids of any shape (repeats included; one token, as a decode step
    asks), exactly the rows of the decoded table, without putting the table in the decoded
    cache; an id past the table is refused, one token or several."""
    model_dir = ModelDir.write(tmp_path / "model")
    dequantized, _ = open_runtime(model_dir.first)
    native, _ = open_runtime(model_dir.first, storage=Storage.NATIVE)
    try:
        table = dequantized.store.weight("token_embd.weight")
        for ids in (torch.tensor([[7, 3, 7], [0, 255, 3]]), torch.tensor([[255]]), torch.tensor(9)):
            got = native.store.rows("token_embd.weight", ids)
            assert got.shape == (*ids.shape, table.shape[1])
            assert torch.equal(got, table[ids])
        for wrong in (torch.tensor([[256]]), torch.tensor([[-1]]), torch.tensor([[3, 256]])):
            with pytest.raises((IndexError, RuntimeError)):
                native.store.rows("token_embd.weight", wrong)
        assert native.store.decoded.snapshot()["entries"] == 0
    finally:
        dequantized.close()
        native.close()


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_populate_faults_a_fresh_buffer_in_and_keeps_contents() -> None:
    """A destination is faulted in by one madvise call before the read fills it (Linux 5.14+):
    its pages become resident, and what it already held is unchanged."""
    if os.uname().sysname != "Linux" or tuple(
        int(p) for p in os.uname().release.split(".")[:2] if p.isdigit()
    ) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14+")
    fresh = torch.empty(64 << 20, dtype=torch.uint8)  # above glibc's mmap threshold: untouched
    before = _rss_bytes()
    assert loading.populate(fresh)
    assert _rss_bytes() - before >= 60 << 20
    held = torch.arange(1 << 20, dtype=torch.int32)
    assert loading.populate(held)
    assert torch.equal(held, torch.arange(1 << 20, dtype=torch.int32))
    assert not loading.populate(torch.empty(16, dtype=torch.uint8))  # too small to bother


def test_exact_numerics_multiply_in_float_over_native_storage(tmp_path: Path) -> None:
    """build_model(numerics="exact") over a native store multiplies in float even where a
    libggml could (what the float kernels compute, to float32 rounding of dequantized storage);
    the default (None) takes the store's fastest kernels."""
    model_dir = ModelDir.write(tmp_path / "model")
    hparams = HParams.from_metadata(open_shard_set(model_dir.first).metadata)
    runtime, _ = open_runtime(model_dir.first, storage=Storage.DEQUANTIZED)
    try:
        expected = logits(build_model(hparams, runtime.store))
    finally:
        runtime.close()
    runtime, _ = open_runtime(model_dir.first, storage=Storage.NATIVE)
    try:
        exact = logits(build_model(hparams, runtime.store, store=runtime.store, numerics="exact"))
        fastest = logits(build_model(hparams, runtime.store, store=runtime.store))
    finally:
        runtime.close()
    torch.testing.assert_close(exact, expected, rtol=1e-4, atol=1e-4)
    if ggml_library() is not None:
        assert not torch.equal(fastest, exact)  # ggml's 8-bit activations
