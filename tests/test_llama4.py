"""llama4: llama.cpp's iSWA graph (chunked RoPE layers, NoPE layers with the attention
temperature, experts with their weights applied before them and a shared expert every
``interleave_moe_layer_step``-th block), its writer and refusals, its swaps, and llama.cpp's
logits past the 8192-position chunk border replayed from ``make crosscheck``'s fixture."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_helpers import (
    ModelDir,
    Q,
    assert_swap_equals_fresh_load,
    one_thread,
    open_model,
)

from ggufswap.runtime import Storage
from ggufswap.runtime.models import HParams, HParamsError
from ggufswap.runtime.models.blocks import DictWeightProvider, TensorSpec
from ggufswap.runtime.models.blocks.ffn import swiglu
from ggufswap.runtime.models.llama4 import CHUNK, Llama4Experts, chunked_mask, temperature
from ggufswap.shards import read_header
from ggufswap.shards.presets import tiny_llama4
from ggufswap.shards.writer import plan_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the shared code

import xcheck  # found on the path above

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN1 = "blk.1.ffn_down_exps.weight"
LONG = xcheck.family_fixtures("llama4") / "long"


def test_a_chunked_layer_sees_its_own_chunk_only() -> None:
    """A query at position p attends the keys k <= p with k >= (p // 8192) * 8192 (llama.cpp's
    LLAMA_SWA_TYPE_CHUNKED), with and without a cache; within one chunk it is plain causal."""
    device = torch.device("cpu")
    assert chunked_mask(0, 12, cached=False, device=device) is None
    cached = chunked_mask(CHUNK - 2, 4, cached=True, device=device)
    assert cached is not None
    assert cached.shape == (4, CHUNK + 2)
    for row, p in enumerate(range(CHUNK - 2, CHUNK + 2)):
        allowed = cached[row].nonzero().flatten()
        start = (p // CHUNK) * CHUNK
        assert allowed.tolist() == list(range(start, p + 1))
    uncached = chunked_mask(CHUNK - 2, 4, cached=False, device=device)
    assert uncached is not None
    assert uncached[3].tolist() == [False, False, True, True]


def test_the_nope_layers_temperature_is_llama_cpps() -> None:
    """``log(floor((p + 1) / 8192) + 1) * 0.1 + 1``: 1 up to position 8190, 1 + 0.1 ln 2 from
    8191, 1 + 0.1 ln 3 from 16383."""
    got = temperature(8189, 3, torch.device("cpu")).tolist()
    assert got == [1.0, 1.0, pytest.approx(1 + 0.1 * math.log(2), rel=1e-7)]
    assert temperature(16383, 1, torch.device("cpu")).item() == pytest.approx(
        1 + 0.1 * math.log(3), rel=1e-7
    )


def test_each_expert_sees_its_input_times_its_sigmoid_weight() -> None:
    """The experts chosen by the largest router logits see ``sigmoid(logit) * x`` (not their
    output scaled), and the ungated shared expert is added (llama.cpp's weight_before_ffn)."""
    config = HParams.from_metadata(_metadata(tiny_llama4(n_expert_used=2)))
    g = torch.Generator().manual_seed(0)
    d, e, f = config.n_embd, config.n_expert, config.n_ff_exp
    tensors = {
        "blk.1.ffn_gate_inp.weight": torch.randn(e, d, generator=g),
        "blk.1.ffn_gate_exps.weight": torch.randn(e, f, d, generator=g) / 8,
        "blk.1.ffn_up_exps.weight": torch.randn(e, f, d, generator=g) / 8,
        "blk.1.ffn_down_exps.weight": torch.randn(e, d, f, generator=g) / 8,
        "blk.1.ffn_gate_shexp.weight": torch.randn(f, d, generator=g) / 8,
        "blk.1.ffn_up_shexp.weight": torch.randn(f, d, generator=g) / 8,
        "blk.1.ffn_down_shexp.weight": torch.randn(d, f, generator=g) / 8,
    }
    moe = Llama4Experts(config, DictWeightProvider(tensors), 1, TensorSpec())
    x = torch.randn(1, 3, d, generator=g)
    t = {k.split(".")[2]: v for k, v in tensors.items()}
    want = swiglu(x[0], t["ffn_gate_shexp"], t["ffn_up_shexp"], t["ffn_down_shexp"])
    for n in range(3):
        logits = t["ffn_gate_inp"] @ x[0, n]
        for k in logits.topk(2).indices.tolist():
            xin = torch.sigmoid(logits[k]) * x[0, n]
            w = (t["ffn_gate_exps"][k], t["ffn_up_exps"][k], t["ffn_down_exps"][k])
            want[n] += swiglu(xin[None], *w)[0]
    torch.testing.assert_close(moe(x)[0], want)


def test_the_writer_places_experts_by_the_step_and_refuses_the_rest() -> None:
    """Blocks (i + 1) % step == 0 get the experts and a shared expert of their width, the others
    a dense FFN; the step is written; moe_layers, shared_expert and a partial rope are refused."""
    names = {t.name for t in plan_tensors(tiny_llama4())}
    assert {"blk.1.ffn_down_shexp.weight", "blk.0.ffn_down.weight"} <= names
    assert {"blk.3.ffn_gate_exps.weight", "blk.3.ffn_gate_shexp.weight"} <= names
    assert not {"blk.0.ffn_gate_inp.weight", "blk.2.ffn_down_shexp.weight"} & names
    md = _metadata(tiny_llama4())
    assert md["llama4.interleave_moe_layer_step"] == 2
    assert "llama4.attention.sliding_window" not in md  # llama.cpp's chunks of 8192
    for bad, reason in (
        ({"moe_layers": (1,)}, "moe_layer_step, not moe_layers"),
        ({"shared_expert": True}, "shared expert is always written"),
        ({"rope_dim": 8}, "rotates the whole head"),
    ):
        with pytest.raises(ValueError, match=reason):
            tiny_llama4(**bad)


def test_a_file_without_chunked_layers_is_refused_by_name() -> None:
    """``attention.sliding_window = 0`` (MobileLLM) is refused with the key: llama.cpp 0.3.36
    aborts on such a file (its temperature input has no temperature)."""
    md = _metadata(tiny_llama4()) | {"llama4.attention.sliding_window": 0}
    with pytest.raises(HParamsError, match=r"llama4\.attention\.sliding_window = 0"):
        HParams.from_metadata(md)


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_an_expert_swap_equals_a_fresh_load_and_restores(tmp_path: Path, storage: Storage) -> None:
    """Re-quantizing a routed expert tensor and committing it gives a fresh load's logits bit for
    bit, the original back the first ones; the block's expert stacks form one family, the shared
    expert stands alone."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_llama4())
    saved = model_dir.save(DOWN1, tmp_path / "saved")
    variant = model_dir.variant(DOWN1, Q.Q4_0, tmp_path / "variants")
    runtime, model = open_model(model_dir.first, storage=storage)
    try:
        family = sorted(runtime.store.families["blk.1.ffn_exps"])
        assert family == [f"blk.1.ffn_{r}_exps.weight" for r in ("down", "gate", "up")]
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, DOWN1, variant, storage=storage, saved=saved
        )
    finally:
        runtime.close()


def test_a_rope_freqs_swap_equals_a_fresh_load(tmp_path: Path) -> None:
    """``rope_freqs`` is read at every forward: another factor set swapped in gives a fresh
    load's logits."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_llama4())
    other = ModelDir.write(tmp_path / "other", tiny_llama4(rope_llama3_factor=4.0))
    runtime, model = open_model(model_dir.first)
    try:
        name = "rope_freqs.weight"
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, name, other.shard_of(name), storage=Storage.DEQUANTIZED
        )
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "name", ["llama4-long/F32", pytest.param("llama4-long/Q8_0", marks=pytest.mark.slow)]
)
def test_llama_cpps_logits_past_the_chunk_border(name: str, tmp_path: Path) -> None:
    """Over 8256 tokens fed through the cache in chunks of 512, the decoder gives llama.cpp's
    recorded logits around the 8192-position chunk border (where three of four layers forget the
    first chunk and the NoPE layer's temperature rises): F32 within its threshold, Q8_0 within
    a quarter of its recorded figures (llama.cpp's activation rounding, an allowance)."""
    from long_context import project_logits, tokens  # crosscheck/, on the path above

    manifest = json.loads((LONG / "cases.json").read_text())
    case = manifest["cases"][name]
    path, sha256 = xcheck.write_case(xcheck.spec_from_json(case["spec"]), tmp_path)
    assert sha256 == case["sha256"], "the writer no longer writes the recorded bytes"
    with np.load(LONG / "logits.npz") as arrays:
        key = case["logits_key"]
        golden = xcheck.decode_logits(
            arrays[f"{key}_codes"], arrays[f"{key}_offset"], arrays[f"{key}_step"]
        )
    ours = project_logits(path, tokens())[manifest["kept_positions"]]
    figures = xcheck.compare(golden, ours)
    if case["allowance"] is None:
        assert not figures.meets(xcheck.case_threshold("x/" + name.rpartition("/")[2])), figures
    else:  # as test_crosscheck: within a quarter of the figures recorded at these positions
        assert figures.mean_kld <= case["golden_figures"]["mean_kld"] * 1.25, figures
        assert figures.top1 >= case["golden_figures"]["top1"], figures


def _metadata(spec: object) -> dict[str, object]:
    """The metadata the writer writes for ``spec`` (read back from a header-only model)."""
    from tempfile import TemporaryDirectory

    from ggufswap.shards.writer import write_sparse_model

    with TemporaryDirectory() as tmp:
        return dict(read_header(write_sparse_model(spec, tmp)).metadata)  # type: ignore[arg-type]
