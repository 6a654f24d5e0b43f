"""RoPE: the cos/sin tables of one forward (``RopeTables``) and their per-device cache
(``RotaryEmbedding``), computed as ggml's CPU ``rope`` computes them (``ggml_rope_cache_init``,
``ggml_mrope_cache_init`` and ``rope_yarn`` in ggml-cpu's ops.cpp), in float32:

- ``theta_scale = powf(freq_base, -2.0f / n_dims)``; pair ``i`` of position ``p`` takes
  ``theta = (float)p`` multiplied by ``theta_scale`` ``i`` times, one float32 rounding each;
- divided by its frequency factor (llama 3.1's ``rope_freqs``), then ``freq_scale * theta``
  (linear scaling), or with YaRN (``ext_factor`` != 0) a ramp between that and ``theta`` over the
  correction dims, and the magnitude ``attn_factor`` (times ``1 + 0.1 ln(1 / freq_scale)`` under
  YaRN);
- interleaved multimodal RoPE (``sections``: Qwen3-VL, Qwen3.5): for text every position
  component is the token's position but the fourth, which is 0, so a pair whose sector falls to
  that fourth component does not rotate;
- NORM rotates adjacent pairs, NEOX (and multimodal) the halves of the rotated dims.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch
from torch import Tensor, nn

from ggufswap.runtime import rows_rope
from ggufswap.runtime.models.hparams import HParams, RopeType

# llama_hparams' YaRN defaults (yarn_beta_fast / yarn_beta_slow).
YARN_BETA_FAST: Final = 32.0
YARN_BETA_SLOW: Final = 1.0
F32: Final = np.float32


@dataclass(frozen=True)
class RopeTables:
    """cos/sin of the positions of one forward, and how to rotate with them."""

    cos: Tensor  # [T, n_rot/2] float32
    sin: Tensor  # [T, n_rot/2] float32
    n_rot: int
    rope_type: RopeType

    @property
    def neox(self) -> bool:
        """NEOX pairs (x[i], x[i + n_rot/2]) rather than NORM's (x[2i], x[2i+1])."""
        return self.rope_type != RopeType.NORM

    def rotate(self, x: Tensor) -> Tensor:
        """NORM rotates (x[2i], x[2i+1]), NEOX (x[i], x[i + n_rot/2]); dims past n_rot pass
        (float32 CPU rows in one compiled call, :func:`~ggufswap.runtime.rows_rope`: the same
        bits as these torch ops)."""
        # x: [B, T, H, hd]
        fused = rows_rope(x, self.cos, self.sin, self.n_rot, neox=self.neox)
        if fused is not None:
            return fused
        cos, sin = self.cos[None, :, None, :], self.sin[None, :, None, :]  # [1, T, 1, n_rot/2]
        rot, rest = x[..., : self.n_rot].float(), x[..., self.n_rot :]
        if self.rope_type == RopeType.NORM:
            x0, x1 = rot[..., 0::2], rot[..., 1::2]  # [B, T, H, n_rot/2] each
            out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        else:
            x0, x1 = rot.chunk(2, dim=-1)
            out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return torch.cat((out.to(x.dtype), rest), dim=-1)


