"""RoPE angles as ggml's CPU rope computes them (float32 products of ``theta_scale``, rope_yarn's
ramp and magnitude, interleaved multimodal sections), and the refusal of metadata keys llama.cpp
uses that no module implements."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from ggufswap.runtime.models import HParams, HParamsError
from ggufswap.runtime.models.blocks.rope import (
    RotaryEmbedding,
    ggml_angles,
    rotating_pairs,
    yarn_corr_dims,
)
from ggufswap.shards.keys import Arch
from ggufswap.shards.presets import tiny_arch, tiny_deepseek2
from ggufswap.shards.writer import model_metadata

F32 = np.float32


def ggml_reference(
    p: int,
    n_dims: int,
    base: float,
    freq_scale: float,
    factors: list[float] | None,
    ext_factor: float,
    corr: tuple[float, float],
) -> list[np.float32]:
    """ggml_rope_cache_init and rope_yarn transcribed with float32 scalars, one pair at a time."""
    theta_scale = F32(base) ** F32(F32(-2.0) / F32(n_dims))
    theta = F32(p)
    out = []
    for i in range(n_dims // 2):
        ff = F32(factors[i]) if factors else F32(1.0)
        extrap = F32(theta / ff)
        interp = F32(F32(freq_scale) * extrap)
        angle = interp
        if ext_factor != 0.0:
            y = F32(
                F32(F32(i) - F32(corr[0])) / F32(max(0.001, float(F32(corr[1]) - F32(corr[0]))))
            )
            mix = F32(F32(1.0 - min(1.0, max(0.0, float(y)))) * F32(ext_factor))
            angle = F32(F32(interp * F32(F32(1) - mix)) + F32(extrap * mix))
        out.append(angle)
        theta = F32(theta * theta_scale)
    return out


CASES = {
    "plain": (64, 10000.0, 1.0, None, 0.0),
    "linear-and-factors": (32, 500000.0, 0.25, [1.0 + i / 7 for i in range(16)], 0.0),
    "yarn": (16, 150000.0, 1 / 32, None, 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_angles_are_ggml_float32_products(case: str) -> None:
    """Every pair's angle is ggml's float32 value bit for bit (each product rounded), with linear
    scaling, frequency factors or YaRN's ramp."""
    n_dims, base, scale, factors, ext = CASES[case]
    corr = yarn_corr_dims(n_dims, 4096, base) if ext else (0.0, 0.0)
    positions = [0, 1, 7, 513, 1999]
    got = ggml_angles(
        torch.tensor(positions),
        n_dims=n_dims,
        base=base,
        freq_scale=scale,
        factors=None if factors is None else torch.tensor(factors, dtype=torch.float32),
        ext_factor=ext,
        corr_dims=corr,
    )
    for row, p in zip(got.numpy(), positions, strict=True):
        expected = np.array(ggml_reference(p, n_dims, base, scale, factors, ext, corr), F32)
        assert np.array_equal(row, expected), (case, p)


def test_float32_angles_are_not_the_float64_formula() -> None:
    """At long positions the float32 products drift from ``p * base^(-2i/n)`` by more than an
    ulp of the angle (what moved gpt-oss's KLD at positions 1024-2000), within 1e-3 rad."""
    got = ggml_angles(torch.arange(1024, 2000), n_dims=64, base=10000.0).double()
    exact = torch.outer(
        torch.arange(1024, 2000, dtype=torch.float64),
        10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64),
    )
    drift = (got - exact).abs().max().item()
    assert 1e-5 < drift < 1e-3


