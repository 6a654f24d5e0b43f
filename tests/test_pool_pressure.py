"""Memory does not double when one plan swaps every tensor of a model (a sweep's whole-model
group round): on a pool that cannot hold a second copy, the staged contents that do not fit are
decoded at commit straight into the buffers the tensors were loaded into (their original
contents given up), the restore re-reads the files, and the pool never exceeds its budget and
ends at its baseline, the model's outputs equal to the baseline's bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import ModelDir, Q, logits, one_thread, open_runtime

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import Pool, SlotState
from ggufswap.shards import GGMLType, read_header, tiny_dense

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def _variant_type(ggml_type: GGMLType) -> Q:
    return Q.F16 if ggml_type == GGMLType.F32 else Q.Q4_0


@pytest.mark.parametrize("headroom", ["none", "half_the_largest"])
def test_whole_model_group_round_under_pool_pressure(tmp_path: Path, headroom: str) -> None:
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    records = model.records()
    probe, _ = open_runtime(model.first)
    try:
        baseline_bytes = probe.store.pools["host"].used
        largest = max(s.original.nbytes for s in probe.store.slots.values())
    finally:
        probe.close()
    budget = baseline_bytes + (0 if headroom == "none" else largest // 2)
    runtime, net = open_runtime(
        model.first,
        pools=[Pool("host", torch.device("cpu"), budget=budget)],
        allowed_roots=[str(tmp_path)],
    )
    pool = runtime.store.pools["host"]
    try:
        assert pool.used == baseline_bytes
        baseline = logits(net)
        weights = {n: runtime.store.weight(n).clone() for n in records}
        jobs = []
        for name, record in records.items():
            variant = model.variant(name, _variant_type(record.ggml_type), tmp_path / "variants")
            jobs.append(Job(read_header(variant).tensor_map()[name]))
        swapped = runtime.apply(Plan("every-tensor", "", tuple(jobs)))
        assert set(swapped.changed) == set(records), "one commit swapped every tensor"
        assert pool.used == baseline_bytes
        assert pool.peak <= budget, "staging never held more than the pool's budget"
        assert not torch.equal(logits(net), baseline)
        # the originals' contents were given up: no slot still holds them
        slots = runtime.store.slots
        assert [n for n, s in slots.items() if s.held[0] == s.original_fingerprint] == []
        restored = runtime.apply(model.plan("restore", list(records)))
        assert set(restored.changed) == set(records)
        assert restored.bytes_read == sum(r.nbytes for r in records.values()), "re-read"
        assert pool.used == baseline_bytes
        assert pool.peak <= budget
        assert {s.state for s in runtime.store.slots.values()} == {SlotState.ON_ORIGINAL}
        for name, weight in weights.items():
            assert torch.equal(runtime.store.weight(name), weight), name
        assert torch.equal(logits(net), baseline)
    finally:
        runtime.close()
