"""Every supported architecture, written as a tiny GGUF file, loads, runs and hot-swaps exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models.blocks import DictWeightProvider
from ggufswap.runtime.models.errors import HParamsError, MissingWeightError
from ggufswap.runtime.models.gemma3 import Gemma3Transformer, sliding_window_mask
from ggufswap.runtime.models.hparams import Arch, HParams
from ggufswap.runtime.models.registry import DECODERS, build_model
from ggufswap.shards import read_header, requantize
from ggufswap.shards.presets import tiny_arch
from ggufswap.shards.writer import ModelSpec, write_model

TOKENS = torch.tensor(
    [[1, 17, 33, 250, 4, 99, 7, 128, 5, 60], [200, 3, 45, 45, 12, 0, 255, 64, 9, 9]]
)

# (writer arch, spec overrides): every architecture, and llama as Mixtral-style MoE.
CASES = {
    "llama": ("llama", {}),
    "llama-moe": ("llama", {"n_expert": 4, "n_expert_used": 2}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen2moe": ("qwen2moe", {}),
    "qwen3moe": ("qwen3moe", {}),
    "gemma3": ("gemma3", {}),
    "deepseek2": ("deepseek2", {}),
    "deepseek2-kv-b": ("deepseek2", {"mla_split": False}),
    "deepseek2-no-q-lora": ("deepseek2", {"q_lora_rank": 0}),
    "glm4moe": ("glm4moe", {}),  # with a NextN block, loaded and never run
    "glm4moe-qk-norm": ("glm4moe", {"attn_qk_norm": True, "attn_bias": False}),
    "llama-rope-freqs": ("llama", {"rope_llama3_factor": 8.0, "rope_llama3_original_context": 32}),
    "gpt-oss": ("gpt-oss", {}),
    "qwen3vlmoe": ("qwen3vlmoe", {}),  # interleaved multimodal RoPE sections
    "minimax-m2": ("minimax-m2", {}),  # Q/K norms across heads, sigmoid + exp_probs_b
    "llama4": ("llama4", {}),  # chunked and NoPE layers, MoE every 2nd block, rope_freqs
    "gemma4": ("gemma4", {}),  # sliding and full layers of other head shapes, V = K
    "gemma4-moe": ("gemma4", {"n_expert": 4, "n_expert_used": 2, "n_ff_expert": 32}),
    "dots1": ("dots1", {}),  # qwen3's attention over deepseek2's routed blocks
    "qwen35": ("qwen35", {}),  # the swap is a delta-net block's attn_qkv
    "qwen35moe": ("qwen35moe", {}),
    "qwen3next": ("qwen3next", {}),
    "llama-moe-per-expert": (
        "llama",
        {"n_expert": 4, "n_expert_used": 2, "per_expert_tensors": True},
    ),
    "deepseek2-ik": ("deepseek2", {"mla_split": False, "mla_ik": True}),  # ik_llama.cpp's form
    "deepseek32": ("deepseek32", {}),  # the DSA indexer in every block
    "glm-dsa": ("glm-dsa", {}),  # full and shared indexer blocks
}
# The tensor each case re-quantizes: attn_q, or attn_q_b where the queries come through q_lora.
SWAPPED = {
    "deepseek2": "blk.0.attn_q_b.weight",
    "deepseek2-kv-b": "blk.0.attn_q_b.weight",
    **dict.fromkeys(("deepseek2-ik", "deepseek32", "glm-dsa"), "blk.0.attn_q_b.weight"),
    **dict.fromkeys(("qwen35", "qwen35moe", "qwen3next"), "blk.0.attn_qkv.weight"),
}


def spec_for(case: str) -> ModelSpec:
    arch, overrides = CASES[case]
    return tiny_arch(arch, **overrides).with_types(
        attn_q="q5_0", attn_q_b="q5_0", attn_qkv="q5_0", ffn_down="q4_0"
    )


def open_model(path: Path) -> tuple[HotSwapRuntime, torch.nn.Module]:
    runtime = HotSwapRuntime.open(path)
    assert runtime.shards is not None, "open() keeps the shard set"
    config = HParams.from_metadata(runtime.shards.metadata)
    return runtime, build_model(config, runtime.store, store=runtime.store)


def logits_of(path: Path) -> torch.Tensor:
    runtime, model = open_model(path)
    try:
        with torch.inference_mode():
            return model(TOKENS)
    finally:
        runtime.close()


def test_every_architecture_has_a_decoder() -> None:
    """Each architecture the config reader accepts maps to a decoder module."""
    assert set(DECODERS) == set(Arch)


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_swaps_equal_a_fresh_load_and_restore_exactly(case: str, tmp_path: Path) -> None:
    """Re-quantizing attn_q (or attn_q_b) of block 0 and hot-swapping it gives the fresh load's
    logits bit for bit, and swapping the original back restores the original logits exactly."""
    model_dir, store = tmp_path / "model", tmp_path / "store"
    store.mkdir()
    path = write_model(spec_for(case), model_dir)[0]
    assert read_header(path).architecture == CASES[case][0]
    saved = shutil.copy2(path, store / "saved.gguf")
    name = SWAPPED.get(case, "blk.0.attn_q.weight")
    runtime, model = open_model(path)
    try:
        with torch.inference_mode():
            before = model(TOKENS)
        assert torch.isfinite(before).all()
        assert before.shape == (*TOKENS.shape, 256)
        requantize(path, name, "q8_0")
        record = read_header(path).tensor_map()[name]
        runtime.apply(Plan("down", "", (Job(record),)))
        with torch.inference_mode():
            swapped = model(TOKENS)
        assert not torch.equal(swapped, before), "the swap changed nothing"
        assert torch.equal(swapped, logits_of(path))
        shutil.copy2(saved, store / "back.gguf")
        (store / "back.gguf").replace(path)
        runtime.apply(Plan("back", "", (Job(read_header(path).tensor_map()[name]),)))
        with torch.inference_mode():
            assert torch.equal(model(TOKENS), before)
    finally:
        runtime.close()


def test_gemma3_tied_head_follows_a_swapped_embedding(tmp_path: Path) -> None:
    """With no output.weight, the head reads token_embd's slot: swapping the embedding changes the
    head too, and the result equals a fresh load."""
    path = write_model(tiny_arch("gemma3", tied_output=True), tmp_path)[0]
    assert "output.weight" not in read_header(path).tensor_map()
    runtime, model = open_model(path)
    try:
        assert isinstance(model, Gemma3Transformer)
        assert model.output == "token_embd.weight"
        requantize(path, "token_embd.weight", "q4_0")
        runtime.apply(Plan("e", "", (Job(read_header(path).tensor_map()["token_embd.weight"]),)))
        with torch.inference_mode():
            assert torch.equal(model(TOKENS), logits_of(path))
    finally:
        runtime.close()


def test_gemma3_layers_alternate_five_local_then_one_global() -> None:
    """Layers 0-4 and 6-10 slide, layers 5 and 11 are global (llama.cpp's pattern of 6)."""
    md = _gemma_md(n_layer=12)
    config = HParams.from_metadata(md)
    assert [config.is_local_layer(i) for i in range(12)] == [True] * 5 + [False] + [True] * 5 + [
        False
    ]
    assert config.rope_base_local == 10000.0
    assert config.rope_base == 1e6
    assert config.embed_scale == pytest.approx(8.0)  # sqrt(64)


def test_sliding_window_mask_keeps_the_last_window_tokens() -> None:
    """Query i sees keys i-window+1 .. i: never the future, never further back than the window."""
    mask = sliding_window_mask(6, 3, torch.device("cpu"))
    for i in range(6):
        assert [j for j in range(6) if mask[i, j]] == list(range(max(0, i - 2), i + 1))


def test_gemma3_local_layer_ignores_tokens_outside_its_window(tmp_path: Path) -> None:
    """In a one-layer (local) gemma3, the last logits do not change when a token further back than
    the window changes, but do when a token inside it changes."""
    path = write_model(tiny_arch("gemma3", n_layers=1, sliding_window=4), tmp_path)[0]
    runtime, model = open_model(path)
    try:
        with torch.inference_mode():
            base = model(TOKENS[:1])
            far, near = TOKENS[:1].clone(), TOKENS[:1].clone()
            far[0, 2] = 77  # position 2: outside the window of position 9 (6..9)
            near[0, 7] = 77
            assert torch.equal(model(far)[0, -1], base[0, -1])
            assert not torch.equal(model(near)[0, -1], base[0, -1])
    finally:
        runtime.close()


def test_gemma3_reads_rope_scaling_and_refuses_unknown_kinds() -> None:
    """Linear rope scaling sets the global layers' frequency scale; other kinds are refused."""
    config = HParams.from_metadata(
        _gemma_md(**{"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0})
    )
    assert config.rope_freq_scale == 0.125
    with pytest.raises(HParamsError, match="yarn"):
        HParams.from_metadata(
            _gemma_md(**{"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 4.0})
        )


def test_gemma3_without_a_sliding_window_has_only_global_layers() -> None:
    """No (or a zero) attention.sliding_window means no local layers, as in llama.cpp."""
    md = _gemma_md(n_layer=6)
    del md["gemma3.attention.sliding_window"]
    for config in (
        HParams.from_metadata(md),
        HParams.from_metadata(_gemma_md(n_layer=6, **{"gemma3.attention.sliding_window": 0})),
    ):
        assert not any(config.is_local_layer(i) for i in range(6))


def test_gemma3_reads_the_sliding_window_pattern_and_local_rope_base() -> None:
    """attention.sliding_window_pattern (a period or per-layer flags) and rope.freq_base_swa are
    read as llama.cpp's load_swa_pattern and gemma3 hparams read them."""
    period = HParams.from_metadata(
        _gemma_md(
            n_layer=4,
            **{"gemma3.attention.sliding_window_pattern": 2, "gemma3.rope.freq_base_swa": 5e4},
        )
    )
    assert [period.is_local_layer(i) for i in range(4)] == [True, False, True, False]
    assert period.rope_base_local == 5e4
    flags = HParams.from_metadata(
        _gemma_md(n_layer=3, **{"gemma3.attention.sliding_window_pattern": (False, True, True)})
    )
    assert [flags.is_local_layer(i) for i in range(3)] == [False, True, True]


def test_final_logit_softcapping_bounds_the_logits() -> None:
    """With final_logit_softcapping c every logit lies in [-c, c]; without it they exceed c."""
    capped = HParams.from_metadata(_gemma_md(**{"gemma3.final_logit_softcapping": 0.5}))
    g = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randn(*shape, generator=g) * 3
        for name, shape in Gemma3Transformer(capped, _Shapes(), check_shapes=False).required.items()
    }
    plain = HParams.from_metadata(_gemma_md())
    with torch.inference_mode():
        out = Gemma3Transformer(capped, DictWeightProvider(weights))(TOKENS[:, :4])
        raw = Gemma3Transformer(plain, DictWeightProvider(weights))(TOKENS[:, :4])
    assert out.abs().max() <= 0.5
    assert raw.abs().max() > 0.5
    assert torch.equal(out, torch.tanh(raw / 0.5) * 0.5)


class _Shapes:
    """A provider that has every tensor (used only to list what a model reads)."""

    def has(self, name: str) -> bool:
        # tied head, no biases, no rope_freqs (gemma3 has none)
        return name not in ("output.weight", "rope_freqs.weight") and not name.endswith(".bias")

    def weight(self, name: str) -> torch.Tensor:
        raise AssertionError(f"{name} read while listing shapes")


def _gemma_md(n_layer: int = 1, **extra: object) -> dict[str, object]:
    md: dict[str, object] = {
        "general.architecture": "gemma3",
        "gemma3.block_count": n_layer,
        "gemma3.embedding_length": 64,
        "gemma3.feed_forward_length": 128,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 32,
        "gemma3.attention.value_length": 32,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.context_length": 64,
        "gemma3.attention.sliding_window": 4,
        "gemma3.vocab_size": 300,
    }
    md.update(extra)
    return md


@pytest.mark.parametrize("arch", ["qwen3vlmoe", "minimax-m2", "llama4", "gemma4", "dots1"])
def test_a_weight_scale_llama_cpp_would_apply_is_refused_by_name(arch: str, tmp_path: Path) -> None:
    """llama.cpp multiplies a matrix's product by its optional ``.scale`` tensor, for every
    architecture; the decoders of these refuse a file holding one they do not apply, naming it
    (the paired file without it loads)."""
    path = write_model(tiny_arch(arch), tmp_path)[0]
    runtime = HotSwapRuntime.open(path)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        config = HParams.from_metadata(runtime.shards.metadata)
        weights = {name: runtime.store.weight(name) for name in runtime.store.slots}
    finally:
        runtime.close()
    build_model(config, DictWeightProvider(weights))
    weights["blk.0.attn_q.scale"] = torch.ones(1)
    with pytest.raises(MissingWeightError, match=r"blk\.0\.attn_q\.scale: llama\.cpp multiplies"):
        build_model(config, DictWeightProvider(weights))
