"""Models quantized with ik_llama.cpp's types load, swap and restore exactly, as in a sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_helpers import WAIT_S, ModelDir, fresh_logits, logits, one_thread, open_runtime

from ggufswap.runtime import PlanState, SlotState, Storage
from ggufswap.runtime.kernels import float_products
from ggufswap.runtime.kernels.dequant import dequantize
from ggufswap.runtime.kernels.qmatmul import QuantizedMatrix
from ggufswap.runtime.serving.perplexity import (
    evaluate_batches,
    make_eval_tokens,
    scored_per_chunk,
    token_windows,
)
from ggufswap.shards import (
    ChangeKind,
    GGMLType,
    ModelSpec,
    Role,
    diff_tables,
    fingerprint,
    read_header,
    tiny_moe,
    write_model,
)
from ggufswap.shards._synth import synth_ik_tensor
from ggufswap.shards.data import read_tensor_bytes
from ggufswap.shards.writer import F32_ROLES, NORM_ROLES, plan_tensors

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

FAMILY = tuple(f"blk.1.ffn_{part}_exps.weight" for part in ("gate", "up", "down"))
WRITTEN_TYPES = ("iq4_ks", "iq1_kt", "iq2_k", "iq6_k", "q6_0", "iq1_bn", "iq4_kt", "iq3_ks")


def ik_moe(matrix_type: str = "iq4_ks", **types: str) -> ModelSpec:
    """The tiny MoE model at rows of 256 (ik's super-block), every matrix in ``matrix_type``."""
    spec = tiny_moe(n_embd=256, n_ff=256, n_ff_expert=256)
    every = {r.name: matrix_type for r in Role if r not in F32_ROLES}
    return spec.with_types(**{**every, **types})


@pytest.mark.parametrize("type_name", WRITTEN_TYPES)
def test_writer_writes_ik_types_with_sensible_values(tmp_path: Path, type_name: str) -> None:
    """The writer writes valid rows of an ik type: they read back, decode finite, and have
    the intended spread."""
    spec = tiny_moe(n_embd=256, n_ff=256, n_ff_expert=256, n_layers=1).with_types(
        ffn_up_exps=type_name, attn_q=type_name, token_embd=type_name
    )
    (path,) = write_model(spec, tmp_path)
    records = read_header(path).tensor_map()
    for t in plan_tensors(spec):
        rec = records[t.name]
        if t.role not in (Role.FFN_UP_EXPS, Role.ATTN_Q, Role.TOKEN_EMBD):
            continue
        assert rec.ggml_type is GGMLType[type_name.upper()], t.name
        raw = torch.from_numpy(np.frombuffer(read_tensor_bytes(rec), dtype=np.uint8).copy())
        values = dequantize(raw, rec.ggml_type, rec.ne, strict=True)
        assert torch.isfinite(values).all(), t.name
        std, target = float(values.std()), 1.0 / np.sqrt(t.ne[0])
        assert t.role not in NORM_ROLES
        assert target / 3 < std < target * 3, (t.name, std, target)


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_expert_family_to_iq1_kt_and_back(tmp_path: Path, storage: Storage) -> None:
    """The sweep's round: a model in IQ4_KS has one expert family swapped to IQ1_KT, perplexity
    is measured per weight version, and the restore gives the baseline's logits and perplexity
    bit for bit; the swapped model equals a fresh load of its files."""
    model_dir = ModelDir.write(tmp_path / "model", ik_moe())
    low = ModelDir.write(
        tmp_path / "low",
        ik_moe(ffn_gate_exps="iq1_kt", ffn_up_exps="iq1_kt", ffn_down_exps="iq1_kt"),
    )
    saved = {name: model_dir.save(name, tmp_path / "saved") for name in FAMILY}
    runtime, model = open_runtime(model_dir.first, storage=storage, strict=True)
    try:
        tokens = make_eval_tokens(model.config.n_vocab, n_tokens=4 * 16, seed=7)
        batches = token_windows(tokens, ctx=16, batch_size=2)  # two batches per round
        usage = runtime.store.pools.usage()
        baseline = logits(model)
        assert torch.equal(baseline, fresh_logits(model_dir.first, storage=storage))
        assert {runtime.store.slots[n].ggml_type for n in FAMILY} == {GGMLType.IQ4_KS}

        per_version = dict(
            evaluate_batches(model, batches, between_batches=runtime.at_batch_boundary)
        )
        for name in FAMILY:
            model_dir.put(name, low.shard_of(name))
        swap = runtime.submit(model_dir.plan("to-iq1_kt", FAMILY))
        assert runtime.wait_staged(timeout=WAIT_S), swap.summary()
        per_version |= evaluate_batches(model, batches, between_batches=runtime.at_batch_boundary)
        assert swap.state is PlanState.COMMITTED, swap.summary()
        assert {runtime.store.slots[n].ggml_type for n in FAMILY} == {GGMLType.IQ1_KT}
        swapped = logits(model)
        assert torch.equal(swapped, fresh_logits(model_dir.first, storage=storage))
        assert not torch.equal(swapped, baseline)

        for name in FAMILY:
            model_dir.put(name, saved[name])
        back = runtime.submit(model_dir.plan("restore", FAMILY))
        assert runtime.wait_staged(timeout=WAIT_S), back.summary()
        per_version |= evaluate_batches(model, batches, between_batches=runtime.at_batch_boundary)
        assert back.state is PlanState.COMMITTED, back.summary()

        assert list(per_version) == [0, 1, 2]
        # two windows per batch, the second half of each scored (the one protocol)
        assert all(s.n_tokens == 2 * 2 * scored_per_chunk(16) for s in per_version.values())
        ppl = {v: s.perplexity for v, s in per_version.items()}
        assert ppl[2] == ppl[0], ppl
        assert ppl[1] != ppl[0], ppl
        assert torch.equal(logits(model), baseline)
        assert runtime.store.pools.usage() == usage
        assert {runtime.store.slots[n].state for n in FAMILY} == {SlotState.ON_ORIGINAL}
    finally:
        runtime.close()


@pytest.mark.parametrize("type_name", ["IQ4_KS", "IQ1_KT", "IQ2_BN", "IQ5_K"])
def test_native_product_of_ik_matrix(type_name: str) -> None:
    """Native storage's float products multiply an ik-typed matrix (row headers included) as its
    decoded values do, for one activation row and many, and decode any band of rows alike
    (ggml's own products, which round the activations, are checked by test_ggml_golden.py)."""
    t = GGMLType[type_name]
    rows, cols = 48, 512
    data = synth_ik_tensor(np.random.default_rng(3), t, (cols, rows), std=0.05)
    raw = torch.from_numpy(data)
    matrix = QuantizedMatrix(raw, t, (rows, cols), "blk.0.ffn_up.weight")
    w = dequantize(raw, t, (cols, rows), strict=True)  # [rows, cols]
    assert torch.equal(matrix.decode(torch.float32, 5, 17), w[5:17])
    for n in (1, 16):
        x = torch.randn(n, cols)
        with float_products():
            y = matrix.linear(x, dtype=torch.float32)
        assert torch.allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)


def test_diff_sees_a_family_change_to_iq1_kt(tmp_path: Path) -> None:
    """The table diff between an IQ4_KS model and the same model with one expert family in
    IQ1_KT reports exactly those three tensors, with both type names and byte sizes."""
    model_dir = ModelDir.write(tmp_path / "model", ik_moe())
    low = ModelDir.write(
        tmp_path / "low",
        ik_moe(ffn_gate_exps="iq1_kt", ffn_up_exps="iq1_kt", ffn_down_exps="iq1_kt"),
    )
    before = model_dir.records()
    for name in FAMILY:
        model_dir.put(name, low.shard_of(name))
    changes = diff_tables(before, model_dir.records(), fingerprint=fingerprint)
    assert [c.name for c in changes] == sorted(FAMILY)
    for change in changes:
        assert change.kind is ChangeKind.MODIFIED
        assert change.new is not None
        assert change.new.nbytes < before[change.name].nbytes
        assert "type IQ4_KS -> IQ1_KT" in change.describe()
