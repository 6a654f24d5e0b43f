"""gpt-oss: llama.cpp's openai-moe graph (attention sinks, alternating sliding-window layers,
biases, softmax over the top-k router logits, clamped SwiGLU, YaRN) on a tiny model with MXFP4
experts, whose swaps equal a fresh load in both storages with each block's experts kept together."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    TOKENS,
    ModelDir,
    Q,
    assert_swap_equals_fresh_load,
    cpu_pools,
    fresh_model_logits,
    logits,
    one_thread,
    open_model,
    slot_states,
)
from test_http import assert_swap_round_trip_while_serving

from ggufswap.runtime import HotSwapRuntime, PlanState, SlotState, Storage
from ggufswap.runtime.models import HParams, HParamsError
from ggufswap.runtime.models.blocks import DictWeightProvider
from ggufswap.runtime.models.blocks.rope import rotary, yarn_corr_dims
from ggufswap.runtime.models.gpt_oss import SWIGLU_ALPHA, GptOssTransformer, swiglu_oai
from ggufswap.shards import read_header
from ggufswap.shards.presets import tiny_gpt_oss

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOWN1 = "blk.1.ffn_down_exps.weight"
SINKS0 = "blk.0.attn_sinks.weight"
FAMILY1 = tuple(
    f"blk.1.ffn_{r}_exps.{s}" for r in ("gate", "up", "down") for s in ("weight", "bias")
)


def test_the_file_is_gpt_oss_with_mxfp4_experts_and_yarn(tmp_path: Path) -> None:
    """The preset writes llama.cpp's gpt-oss keys and tensors: MXFP4 experts with F32 biases,
    sinks, a required expert width, a sliding window and YaRN; the config reads them."""
    first = ModelDir.write(tmp_path / "m", tiny_gpt_oss()).first
    records = {n: r for p in first.parent.iterdir() for n, r in read_header(p).tensor_map().items()}
    assert records[DOWN1].ggml_type == Q.MXFP4
    assert records["blk.1.ffn_down_exps.bias"].ggml_type == Q.F32
    assert records[SINKS0].ne == (4,)
    config = HParams.from_metadata(read_header(first).metadata)
    assert (config.n_ff_exp, config.sliding_window, config.rope_ext_factor) == (64, 4, 1.0)
    assert (config.rope_ctx_orig, config.rope_freq_scale) == (4096, 1 / 32)
    assert [config.is_local_layer(i) for i in range(4)] == [True, False, True, False]
    assert not config.norm_topk


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_an_mxfp4_expert_swap_equals_a_fresh_load_and_restores(
    tmp_path: Path, storage: Storage
) -> None:
    """Re-quantizing an MXFP4 expert tensor to Q8_0 and committing it gives a fresh load's
    logits bit for bit; the original back gives the first logits. A block's expert weights and
    biases form one family."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_gpt_oss())
    saved = model_dir.save(DOWN1, tmp_path / "saved")
    variant = model_dir.variant(DOWN1, Q.Q8_0, tmp_path / "variants")
    runtime, model = open_model(model_dir.first, storage=storage)
    try:
        assert sorted(runtime.store.families["blk.1.ffn_exps"]) == sorted(FAMILY1)
        assert_swap_equals_fresh_load(
            runtime, model, model_dir, DOWN1, variant, storage=storage, saved=saved
        )
    finally:
        runtime.close()


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_a_sinks_swap_equals_a_fresh_load(tmp_path: Path, storage: Storage) -> None:
    """The sinks are read at every forward: another model's sinks swapped in give a fresh
    load's logits."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_gpt_oss())
    other = ModelDir.write(tmp_path / "other", tiny_gpt_oss(seed=7))
    runtime, model = open_model(model_dir.first, storage=storage)
    try:
        sinks = other.shard_of(SINKS0)
        assert_swap_equals_fresh_load(runtime, model, model_dir, SINKS0, sinks, storage=storage)
    finally:
        runtime.close()


def test_an_expert_outgrowing_its_pool_moves_its_family_together(tmp_path: Path) -> None:
    """Native storage: MXFP4 -> F16 outgrows the full pool, so the block's six expert tensors
    (weights and biases) fall back to host memory together, outputs equal to a fresh load."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_gpt_oss())
    with HotSwapRuntime.open(model_dir.first, storage=Storage.NATIVE) as sizing:
        loaded = sum(sizing.store.pools.usage().values())
    pools = cpu_pools(loaded + 1024)
    runtime, model = open_model(model_dir.first, storage=Storage.NATIVE, pools=pools)
    try:
        others = tuple(n for n in runtime.store.slots if n not in FAMILY1)
        model_dir.put(DOWN1, model_dir.variant(DOWN1, Q.F16, tmp_path / "variants"))
        ticket = runtime.apply(model_dir.plan("big", [DOWN1]))
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        assert slot_states(runtime, FAMILY1) == {SlotState.FALLBACK_CPU}
        assert slot_states(runtime, others) == {SlotState.ON_ORIGINAL}
        assert torch.equal(
            logits(model), fresh_model_logits(model_dir.first, storage=Storage.NATIVE)
        )
    finally:
        runtime.close()


