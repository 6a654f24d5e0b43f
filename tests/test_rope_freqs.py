"""Llama 3.1+ RoPE scaling: ``rope_freqs.weight`` divides the RoPE frequencies as llama.cpp's
ggml_rope ``freq_factors`` do, is read at every forward (a swapped ``rope_freqs`` is what the next
batch rotates with), and is refused where llama.cpp's loader has no such tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import ModelDir, fresh_logits, logits, one_thread, open_runtime

from ggufswap.runtime import HotSwapRuntime, PlanState, Storage
from ggufswap.runtime.models import HParams, MissingWeightError, Transformer, build_model
from ggufswap.runtime.models.blocks import DictWeightProvider, RotaryEmbedding
from ggufswap.shards import read_header
from ggufswap.shards.keys import Arch, TensorNames
from ggufswap.shards.presets import tiny_arch, tiny_llama3
from ggufswap.shards.writer import write_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

ROPE_FREQS = TensorNames.ROPE_FREQS


def test_factors_divide_each_pairs_frequency() -> None:
    """With factors f the angle of pair i at position p is p * base^(-2i/n_rot) / f[i] (to
    ggml's float32 rounding of the products, tests/test_rope_ggml.py); factors of one give the
    plain tables."""
    rope = RotaryEmbedding(_config(Arch.LLAMA))
    plain = rope(3, 5, torch.device("cpu"))
    ones = rope(3, 5, torch.device("cpu"), factors=torch.ones(8))
    assert torch.equal(plain.cos, ones.cos)
    assert torch.equal(plain.sin, ones.sin)
    factors = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    scaled = rope(3, 5, torch.device("cpu"), factors=factors)
    i = torch.arange(8, dtype=torch.float64)
    angles = torch.arange(3, 8, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * i / 16) / factors
    assert torch.allclose(scaled.cos, angles.cos().float(), rtol=0.0, atol=2e-6)
    assert torch.allclose(scaled.sin, angles.sin().float(), rtol=0.0, atol=2e-6)
    assert not torch.equal(scaled.cos, plain.cos)


@pytest.mark.parametrize("storage", [Storage.DEQUANTIZED, Storage.NATIVE], ids=lambda s: s.value)
def test_a_rope_freqs_swap_equals_a_fresh_load_and_restores(
    tmp_path: Path, storage: Storage
) -> None:
    """Swapping in the rope_freqs of another Llama 3.1 scaling (factor 2 instead of 8) changes
    the logits to a fresh load's bit for bit (no stale RoPE tables), and the original back gives
    the first logits."""
    model_dir = ModelDir.write(tmp_path / "model", tiny_llama3())
    other = ModelDir.write(tmp_path / "other", tiny_llama3(rope_llama3_factor=2.0))
    assert other.record(ROPE_FREQS).ne == model_dir.record(ROPE_FREQS).ne == (8,)
    saved = model_dir.save(ROPE_FREQS, tmp_path / "saved")
    runtime, model = open_runtime(model_dir.first, storage=storage)
    try:
        before = logits(model)
        model_dir.put(ROPE_FREQS, other.shard_of(ROPE_FREQS))
        ticket = runtime.apply(model_dir.plan("factors", [ROPE_FREQS]))
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        swapped = logits(model)
        assert not torch.equal(swapped, before), "the rope_freqs swap changed nothing"
        assert torch.equal(swapped, fresh_logits(model_dir.first, storage=storage))
        model_dir.put(ROPE_FREQS, saved)
        ticket = runtime.apply(model_dir.plan("back", [ROPE_FREQS]))
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        assert torch.equal(logits(model), before)
    finally:
        runtime.close()


def test_the_factors_change_the_logits(tmp_path: Path) -> None:
    """The same weights without rope_freqs give other logits: the factors are applied."""
    with_factors = ModelDir.write(tmp_path / "a", tiny_llama3()).first
    without = ModelDir.write(tmp_path / "b", tiny_llama3(rope_llama3_factor=0.0)).first
    assert ROPE_FREQS in read_header(with_factors).tensor_map()
    a = fresh_logits(with_factors, storage=Storage.DEQUANTIZED)
    b = fresh_logits(without, storage=Storage.DEQUANTIZED)
    assert torch.equal(a[:, 0], b[:, 0]), "position 0 does not rotate"
    assert not torch.allclose(a[:, 1:], b[:, 1:], atol=1e-3)


def _config(arch: Arch) -> HParams:
    """One block, n_embd 64, four heads of 16 (n_rot 16: eight factors)."""
    return HParams(arch=arch, n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_vocab=8, n_ff=32)


def _weights(config: HParams) -> dict[str, torch.Tensor]:
    """Random weights of every tensor ``config``'s decoder reads."""
    listing = Transformer(config, _Everything(), check_shapes=False).required
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=g) for name, shape in listing.items()}


class _Everything:
    """A provider that has every tensor but biases and rope_freqs (to list what a model reads)."""

    def has(self, name: str) -> bool:
        return not name.endswith(".bias") and name != ROPE_FREQS


def test_rope_freqs_outside_llama_is_refused_naming_the_tensor() -> None:
    """A qwen3 model holding rope_freqs.weight is refused, as llama.cpp's qwen3 loader refuses the
    file; the paired llama model with it is accepted."""
    qwen3 = _config(Arch.QWEN3)
    weights = _weights(qwen3) | {ROPE_FREQS: torch.ones(8)}
    with pytest.raises(MissingWeightError, match=r"rope_freqs\.weight: qwen3 has no RoPE freq"):
        Transformer(qwen3, DictWeightProvider(weights))
    llama = _config(Arch.LLAMA)
    model = Transformer(llama, DictWeightProvider(_weights(llama) | {ROPE_FREQS: torch.ones(8)}))
    assert model.rope_freqs == ROPE_FREQS


@pytest.mark.parametrize("arch", [Arch.DEEPSEEK2, Arch.GLM4MOE, Arch.GPT_OSS, Arch.GEMMA3])
def test_rope_freqs_in_the_other_decoders_is_refused(tmp_path: Path, arch: Arch) -> None:
    """The decoders of the other architectures refuse rope_freqs.weight by name too: their
    llama.cpp loaders have no such tensor."""
    with HotSwapRuntime.open(write_model(tiny_arch(arch), tmp_path)[0]) as runtime:
        assert runtime.shards is not None, "open() keeps the shard set"
        config = HParams.from_metadata(runtime.shards.metadata)
        weights = {name: runtime.store.weight(name) for name in runtime.store.slots}
    build_model(config, DictWeightProvider(weights))  # paired: accepted without it
    weights[ROPE_FREQS] = torch.ones(config.n_rot // 2)
    refused = rf"rope_freqs\.weight: {arch.value} has no RoPE frequency factors"
    with pytest.raises(MissingWeightError, match=refused):
        build_model(config, DictWeightProvider(weights))


def test_rope_freqs_of_the_wrong_length_is_refused() -> None:
    """rope_freqs must hold n_rot / 2 factors (llama.cpp's {n_rot/2})."""
    llama = _config(Arch.LLAMA)
    weights = _weights(llama) | {ROPE_FREQS: torch.ones(4)}
    with pytest.raises(MissingWeightError, match=r"rope_freqs\.weight: expected shape \[8\]"):
        Transformer(llama, DictWeightProvider(weights))
