"""The compiled row operations of a decode step (runtime/kernels/rowops.py) against the torch
computations they replace: RoPE bit for bit, the RMS norm as ggml computes it."""

from __future__ import annotations

import pytest
import torch

from ggufswap.runtime.kernels import rowops
from ggufswap.runtime.models.blocks import rope as rope_module
from ggufswap.runtime.models.blocks.rope import RopeTables
from ggufswap.runtime.models.ggml_numerics import rms_norm as ggml_rms_norm
from ggufswap.runtime.models.hparams import RopeType

pytestmark = pytest.mark.skipif(not rowops.available(), reason="the extension was not built")


@pytest.mark.parametrize("rope_type", [RopeType.NEOX, RopeType.NORM])
@pytest.mark.parametrize(
    ("shape", "n_rot"), [((1, 1, 4, 256), 256), ((1, 7, 4, 64), 48), ((3, 1, 2, 64), 64)]
)
def test_rope_rotates_as_the_torch_ops_bit_for_bit(
    rope_type: RopeType,
    shape: tuple[int, int, int, int],
    n_rot: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One compiled call rotates every pair (and passes the dims past n_rot) to the same bits."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    cos, sin = (torch.randn(shape[1], n_rot // 2, generator=gen) for _ in range(2))
    fused = rowops.rope(x, cos, sin, n_rot, neox=rope_type is RopeType.NEOX)
    monkeypatch.setattr(rope_module, "rows_rope", lambda *args, **kwargs: None)
    assert fused is not None
    assert torch.equal(fused, RopeTables(cos, sin, n_rot, rope_type).rotate(x))


def test_rms_norm_is_ggmls_norm_times_the_weight() -> None:
    """The norm's bits are those of ggml's CPU norm and mul (the torch emulation of them)."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 3, 640, generator=gen) * 3, torch.randn(640, generator=gen)
    fused = rowops.rms_norm(x, w, 1e-6)
    assert fused is not None
    assert torch.equal(fused, ggml_rms_norm(x, w, 1e-6))


def test_what_the_compiled_ops_do_not_take_is_left_to_torch() -> None:
    """Another dtype, a non-contiguous input, a broadcast weight or repeated positions: None."""
    x, w = torch.randn(2, 4, 64), torch.ones(64)
    cos = sin = torch.ones(4, 32)
    assert rowops.rms_norm(x.double(), w.double(), 1e-6) is None
    assert rowops.rms_norm(x.transpose(0, 1), w, 1e-6) is None
    assert rowops.rms_norm(x, torch.ones(4, 64), 1e-6) is None
    assert rowops.rope(torch.randn(2, 4, 1, 64), cos, sin, 64, neox=True) is None
