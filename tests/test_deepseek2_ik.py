"""ik_llama.cpp's deepseek2 form (DeepSeek-R1-0528, V3-0324 as the GGUF Tool Suite ships them):
``attn_kv_b`` beside 2-D ``attn_k_b`` / ``attn_v_b``. The decoder computes what ik computes (the
absorbed attention from attn_k_b / attn_v_b, ungrouped routing), lists attn_kv_b as never read,
and the writer makes the file as ik's converter does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from runtime_helpers import ModelDir, Q, one_thread

from ggufswap.runtime import HotSwapRuntime, PlanState
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.models.deepseek2 import Deepseek2Transformer
from ggufswap.shards import read_header
from ggufswap.shards._synth import decode_floats
from ggufswap.shards.presets import tiny_deepseek2, tiny_deepseek2_ik
from ggufswap.shards.writer import write_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

TOKENS = torch.tensor([[1, 17, 33, 250, 4, 99, 7, 128, 5, 60, 200, 3]])
F32_MLA = {"attn_kv_b": "f32", "attn_k_b": "f32", "attn_v_b": "f32"}
UNGROUPED = {"n_expert_groups": 0, "n_group_used": 0}


@contextmanager
def open_model(path: Path) -> Iterator[tuple[HotSwapRuntime, Deepseek2Transformer]]:
    runtime = HotSwapRuntime.open(path)
    assert runtime.shards is not None, "open() keeps the shard set"
    try:
        model = build_model(
            HParams.from_metadata(runtime.shards.metadata), runtime.store, store=runtime.store
        )
        assert isinstance(model, Deepseek2Transformer)
        yield runtime, model
    finally:
        runtime.close()


def logits(model: Deepseek2Transformer) -> torch.Tensor:
    with torch.inference_mode():
        return model(TOKENS)


def test_the_writer_splits_attn_kv_b_as_iks_converter_does(tmp_path: Path) -> None:
    """Each block's 2-D attn_k_b / attn_v_b hold its attn_kv_b per head (k_b transposed), as
    ik_llama.cpp's converter writes them; there are no *_mla keys and one kv head per head."""
    spec = tiny_deepseek2_ik().with_types(**F32_MLA)
    header = read_header(write_model(spec, tmp_path)[0])
    assert "deepseek2.attention.key_length_mla" not in header.metadata
    assert header.metadata["deepseek2.attention.head_count_kv"] == spec.n_head
    tensors = header.tensor_map()
    h, rank, nope, v = spec.n_head, spec.kv_lora_rank, spec.n_embd_head - spec.n_rot, spec.head_v
    assert tensors["blk.1.attn_k_b.weight"].ne == (nope, h * rank)
    assert tensors["blk.1.attn_v_b.weight"].ne == (rank, h * v)

    def values(name: str) -> torch.Tensor:
        record = tensors[name]
        with open(record.path, "rb") as f:
            f.seek(record.offset)
            raw = f.read(record.nbytes)
        return torch.from_numpy(decode_floats(raw, record.ggml_type, record.ne[0]).copy())

    kv_b = values("blk.1.attn_kv_b.weight").view(h, nope + v, rank)
    assert torch.equal(values("blk.1.attn_k_b.weight").view(h, rank, nope), kv_b[:, :nope].mT)
    assert torch.equal(values("blk.1.attn_v_b.weight").view(h, v, rank), kv_b[:, nope:])


def test_the_ik_form_computes_the_attention_of_its_attn_kv_b(tmp_path: Path) -> None:
    """With F32 matrices and no expert groups, the ik file gives the logits of the attn_kv_b
    file it extends (absorbed attention from the split matrices == decompressed attention)."""
    ik = tiny_deepseek2_ik(name="ik", **UNGROUPED).with_types(**F32_MLA)
    kv_b = tiny_deepseek2(name="kv-b", mla_split=False, **UNGROUPED).with_types(**F32_MLA)
    with open_model(write_model(ik, tmp_path)[0]) as (_, model):
        assert model.ik_form
        got = logits(model)
    with open_model(write_model(kv_b, tmp_path)[0]) as (_, model):
        assert not model.ik_form
        torch.testing.assert_close(got, logits(model), atol=1e-4, rtol=0)


def test_ik_routes_without_expert_groups(tmp_path: Path) -> None:
    """The file's expert_group_count is read, and the ik form's decoder drops it, as ik's
    build_moe_ffn does for deepseek2."""
    with open_model(write_model(tiny_deepseek2_ik(), tmp_path)[0]) as (runtime, model):
        assert runtime.shards is not None
        assert HParams.from_metadata(runtime.shards.metadata).n_expert_groups == 4
        assert (model.config.n_expert_groups, model.config.n_group_used) == (0, 0)


def test_attn_kv_b_is_never_read_and_attn_k_b_swaps_exactly(tmp_path: Path) -> None:
    """attn_kv_b is listed unused (a plan of it alone is logged plan.unused_only and leaves the
    logits); a re-quantized attn_k_b committed through the runtime gives a fresh load's logits."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_deepseek2_ik())
    with open_model(model_dir.first) as (runtime, model):
        unused = model.unused(runtime.store.slots)
        assert unused == sorted(f"blk.{b}.attn_kv_b.weight" for b in range(3))
        before = logits(model)
        for name in ("blk.1.attn_kv_b.weight", "blk.1.attn_k_b.weight"):
            model_dir.put(name, model_dir.variant(name, Q.Q4_0, tmp_path / "variants"))
            ticket = runtime.apply(model_dir.plan(f"{name}-q4", [name]))
            assert ticket.state is PlanState.COMMITTED, ticket.summary()
            swapped = logits(model)
            if "kv_b" in name:
                assert torch.equal(swapped, before), "attn_kv_b is never read"
            else:
                assert not torch.equal(swapped, before)
                with open_model(model_dir.first) as (_, fresh):
                    assert torch.equal(swapped, logits(fresh))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mla_split": True}, "mla_split=False"),
        ({"expert_weights_scale": 0.0}, "expert_weights_scale"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_the_writer_refuses_what_ik_refuses(overrides: dict[str, object], message: str) -> None:
    """An ik-form spec ik_llama.cpp's loader would refuse is refused with the reason."""
    with pytest.raises(ValueError, match=message):
        tiny_deepseek2_ik(**overrides)