def test_swiglu_oai_clamps_as_ggml() -> None:
    """min(gate, 7) * sigmoid(1.702 * that) * (clamp(up, -7, 7) + 1)."""
    gate = torch.tensor([-20.0, -1.0, 0.0, 2.0, 9.0])
    up = torch.tensor([-9.0, 0.5, 3.0, 8.0, -1.0])
    g = torch.tensor([-20.0, -1.0, 0.0, 2.0, 7.0])
    u = torch.tensor([-7.0, 0.5, 3.0, 7.0, -1.0])
    expected = g / (1 + torch.exp(-SWIGLU_ALPHA * g)) * (u + 1)
    torch.testing.assert_close(swiglu_oai(gate, up), expected, rtol=1e-6, atol=0)


def test_yarn_corr_dims_follow_ggml() -> None:
    """gpt-oss's YaRN (4096 positions, base 150000) over 16 rotated dims: pairs 0..2 keep their
    angle, pairs from 5 on are interpolated (ggml_rope_yarn_corr_dims)."""

    def dim(beta: float) -> float:
        return 16 * math.log(4096 / (beta * 2 * math.pi)) / (2 * math.log(150000))

    assert yarn_corr_dims(16, 4096, 150000.0) == (math.floor(dim(32)), math.ceil(dim(1)))


def test_rope_magnitudes_follow_llama_cpps_attn_factor() -> None:
    """Without YaRN, rope.scaling.attn_factor scales cos/sin (ggml's attn_factor); with YaRN
    factor 32 they are scaled by 1 + 0.1 ln 32 on top, and the first pair keeps its angle."""
    cpu = torch.device("cpu")
    plain = rotary(_config(), 1e4)(0, 6, cpu)
    scaled = rotary(_config(**{"gpt-oss.rope.scaling.attn_factor": 1.5}), 1e4)(0, 6, cpu)
    torch.testing.assert_close(scaled.cos, plain.cos * 1.5)
    yarn = _config(**{"gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 32.0})
    tables = rotary(yarn, 1e4)(0, 6, cpu)
    mscale = 1 + 0.1 * math.log(32)
    torch.testing.assert_close(tables.cos[:, 0], plain.cos[:, 0] * mscale)
    assert not torch.allclose(tables.cos[:, -1], plain.cos[:, -1] * mscale)


def _weights(config: HParams, seed: int = 0) -> dict[str, torch.Tensor]:
    listing = GptOssTransformer(config, _Everything(), check_shapes=False).required
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*shape, generator=g) * 0.3 for n, shape in listing.items()}


class _Everything:
    """A provider that has every tensor but rope_freqs (to list what the model reads)."""

    def has(self, name: str) -> bool:
        return name != "rope_freqs.weight"


def _config(**kw: object) -> HParams:
    return HParams.from_metadata(_md() | kw)


def test_a_sink_only_takes_probability_away() -> None:
    """A sink of -inf changes nothing (plain softmax attention); a large one pulls every
    attention output towards zero, so the logits move."""
    config = _config()
    weights = _weights(config)
    plain = dict(weights)
    for layer in range(2):
        plain[f"blk.{layer}.attn_sinks.weight"] = torch.full((4,), float("-inf"))
    loud = dict(weights)
    for layer in range(2):
        loud[f"blk.{layer}.attn_sinks.weight"] = torch.full((4,), 30.0)
    silent = dict(loud)
    for layer in range(2):  # with every attention output ~0, only the output bias is left
        silent[f"blk.{layer}.attn_v.weight"] = torch.zeros_like(loud[f"blk.{layer}.attn_v.weight"])
    with torch.inference_mode():
        a = GptOssTransformer(config, DictWeightProvider(plain))(TOKENS[:, :5])
        b = GptOssTransformer(config, DictWeightProvider(loud))(TOKENS[:, :5])
        c = GptOssTransformer(config, DictWeightProvider(silent))(TOKENS[:, :5])
    assert torch.isfinite(a).all()
    assert not torch.allclose(a, b)
    torch.testing.assert_close(b, c, rtol=0, atol=1e-4)


