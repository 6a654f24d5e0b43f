"""qwen3vlmoe (Qwen3-VL MoE's text tower): qwen3moe's blocks with interleaved multimodal RoPE
sections over the whole head, text positions as llama.cpp builds them; the keys it requires or
refuses; an expert swap equals a fresh load."""

from __future__ import annotations

from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
import torch
from runtime_helpers import ModelDir, Q, assert_swap_equals_fresh_load, one_thread, open_model

from ggufswap.runtime import Storage
from ggufswap.runtime.models import HParams, HParamsError
from ggufswap.runtime.models.blocks.rope import RotaryEmbedding
from ggufswap.shards import read_header
from ggufswap.shards.presets import tiny_qwen3vlmoe
from ggufswap.shards.writer import write_sparse_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def metadata(**overrides: object) -> dict[str, object]:
    with TemporaryDirectory() as tmp:
        return dict(read_header(write_sparse_model(tiny_qwen3vlmoe(**overrides), tmp)).metadata)


def test_a_text_token_leaves_the_fourth_sections_pairs_unrotated() -> None:
    """Sections [4, 2, 2, 0] over a head of 16: llama.cpp gives a text token its position in the
    first three components and 0 in the fourth, so pair 7 (a second-component sector past its
    section) does not rotate, the others do."""
    config = HParams.from_metadata(metadata())
    assert (config.rope_sections, config.n_rot, config.n_ff_exp) == ((4, 2, 2, 0), 16, 64)
    tables = RotaryEmbedding(config, sections=config.rope_sections)(5, 1, torch.device("cpu"))
    assert tables.sin[0, 7] == 0.0
    assert bool((tables.sin[0, :7] != 0).all())


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"qwen3vlmoe.rope.dimension_sections": None}, r"missing required key .*sections"),
        ({"qwen3vlmoe.rope.dimension_sections": [8, 8, 8, 0]}, r"sum to at most the head"),
        ({"qwen3vlmoe.rope.dimension_count": 8}, r"rotates the whole head of 16"),
    ],
)
def test_the_rope_keys_llama_cpp_asserts_are_refused(
    change: dict[str, object], refused: str
) -> None:
    """No sections, sections wider than the head, a partial rotation: llama.cpp's loader or
    graph asserts on each, so the config refuses it by name."""
    md = metadata()
    for key, value in change.items():
        if value is None:
            del md[key]
        else:
            md[key] = value
    with pytest.raises(HParamsError, match=refused):
        HParams.from_metadata(md)


def test_the_deepstack_count_changes_nothing_for_text() -> None:
    """n_deepstack_layers (3, as the converter writes it) is accepted and, its inputs being zeros
    for text, leaves the config (and so the decoder) that of a file without it."""
    md = metadata()
    assert md["qwen3vlmoe.n_deepstack_layers"] == 3
    config = HParams.from_metadata(md)
    del md["qwen3vlmoe.n_deepstack_layers"]
    assert HParams.from_metadata(md) == config


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_an_expert_swap_equals_a_fresh_load_and_restores(tmp_path: Path, storage: Storage) -> None:
    """Re-quantizing an expert stack and committing it gives a fresh load's logits bit for bit,
    the original back the first ones; the block's stacks form one family."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_qwen3vlmoe())
    name = "blk.3.ffn_down_exps.weight"
    saved = model_dir.save(name, tmp_path / "saved")
    variant = model_dir.variant(name, Q.Q4_0, tmp_path / "variants")
    runtime, model = open_model(model_dir.first, storage=storage)
    try:
        assert name in runtime.store.families["blk.3.ffn_exps"]
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, name, variant, storage=storage, saved=saved
        )
    finally:
        runtime.close()
