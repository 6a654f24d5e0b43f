"""RoPE: the cos/sin tables of one forward (``RopeTables``) and their per-device cache
(``RotaryEmbedding``), as ggml_rope computes them: NORM (adjacent pairs) or NEOX (halves), linear
scaling and llama 3.1's frequency factors; ggml's ``rope_yarn`` (``YarnRotaryEmbedding``) for
YaRN scaling and a magnitude factor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch
from torch import Tensor, nn

from ggufswap.runtime.models.hparams import HParams, RopeType

# llama_hparams' YaRN defaults (gpt-oss's loader reads no yarn_beta_* keys).
YARN_BETA_FAST: Final = 32.0
YARN_BETA_SLOW: Final = 1.0


@dataclass(frozen=True)
class RopeTables:
    """cos/sin of the positions of one forward, and how to rotate with them."""

    cos: Tensor  # [T, n_rot/2] float32
    sin: Tensor  # [T, n_rot/2] float32
    n_rot: int
    rope_type: RopeType

    def rotate(self, x: Tensor) -> Tensor:
        """NORM rotates (x[2i], x[2i+1]), NEOX (x[i], x[i + n_rot/2]); dims past n_rot pass."""
        # x: [B, T, H, hd]
        cos, sin = self.cos[None, :, None, :], self.sin[None, :, None, :]  # [1, T, 1, n_rot/2]
        rot, rest = x[..., : self.n_rot].float(), x[..., self.n_rot :]
        if self.rope_type == RopeType.NORM:
            x0, x1 = rot[..., 0::2], rot[..., 1::2]  # [B, T, H, n_rot/2] each
            out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        else:
            x0, x1 = rot.chunk(2, dim=-1)
            out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return torch.cat((out.to(x.dtype), rest), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin cache (per device), grown on demand past the training context.

    ``base`` overrides the config's RoPE base (gemma3's local layers), ``n_rot`` its rotated dims
    (deepseek2's decoupled rope dims); ``freq_scale`` is linear scaling (positions are multiplied by
    it, as ggml_rope's ``freq_scale``).
    """

    def __init__(
        self,
        config: HParams,
        *,
        base: float | None = None,
        freq_scale: float = 1.0,
        n_rot: int | None = None,
    ) -> None:
        super().__init__()
        self.n_rot = config.n_rot if n_rot is None else n_rot
        self.rope_type = config.rope_type
        self.base = config.rope_base if base is None else base
        self.freq_scale = freq_scale
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._n_pos = 0
        self._extend(config.context_length)

    def _angles(self, positions: Tensor, factors: Tensor | None = None) -> Tensor:
        """``[P, n_rot/2]`` float64 angles: theta_i = pos * base^(-2i / n_rot) / factors[i] *
        freq_scale, as ggml_rope (``factors``: llama 3.1's ``rope_freqs``, ggml's
        ``freq_factors``)."""
        inv_freq = self.base ** (-torch.arange(0, self.n_rot, 2, dtype=torch.float64) / self.n_rot)
        if factors is not None:
            inv_freq = inv_freq / factors.to(device="cpu", dtype=torch.float64)
        return torch.outer(positions.to(torch.float64) * self.freq_scale, inv_freq)

    def _extend(self, n_pos: int) -> None:
        # Computed in float64, stored float32.
        angles = self._angles(torch.arange(n_pos, dtype=torch.float64))  # [P, n_rot/2]
        cpu = torch.device("cpu")
        self._tables = {cpu: (angles.cos().float(), angles.sin().float())}
        self._n_pos = n_pos

    def forward(
        self, start: int, length: int, device: torch.device, *, factors: Tensor | None = None
    ) -> RopeTables:
        """Tables for positions ``start .. start + length - 1`` on ``device``. With ``factors``
        (``rope_freqs.weight``, ``[n_rot/2]``, read by the caller at this forward) the tables are
        computed for these positions only and never cached: a swapped ``rope_freqs`` is what the
        next forward rotates with."""
        if factors is not None:
            positions = torch.arange(start, start + length, dtype=torch.float64)
            angles = self._angles(positions, factors)  # [T, n_rot/2]
            cos, sin = angles.cos().float().to(device), angles.sin().float().to(device)
            return RopeTables(cos, sin, self.n_rot, self.rope_type)
        if start + length > self._n_pos:
            self._extend(2 * (start + length))
        if device not in self._tables:
            cos, sin = self._tables[torch.device("cpu")]
            self._tables[device] = (cos.to(device), sin.to(device))
        cos, sin = self._tables[device]
        end = start + length
        return RopeTables(cos[start:end], sin[start:end], self.n_rot, self.rope_type)


class YarnRotaryEmbedding(RotaryEmbedding):
    """RoPE tables as ggml_rope's ``rope_yarn`` computes them. With YaRN (``rope_ext_factor`` 1)
    pair ``i`` mixes the interpolated angle ``freq_scale * theta`` and the original ``theta`` by a
    ramp over the correction dims of the original context, and cos/sin are scaled by
    ``rope_attn_factor * (1 + 0.1 ln(1/freq_scale))``; without, the angle is the interpolated one
    and the scale ``rope_attn_factor``. ``base``: the layer's RoPE base (it sets the dims too)."""

    def __init__(self, config: HParams, *, base: float) -> None:
        self.ext_factor = config.rope_ext_factor
        self.mscale = config.rope_attn_factor
        if self.ext_factor != 0.0:
            self.mscale *= 1.0 + 0.1 * math.log(1.0 / config.rope_freq_scale)
        orig_ctx = config.rope_ctx_orig or config.context_length
        self.corr_dims = yarn_corr_dims(config.n_rot, orig_ctx, base)
        super().__init__(config, base=base, freq_scale=config.rope_freq_scale)

    def _extend(self, n_pos: int) -> None:
        half = self.n_rot // 2
        i = torch.arange(half, dtype=torch.float64)
        theta_extrap = torch.outer(
            torch.arange(n_pos, dtype=torch.float64), self.base ** (-2.0 * i / self.n_rot)
        )  # [P, n_rot/2]
        low, high = self.corr_dims
        ramp = 1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)  # [n_rot/2]
        ramp = ramp * self.ext_factor
        theta = self.freq_scale * theta_extrap * (1.0 - ramp) + theta_extrap * ramp
        cos, sin = theta.cos() * self.mscale, theta.sin() * self.mscale
        self._tables = {torch.device("cpu"): (cos.float(), sin.float())}
        self._n_pos = n_pos


def yarn_corr_dims(n_dims: int, orig_ctx: int, base: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims in float32: the pairs below ``low`` keep their angle, those above
    ``high`` are interpolated."""
    f32 = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        num = f32(n_dims) * np.log(f32(orig_ctx) / (f32(n_rot) * f32(2) * f32(math.pi)))
        return f32(num / (f32(2) * np.log(f32(base))))

    low = max(0.0, float(np.floor(corr_dim(YARN_BETA_FAST))))
    high = min(float(n_dims - 1), float(np.ceil(corr_dim(YARN_BETA_SLOW))))
    return low, high


def rotary(config: HParams, base: float) -> RotaryEmbedding:
    """The RoPE tables of one kind of layer: YaRN when the file says so, else linear (with
    ``rope.scaling.attn_factor`` as ggml's ``attn_factor`` when it is not 1)."""
    if config.rope_ext_factor != 0.0 or config.rope_attn_factor != 1.0:
        return YarnRotaryEmbedding(config, base=base)
    return RotaryEmbedding(config, base=base, freq_scale=config.rope_freq_scale)
