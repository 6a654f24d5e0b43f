"""dots1 (dots.llm1): qwen3's attention over deepseek2's routed blocks, read as llama.cpp reads
it; what its loader and graph refuse; an expert swap equals a fresh load."""

from __future__ import annotations

from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
from runtime_helpers import ModelDir, Q, assert_swap_equals_fresh_load, one_thread, open_model

from ggufswap.runtime import Storage
from ggufswap.runtime.models import HParams, HParamsError
from ggufswap.runtime.models.hparams import Gating
from ggufswap.shards import read_header
from ggufswap.shards.presets import tiny_dots1
from ggufswap.shards.writer import write_sparse_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def metadata(**overrides: object) -> dict[str, object]:
    with TemporaryDirectory() as tmp:
        return dict(read_header(write_sparse_model(tiny_dots1(**overrides), tmp)).metadata)


def test_the_keys_are_read_as_llama_cpp_reads_them() -> None:
    """One leading dense block, experts of expert_feed_forward_length, the file's gating,
    renormalised and scaled weights, one ungated shared expert of the experts' width."""
    config = HParams.from_metadata(metadata())
    assert (config.n_layer_dense_lead, config.n_ff_exp, config.gating) == (1, 32, Gating.SIGMOID)
    assert (config.norm_topk, config.expert_weights_scale) == (True, 2.5)
    assert (config.has_shared_expert, config.n_ff_shexp, config.n_head_kv) == (True, 32, 4)


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"dots1.expert_gating_func": None}, r"missing 'dots1\.expert_gating_func'"),
        ({"dots1.attention.head_count_kv": 2}, r"head_count_kv = 2: dots1 creates attn_k/attn_v"),
    ],
)
def test_what_llama_cpp_cannot_run_is_refused_by_name(
    change: dict[str, object], refused: str
) -> None:
    """No gating function (build_moe_ffn aborts), fewer key/value heads than query heads (the
    loader sizes attn_k/attn_v by n_head): refused with the key."""
    md = metadata()
    for key, value in change.items():
        if value is None:
            del md[key]
        else:
            md[key] = value
    with pytest.raises(HParamsError, match=refused):
        HParams.from_metadata(md)


def test_the_writer_refuses_fewer_key_value_heads() -> None:
    """A spec with n_head_kv below n_head is refused as llama.cpp's loader would refuse it."""
    with pytest.raises(ValueError, match="n_head_kv must equal n_head"):
        tiny_dots1(n_head_kv=2)


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_an_expert_swap_equals_a_fresh_load_and_restores(tmp_path: Path, storage: Storage) -> None:
    """Re-quantizing an expert stack and committing it gives a fresh load's logits bit for bit,
    the original back the first ones; the block's stacks form one family."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_dots1())
    name = "blk.2.ffn_up_exps.weight"
    saved = model_dir.save(name, tmp_path / "saved")
    variant = model_dir.variant(name, Q.Q4_0, tmp_path / "variants")
    runtime, model = open_model(model_dir.first, storage=storage)
    try:
        assert name in runtime.store.families["blk.2.ffn_exps"]
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, name, variant, storage=storage, saved=saved
        )
    finally:
        runtime.close()