def test_routing_is_a_softmax_over_the_top_k_logits() -> None:
    """The k largest biased router logits are chosen and softmax-normalised among themselves."""
    config = _config()
    model = GptOssTransformer(config, DictWeightProvider(_weights(config)))
    moe = model.layers[0].feed_forward
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    top_w, top_i = moe.route(x)
    w = model.weights.weight
    logits = x @ w("blk.0.ffn_gate_inp.weight").T + w("blk.0.ffn_gate_inp.bias")
    expected_l, expected_i = logits.topk(2, dim=-1)
    assert torch.equal(top_i, expected_i)
    torch.testing.assert_close(top_w, expected_l.softmax(-1))


def test_missing_gpt_oss_keys_and_tensors_are_refused_by_name() -> None:
    """expert_feed_forward_length and the sliding window are required (llama.cpp's loader);
    a missing sink or expert bias is named."""
    with pytest.raises(HParamsError, match=r"gpt-oss\.expert_feed_forward_length"):
        HParams.from_metadata(
            {k: v for k, v in _md().items() if k != "gpt-oss.expert_feed_forward_length"}
        )
    with pytest.raises(HParamsError, match=r"gpt-oss\.attention\.sliding_window"):
        HParams.from_metadata({k: v for k, v in _md().items() if "sliding_window" not in k})
    config = _config()
    weights = _weights(config)
    del weights["blk.1.attn_sinks.weight"], weights["blk.0.ffn_up_exps.bias"]
    with pytest.raises(Exception, match=r"blk\.1\.attn_sinks\.weight: missing") as err:
        GptOssTransformer(config, DictWeightProvider(weights))
    assert "blk.0.ffn_up_exps.bias: missing" in str(err.value)


def _md() -> dict[str, object]:
    return {
        "general.architecture": "gpt-oss",
        "gpt-oss.block_count": 2,
        "gpt-oss.embedding_length": 32,
        "gpt-oss.attention.head_count": 4,
        "gpt-oss.attention.head_count_kv": 2,
        "gpt-oss.attention.layer_norm_rms_epsilon": 1e-5,
        "gpt-oss.context_length": 64,
        "gpt-oss.expert_count": 4,
        "gpt-oss.expert_used_count": 2,
        "gpt-oss.expert_feed_forward_length": 16,
        "gpt-oss.attention.sliding_window": 3,
        "gpt-oss.vocab_size": 300,
    }


def test_the_writer_refuses_what_the_gpt_oss_loader_refuses() -> None:
    """No tied output (output.weight is required), no shared expert, experts required, F32
    sinks and biases."""
    with pytest.raises(ValueError, match="gpt-oss cannot tie its output"):
        tiny_gpt_oss(tied_output=True)
    with pytest.raises(ValueError, match="gpt-oss has no shared expert"):
        tiny_gpt_oss(shared_expert=True)
    with pytest.raises(ValueError, match="gpt-oss needs n_expert > 0"):
        tiny_gpt_oss(n_expert=0, n_expert_used=0)
    with pytest.raises(ValueError, match="ATTN_SINKS must be F32"):
        tiny_gpt_oss().with_types(attn_sinks="f16")


def test_the_server_answers_across_an_expert_swap(tmp_path: Path) -> None:
    """The HTTP server runs the gpt-oss file; a committed MXFP4 -> Q8_0 expert swap is named by
    the next response, and swapping back gives the first completion again."""
    models = ModelDir.write(tmp_path / "model", tiny_gpt_oss(n_vocab=1024, context_length=512))
    saved = models.save(DOWN1, tmp_path / "saved")
    variant = models.variant(DOWN1, Q.Q8_0, tmp_path / "variants")
    assert_swap_round_trip_while_serving(models, DOWN1, variant, saved)