def test_interleaved_sections_choose_the_rotating_pairs() -> None:
    """Qwen3.5's sections [11, 11, 10, 0] rotate every pair of a text token; a section layout
    that leaves a sector to the fourth component (text position 0) leaves that pair unrotated."""
    assert rotating_pairs(32, [11, 11, 10, 0]).all()
    assert rotating_pairs(6, [2, 0, 1, 0]).tolist() == [True, False, True, True, False, True]
    hp = HParams(
        arch=Arch.QWEN3,
        n_layer=1,
        n_embd=64,
        n_head=4,
        n_head_kv=4,
        n_vocab=8,
        n_ff=8,
        rope_dim=12,
    )
    tables = RotaryEmbedding(hp, sections=[2, 0, 1, 0])(5, 3, torch.device("cpu"))
    assert torch.equal(tables.cos[:, 1], torch.ones(3))
    assert torch.equal(tables.sin[:, 1], torch.zeros(3))
    assert not torch.equal(tables.sin[:, 0], torch.zeros(3))


def test_tables_grown_on_demand_hold_the_bits_of_one_computed_at_once() -> None:
    """The first table covers INITIAL_POSITIONS positions, not the whole training context; rows
    asked for past it (a long context, past the training context too) are the bits a table of
    every position computed at once holds."""
    from ggufswap.runtime.models.blocks.rope import INITIAL_POSITIONS

    hp = HParams(
        arch=Arch.LLAMA,
        n_layer=1,
        n_embd=64,
        n_head=4,
        n_head_kv=4,
        n_vocab=8,
        n_ff=8,
        context_length=4 * INITIAL_POSITIONS,
    )
    rope = RotaryEmbedding(hp, base=10000.0)
    cpu = torch.device("cpu")
    assert rope._n_pos == INITIAL_POSITIONS
    far = 5 * INITIAL_POSITIONS
    whole_cos, whole_sin = rope._cos_sin(torch.arange(far + 8))
    for start in (0, INITIAL_POSITIONS - 3, 3 * INITIAL_POSITIONS, far):
        tables = rope(start, 8, cpu)
        assert torch.equal(tables.cos, whole_cos[start : start + 8]), start
        assert torch.equal(tables.sin, whole_sin[start : start + 8]), start


def metadata_of(spec: Any) -> dict[str, Any]:
    return {key: typed.value for key, typed in model_metadata(spec)}


def test_an_unimplemented_key_is_refused_by_name() -> None:
    """A deepseek2 file with attention.temperature_scale (llama.cpp's graph uses it, the decoder
    does not) is refused with one line naming the key, and the message names the file."""
    md = metadata_of(tiny_deepseek2()) | {"deepseek2.attention.temperature_scale": 0.1}
    with pytest.raises(HParamsError) as caught:
        HParams.from_metadata(md, source="model.gguf")
    message = str(caught.value)
    assert "model.gguf" in message
    lines = [line for line in message.splitlines() if "temperature_scale" in line]
    assert len(lines) == 1
    assert lines[0].strip().startswith("deepseek2.attention.temperature_scale")


@pytest.mark.parametrize(
    ("arch", "key", "value"),
    [
        ("llama", "attention.causal", False),
        ("qwen3moe", "expert_group_count", 4),
        ("gemma3", "rope.scaling.attn_factor", 1.5),
        ("llama", "nextn_predict_layers", 1),
    ],
)
def test_shared_keys_change_nothing_silently(arch: str, key: str, value: object) -> None:
    """Keys every architecture's loader reads are refused where the module does not implement
    them; their llama.cpp defaults are accepted."""
    md = metadata_of(tiny_arch(arch))
    with pytest.raises(HParamsError, match=f"{arch}.{key}"):
        HParams.from_metadata(md | {f"{arch}.{key}": value})
    neutral = {"attention.causal": True, "expert_group_count": 1, "rope.scaling.attn_factor": 1.0}
    if key in neutral:
        HParams.from_metadata(md | {f"{arch}.{key}": neutral[key]})


def test_every_preset_loads_without_refusal() -> None:
    """The writer's files hold only keys their modules read: none is refused."""
    for arch in ("llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma3", "gpt-oss"):
        assert HParams.from_metadata(metadata_of(tiny_arch(arch))).arch.value == arch
    assert math.isfinite(HParams.from_metadata(metadata_of(tiny_deepseek2())).attn_scale)
