"""deepseek2 (DeepSeek V2/V3/R1, Kimi-K2): both latent-attention file forms load, hot-swap their
MLA matrices exactly, route as llama.cpp's build_moe_ffn does, and malformed files are refused."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import ModelDir, Q, one_thread

from ggufswap.runtime import HotSwapRuntime, PlanState, Storage
from ggufswap.runtime.models import HParams, HParamsError, MissingWeightError, build_model
from ggufswap.runtime.models.blocks import DictWeightProvider, RoutedExperts, TensorSpec
from ggufswap.runtime.models.deepseek2 import Deepseek2Transformer
from ggufswap.runtime.models.hparams import Arch, Gating, MLAShape
from ggufswap.shards import read_header
from ggufswap.shards.presets import tiny_deepseek2
from ggufswap.shards.writer import write_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

TOKENS = torch.tensor(
    [[1, 17, 33, 250, 4, 99, 7, 128, 5, 60], [200, 3, 45, 45, 12, 0, 9, 64, 9, 9]]
)
STORAGES = [Storage.DEQUANTIZED, Storage.NATIVE]
# (file form, the MLA tensors it holds): llama.cpp's converter today, and the older form.
FORMS = {
    "k_b-v_b": ({}, ("blk.1.attn_k_b.weight", "blk.2.attn_v_b.weight")),
    "kv_b": ({"mla_split": False}, ("blk.1.attn_kv_b.weight",)),
}


def open_model(first: Path, storage: Storage) -> tuple[HotSwapRuntime, Deepseek2Transformer]:
    runtime = HotSwapRuntime.open(first, storage=storage)
    assert runtime.shards is not None, "open() keeps the shard set"
    model = build_model(
        HParams.from_metadata(runtime.shards.metadata), runtime.store, store=runtime.store
    )
    assert isinstance(model, Deepseek2Transformer)
    return runtime, model


def logits(model: Deepseek2Transformer) -> torch.Tensor:
    with torch.inference_mode():
        return model(TOKENS)


def fresh_logits(first: Path, storage: Storage) -> torch.Tensor:
    runtime, model = open_model(first, storage)
    try:
        return logits(model)
    finally:
        runtime.close()


@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: s.value)
@pytest.mark.parametrize("form", list(FORMS))
def test_swapping_an_mla_matrix_equals_a_fresh_load(
    form: str, storage: Storage, tmp_path: Path
) -> None:
    """Re-quantizing each latent-attention matrix (attn_k_b, attn_v_b, or attn_kv_b) and
    committing its plan changes the logits to a fresh load's, bit for bit; the original back
    restores the first logits (ik_llama.cpp kept using its load-time copies instead)."""
    overrides, names = FORMS[form]
    model_dir = ModelDir.write(tmp_path / "model", tiny_deepseek2(**overrides))
    runtime, model = open_model(model_dir.first, storage)
    try:
        assert runtime.store.derived == {}, "no MLA tensor is derived at load"
        before = logits(model)
        for name in names:
            saved = model_dir.save(name, tmp_path / "saved")
            model_dir.put(name, model_dir.variant(name, Q.Q4_0, tmp_path / "variants"))
            ticket = runtime.apply(model_dir.plan(f"{name}-q4", [name]))
            assert ticket.state is PlanState.COMMITTED, ticket.summary()
            swapped = logits(model)
            assert not torch.equal(swapped, before), f"swapping {name} changed nothing"
            assert torch.equal(swapped, fresh_logits(model_dir.first, storage))
            model_dir.put(name, saved)
            ticket = runtime.apply(model_dir.plan(f"{name}-back", [name]))
            assert ticket.state is PlanState.COMMITTED, ticket.summary()
            assert torch.equal(logits(model), before)
    finally:
        runtime.close()


def test_both_file_forms_compute_the_same_attention(tmp_path: Path) -> None:
    """A file with attn_kv_b and one with the attn_k_b / attn_v_b llama.cpp's converter splits
    from it (F32) give the same logits: the absorbed and the decompressed attention agree."""
    split = tiny_deepseek2(name="split").with_types(attn_k_b="f32", attn_v_b="f32")
    joined = tiny_deepseek2(name="joined", mla_split=False).with_types(attn_kv_b="f32")
    runtime, model = open_model(write_model(joined, tmp_path)[0], Storage.DEQUANTIZED)
    try:
        kv_b = {
            name: runtime.store.weight(name).clone()
            for name in runtime.store.slots
            if name.endswith("attn_kv_b.weight")
        }
        expected = logits(model)
    finally:
        runtime.close()
    runtime, model = open_model(write_model(split, tmp_path)[0], Storage.DEQUANTIZED)
    try:
        weights = {name: runtime.store.weight(name).clone() for name in runtime.store.slots}
    finally:
        runtime.close()
    mla = model.config.mla
    assert mla is not None
    for name, value in kv_b.items():  # the converter's split (conversion/deepseek.py)
        heads = value.view(model.config.n_head, mla.nope + mla.head_v, mla.kv_lora_rank)
        weights[name.replace("kv_b", "k_b")] = heads[:, : mla.nope].transpose(1, 2).contiguous()
        weights[name.replace("kv_b", "v_b")] = heads[:, mla.nope :].contiguous()
    config = HParams.from_metadata(read_header(tmp_path / "split.gguf").metadata)
    with torch.inference_mode():
        got = Deepseek2Transformer(config, DictWeightProvider(weights))(TOKENS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_the_model_reads_every_mla_matrix_from_its_own_slot(tmp_path: Path) -> None:
    """The decoder registers no derived tensor and lists attn_k_b / attn_v_b (or attn_kv_b) of
    every block among the tensors it reads, so each is swappable on its own."""
    for overrides, suffixes in (
        ({}, ("attn_k_b", "attn_v_b")),
        ({"mla_split": False}, ("attn_kv_b",)),
    ):
        spec = tiny_deepseek2(name=f"m{len(overrides)}", **overrides)
        runtime, model = open_model(write_model(spec, tmp_path)[0], Storage.DEQUANTIZED)
        try:
            assert runtime.store.derived == {}
            for block in range(spec.n_layers):
                for suffix in suffixes:
                    assert f"blk.{block}.{suffix}.weight" in model.required
            assert model.unused(runtime.store.slots) == []
        finally:
            runtime.close()


# --- routing ----------------------------------------------------------------------------------


def _router(**config: Any) -> tuple[RoutedExperts, torch.Tensor, torch.Tensor]:
    """A routed-experts block over random weights (8 experts, 4 groups), its router and bias."""
    hp = HParams(
        arch=Arch.DEEPSEEK2,
        n_layer=1,
        n_embd=16,
        n_head=2,
        n_head_kv=1,
        n_vocab=8,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=8,
        n_expert_shared=1,
        key_length=12,
        rope_dim=4,
        mla=_shape(),
        **config,
    )
    g = torch.Generator().manual_seed(3)
    spec = TensorSpec()
    shapes = RoutedExperts(hp, _All(), 0, spec)
    weights = {n: torch.randn(*s, generator=g) for n, s in spec.required.items()}
    block = RoutedExperts(hp, DictWeightProvider(weights), 0, TensorSpec())
    return block, weights[shapes.router], weights["blk.0.exp_probs_b.bias"]


def _shape() -> MLAShape:
    return MLAShape(q_lora_rank=0, kv_lora_rank=8, head_k=8, head_v=4, n_rot=4, split=True)


class _All:
    """A provider that has every tensor (lists what a block reads)."""

    def has(self, name: str) -> bool:
        return True


def test_group_limited_sigmoid_routing_follows_deepseek_v3() -> None:
    """Sigmoid scores plus the bias choose the experts, only from the 2 groups whose two best
    biased scores sum highest; the weights are the unbiased scores, renormalised and scaled
    (DeepSeek-V3's MoEGate, as llama.cpp's build_moe_ffn computes it)."""
    block, router, bias = _router(
        gating=Gating.SIGMOID,
        n_expert_groups=4,
        n_group_used=2,
        expert_weights_norm=True,
        expert_weights_scale=2.5,
    )
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(4))
    top_w, top_i = block.route(x)
    for n in range(x.shape[0]):
        scores = torch.sigmoid(router @ x[n])
        biased = scores + bias
        group_score = [sorted(biased[g * 2 : g * 2 + 2].tolist())[-2:] for g in range(4)]
        best = sorted(range(4), key=lambda g: -sum(group_score[g]))[:2]
        allowed = [e for e in range(8) if e // 2 in best]
        chosen = sorted(allowed, key=lambda e: -float(biased[e]))[:2]
        assert sorted(top_i[n].tolist()) == sorted(chosen)
        w = scores[top_i[n]]
        torch.testing.assert_close(top_w[n], w / w.sum() * 2.5)


def test_softmax_routing_without_norm_keeps_the_probabilities() -> None:
    """Softmax gating, no renormalisation and no scale: the weights are the softmax
    probabilities of the chosen experts; the bias moves only the choice."""
    block, router, bias = _router(gating=Gating.SOFTMAX, expert_weights_norm=False)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(5))
    top_w, top_i = block.route(x)
    probs = (x @ router.T).softmax(-1)
    assert torch.equal(top_i, (probs + bias).topk(2, dim=-1).indices)
    torch.testing.assert_close(top_w, probs.gather(-1, top_i))


# --- hyper-parameters and refusals ------------------------------------------------------------


def _md(**extra: object) -> dict[str, object]:
    """The metadata of tiny_deepseek2 (attn_k_b / attn_v_b form), with changes."""
    md = dict(_TINY_MD)
    for name, value in extra.items():
        key = f"deepseek2.{name}"
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


@pytest.fixture(scope="module", autouse=True)
def _tiny_md(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    path = write_model(tiny_deepseek2(), tmp_path_factory.mktemp("md"))[0]
    _TINY_MD.update(read_header(path).metadata)
    return


_TINY_MD: dict[str, object] = {}


def test_yarn_sets_llama_cpps_attention_scale_and_rope_magnitude() -> None:
    """With YaRN x4 and yarn_log_multiplier 0.1 (mscale_all_dim 1), the softmax scale is
    DeepSeek's ``mscale^2 / sqrt(head_k)`` with ``mscale = 0.1 ln 4 + 1``, and the rope tables'
    magnitude is 1 (llama.cpp's attn_factor cancels YaRN's ``1 + 0.1 ln 4``)."""
    config = HParams.from_metadata(_md())
    mscale = 0.1 * math.log(4.0) + 1.0
    assert config.attn_scale == pytest.approx(mscale**2 / math.sqrt(48))
    assert config.rope_ext_factor == 1.0
    assert config.rope_attn_factor * (1 + 0.1 * math.log(4.0)) == pytest.approx(1.0)
    assert config.rope_ctx_orig == 64
    plain = HParams.from_metadata(_md(**{"rope.scaling.type": None, "rope.scaling.factor": None}))
    assert plain.attn_scale == pytest.approx(48**-0.5)
    assert (plain.rope_ext_factor, plain.rope_attn_factor) == (0.0, 1.0)


def test_reads_the_routing_and_latent_keys() -> None:
    """Gating, groups, weights norm/scale, shared experts, leading dense blocks and the MLA
    shape come from llama.cpp's keys; without expert_gating_func deepseek2 gates by softmax."""
    config = HParams.from_metadata(_md())
    assert (config.gating, config.n_expert_groups, config.n_group_used) == (Gating.SIGMOID, 4, 2)
    assert (config.norm_topk, config.expert_weights_scale) == (True, 2.5)
    assert (config.n_layer_dense_lead, config.n_expert_shared, config.n_ff_shexp) == (1, 1, 32)
    assert config.mla is not None
    assert config.mla.split
    assert config.mla.nope == 32
    legacy = HParams.from_metadata(
        _md(
            expert_gating_func=None,
            expert_weights_scale=None,
            **{
                "attention.key_length_mla": None,
                "attention.value_length_mla": None,
                "attention.key_length": 48,
                "attention.value_length": 32,
                "attention.head_count_kv": 4,
            },
        )
    )
    assert legacy.gating is Gating.SOFTMAX
    assert legacy.expert_weights_scale == 1.0
    assert legacy.mla is not None
    assert not legacy.mla.split
    assert legacy.mla.head_v == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention.value_length_mla": None}, "must be both set or both absent"),
        ({"attention.head_count_kv": 4}, "head_count_kv must be 1"),
        ({"attention.key_length": 40}, "key_length must be kv_lora_rank"),
        ({"attention.q_lora_rank": None}, "missing required key 'deepseek2.attention.q_lora_rank'"),
        ({"expert_gating_func": 4}, "implements softmax"),
        ({"expert_group_used_count": 4}, "expert_group_count 4"),
        ({"expert_shared_count": 0}, "expert_shared_count must be > 0"),
        ({"rope.dimension_count": 48}, "leaves no non-rope dims"),
        ({"rope.scaling.type": "longrope"}, "'longrope'"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_malformed_metadata_is_refused_with_the_reason(
    change: dict[str, object], message: str
) -> None:
    """Each file llama.cpp's deepseek2 loader or graph would refuse is refused, naming the key."""
    with pytest.raises(HParamsError, match=message.replace("(", r"\(")):
        HParams.from_metadata(_md(**change))


def test_a_file_with_both_mla_forms_is_refused(tmp_path: Path) -> None:
    """attn_kv_b beside attn_k_b / attn_v_b is refused as llama.cpp refuses it (wrong number of
    tensors), naming the tensor."""
    spec = tiny_deepseek2(
        n_layers=1,
        n_dense_lead=1,
        n_expert=0,
        n_expert_used=0,
        shared_expert=False,
        n_expert_groups=0,
        n_group_used=0,
    )
    runtime, model = open_model(write_model(spec, tmp_path)[0], Storage.DEQUANTIZED)
    try:
        weights = {name: runtime.store.weight(name) for name in runtime.store.slots}
    finally:
        runtime.close()
    weights["blk.0.attn_kv_b.weight"] = torch.zeros(4 * 64, 32)
    with pytest.raises(MissingWeightError, match=r"blk\.0\.attn_kv_b\.weight: .*key_length_mla"):
        Deepseek2Transformer(model.config, DictWeightProvider(weights))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_head_kv": 4}, "n_head_kv must be 1"),
        ({"mla_split": False, "n_head_kv": 1}, "n_head_kv must equal n_head"),
        ({"n_expert_groups": 3}, "expert groups"),
        ({"rope_dim": 48}, "even rope dims below head_dim"),
        ({"shared_expert": False}, "needs shared_expert"),
        ({"moe_layers": (2,)}, "experts in blocks n_dense_lead"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_the_writer_refuses_what_llama_cpp_refuses(overrides: dict[str, Any], message: str) -> None:
    """A deepseek2 spec llama.cpp's loader would refuse is refused with the reason."""
    with pytest.raises(ValueError, match=message):
        tiny_deepseek2(**overrides)


def test_the_writer_refuses_leading_dense_blocks_elsewhere() -> None:
    """n_dense_lead is deepseek2's: other architectures give experts to every block."""
    from ggufswap.shards.presets import tiny_moe

    with pytest.raises(ValueError, match="no leading dense blocks"):
        tiny_moe(n_dense_lead=1)