def yarn_corr_dims(n_dims: int, orig_ctx: int, base: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims in float32: the pairs below ``low`` keep their angle, those above
    ``high`` are interpolated."""

    def corr_dim(n_rot: float) -> np.float32:
        num = F32(n_dims) * np.log(F32(orig_ctx) / (F32(n_rot) * F32(2) * F32(math.pi)))
        return F32(num / (F32(2) * np.log(F32(base))))

    low = max(0.0, float(np.floor(corr_dim(YARN_BETA_FAST))))
    high = min(float(n_dims - 1), float(np.ceil(corr_dim(YARN_BETA_SLOW))))
    return low, high


def rotating_pairs(n_pairs: int, sections: Sequence[int]) -> Tensor:
    """``[n_pairs]`` bool: which pairs of interleaved multimodal RoPE take a text token's
    position (ggml_mrope_cache_init with ``is_imrope``: sector ``i % sum(sections)`` reads the
    first, second or third position component by ``sector % 3`` below three times that
    section's size, else the fourth, which text tokens set to 0)."""
    s0, s1, s2 = sections[0], sections[1], sections[2]
    span = sum(sections[:4])
    out = []
    for i in range(n_pairs):
        sector = i % span
        kind = sector % 3
        out.append(
            (kind == 1 and sector < 3 * s1)
            or (kind == 2 and sector < 3 * s2)
            or (kind == 0 and sector < 3 * s0)
        )
    return torch.tensor(out, dtype=torch.bool)


def ggml_angles(
    positions: Tensor,
    *,
    n_dims: int,
    base: float,
    freq_scale: float = 1.0,
    factors: Tensor | None = None,
    ext_factor: float = 0.0,
    corr_dims: tuple[float, float] = (0.0, 0.0),
) -> Tensor:
    """``[P, n_dims/2]`` float32 angles, rounded at every step as ggml_rope_cache_init and
    rope_yarn round them."""
    theta_scale = torch.tensor(F32(base) ** F32(F32(-2.0) / F32(n_dims)), dtype=torch.float32)
    scale = torch.tensor(freq_scale, dtype=torch.float32)
    theta = positions.to(torch.float32)  # (float) p
    low, high = corr_dims
    columns = []
    for i in range(n_dims // 2):
        extrap = theta if factors is None else theta / factors[i]
        interp = scale * extrap
        if ext_factor != 0.0:  # rope_yarn_ramp(low, high, 2i) * ext_factor, in float
            y = float(F32(F32(i) - F32(low)) / F32(max(0.001, float(F32(high) - F32(low)))))
            ramp = F32(1.0 - min(1.0, max(0.0, y)))
            mix = torch.tensor(F32(ramp * F32(ext_factor)), dtype=torch.float32)
            interp = interp * (1 - mix) + extrap * mix
        columns.append(interp)
        theta = theta * theta_scale
    return torch.stack(columns, dim=-1)


# Positions the first table covers (at most the training context); it doubles past the last
# position a forward asks for. A row depends on its position only, so a table grown later holds
# the same bits; computing Gemma 3's 32k-position tables up front was 98 % of its model build.
INITIAL_POSITIONS: Final = 4096


# Guards the replacement of any RotaryEmbedding's tables (rare: they double each time).
_GROWING: Final = threading.Lock()


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin cache (per device), computed for :data:`INITIAL_POSITIONS` positions and
    grown on demand (past the training context too).

    ``base`` overrides the config's RoPE base (gemma3's local layers), ``n_rot`` its rotated dims
    (deepseek2's decoupled rope dims); ``freq_scale`` is linear scaling (ggml_rope's
    ``freq_scale``); ``ext_factor`` / ``attn_factor`` / ``orig_ctx`` YaRN and the magnitude;
    ``sections`` interleaved multimodal RoPE.
    """

    def __init__(
        self,
        config: HParams,
        *,
        base: float | None = None,
        freq_scale: float = 1.0,
        n_rot: int | None = None,
        ext_factor: float = 0.0,
        attn_factor: float = 1.0,
        orig_ctx: int = 0,
        sections: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.n_rot = config.n_rot if n_rot is None else n_rot
        self.rope_type = config.rope_type
        self.base = config.rope_base if base is None else base
        self.freq_scale = freq_scale
        self.ext_factor = ext_factor
        mscale = F32(attn_factor)
        if ext_factor != 0.0:
            mscale = F32(mscale * F32(F32(1) + F32(0.1) * np.log(F32(1) / F32(freq_scale))))
        self.mscale = float(mscale)
        ctx = orig_ctx or config.context_length
        self.corr_dims = yarn_corr_dims(self.n_rot, ctx, self.base) if ext_factor else (0.0, 0.0)
        self.rotating = None if sections is None else rotating_pairs(self.n_rot // 2, sections)
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._n_pos = 0
        self._extend(min(config.context_length, INITIAL_POSITIONS))

    def _cos_sin(self, positions: Tensor, factors: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """float32 ``cosf(theta) * mscale`` and ``sinf(theta) * mscale``, ``[P, n_rot/2]``."""
        if factors is not None:
            factors = factors.to(device="cpu", dtype=torch.float32)
        theta = ggml_angles(
            positions,
            n_dims=self.n_rot,
            base=self.base,
            freq_scale=self.freq_scale,
            factors=factors,
            ext_factor=self.ext_factor,
            corr_dims=self.corr_dims,
        )
        if self.rotating is not None:
            theta = theta.masked_fill(~self.rotating, 0.0)
        wide = theta.double()  # cosf / sinf: the float angle's cosine, rounded once
        mscale = torch.tensor(self.mscale, dtype=torch.float32)
        return wide.cos().float() * mscale, wide.sin().float() * mscale

    def _extend(self, n_pos: int) -> None:
        """Tables for ``n_pos`` positions, unless they hold more already: they only grow, so a
        caller (a step's thread) that made sure of its position reads tables that hold it."""
        cos, sin = self._cos_sin(torch.arange(n_pos))
        with _GROWING:
            if n_pos > self._n_pos:
                self._tables = {torch.device("cpu"): (cos, sin)}
                self._n_pos = n_pos

    def forward(
        self, start: int, length: int, device: torch.device, *, factors: Tensor | None = None
    ) -> RopeTables:
        """Tables for positions ``start .. start + length - 1`` on ``device``. With ``factors``
        (``rope_freqs.weight``, ``[n_rot/2]``, read by the caller at this forward) the tables are
        computed for these positions only and never cached: a swapped ``rope_freqs`` is what the
        next forward rotates with."""
        if factors is not None:
            cos, sin = self._cos_sin(torch.arange(start, start + length), factors)
            return RopeTables(cos.to(device), sin.to(device), self.n_rot, self.rope_type)
        if start + length > self._n_pos:
            self._extend(2 * (start + length))
        if device not in self._tables:
            cos, sin = self._tables[torch.device("cpu")]
            self._tables[device] = (cos.to(device), sin.to(device))
        cos, sin = self._tables[device]
        end = start + length
        return RopeTables(cos[start:end], sin[start:end], self.n_rot, self.rope_type)

    def rows_at(self, pos: int) -> tuple[Tensor, Tensor, int]:
        """The CPU tables (cos, sin ``[positions, n_rot / 2]`` float32) holding position
        ``pos`` and the byte offset of its rows (what :meth:`forward` gives for ``pos`` alone),
        for a compiled step; a caller keeps the tables while it reads them (a later call past
        their end replaces them)."""
        if pos >= self._n_pos:
            self._extend(2 * (pos + 1))
        cos, sin = self._tables[torch.device("cpu")]
        return cos, sin, pos * cos.stride(0) * cos.element_size()


def rotary(config: HParams, base: float, *, n_rot: int | None = None) -> RotaryEmbedding:
    """The RoPE tables of one kind of layer with the config's scaling: linear, or YaRN and the
    magnitude ``attn_factor`` (gpt-oss, deepseek2) from llama_context's parameters."""
    return RotaryEmbedding(
        config,
        base=base,
        n_rot=n_rot,
        freq_scale=config.rope_freq_scale,
        ext_factor=config.rope_ext_factor,
        attn_factor=config.rope_attn_factor,
        orig_ctx=config.rope_ctx_orig,
    )
