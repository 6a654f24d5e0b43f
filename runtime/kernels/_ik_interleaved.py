"""ik_llama.cpp's row-interleaved types (``_R4``/``_R8``): undo the interleave, then decode.

ik stores each group of ``interleave`` consecutive rows of such a type together (its
``repack_*`` functions in ``ggml/src/iqk/iqk_quantize.cpp`` at commit 8337e4cd3): the group's
per-row headers first (the row scales of the rows, one after the other), then one *big block* per
block column, holding block ``ib`` of every row of the group with their fields interleaved (the
``d`` of the rows side by side, then the quants of the rows 4 bytes at a time, nibbles and high
bits regrouped). Every repack here is a pure permutation of the base type's bits: nothing is
rounded or recomputed, the group holds exactly the bits of its rows in the base type.

So the decoder inverts the permutation and hands the base type's rows to the base type's own
kernel; ik's ``dequantize_row_*_r4``/``_r8`` compute the same floats as its base type's
``dequantize_row_*`` (the golden files in ``tests/fixtures/ik_golden`` check every type here bit
for bit). The permutation of one big block is found once per type by running a transcription of
ik's repack loop on *labelled bits* (each base bit carries its own index; shifts, masks and ORs
move labels), so the inverse is exact by construction. The types whose repack first converts a
block to its levels (Q5_0, Q6_0, IQ4_NL, the k-quants, IQ*_K) are one table entry each: their row
headers, their levels, and the planes ik packs the levels into (``_ik_labels.levels_repack``);
the others read like ik's C. The labelled bits are ``_ik_labels.py``, the transcriptions
``_ik_repack_levels.py`` and ``_ik_repack_bits.py``; here, the table of types, the inverse
permutation and its application with torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ggufswap.runtime.kernels._ik_labels import (
    Block,
    Repack,
)
from ggufswap.runtime.kernels._ik_repack_bits import (
    decode_iq1_m_r4,
    decode_iq1_s_r4,
    decode_q8_k_r8,
    rp_iq1_m_r4,
    rp_iq1_s_r4,
    rp_iq2_bn_r4,
    rp_iq2_s_r4,
    rp_iq2_xs_r4,
    rp_iq2_xxs_r4,
    rp_iq3_s_r4,
    rp_iq3_xxs_r4,
    rp_q8_k_r8,
)
from ggufswap.runtime.kernels._ik_repack_levels import (
    rp_iq2_k_r4,
    rp_iq3_k_r4,
    rp_iq4_k_r4,
    rp_iq4_ks_r4,
    rp_iq4_nl_r4,
    rp_iq4_xs_r8,
    rp_iq5_k_r4,
    rp_iq5_ks_r4,
    rp_q2_k_r4,
    rp_q3_k_r4,
    rp_q4_0_r8,
    rp_q4_k_r4,
    rp_q5_0_r4,
    rp_q5_k_r4,
    rp_q6_0_r4,
    rp_q6_k_r4,
    rp_q8_0_r8,
)
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType

__all__ = ["INTERLEAVED", "Interleaved", "deinterleave"]


@dataclass(frozen=True, slots=True)
class Interleaved:
    """A row-interleaved type: its base type, how many rows a group holds, and ik's repack of
    one big block (``ilv`` base blocks in, one big block out) transcribed to Python."""

    base: GGMLType | None  # None: no such file type; ``decode`` reads the de-interleaved bytes
    ilv: int
    repack: Repack
    # ik's decoder computes d * q + (-16 d) (-32 d for Q6_0) where the base computes
    # d * (q - 16): one rounding of the same exact value either way (fused), except that an
    # exact zero is +0.0 in ik's form and -0.0 in the base's for a negative d.
    positive_zero: bool = False
    # Byte offsets in the big block whose bits 1..7 hold ik's scrambled_sign of 7 sign bits
    # (the prefix XOR r_i = s_0 ^ ... ^ s_i; the repacks below treat it as identity, and the
    # decoder undoes it, s_i = r_i ^ r_(i-1), before the permutation).
    scrambled: tuple[int, ...] = ()
    decode: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # (bytes, n_per_row)


T = GGMLType
INTERLEAVED: dict[GGMLType, Interleaved] = {
    T.Q4_0_R8: Interleaved(T.Q4_0, 8, rp_q4_0_r8),
    T.Q8_0_R8: Interleaved(T.Q8_0, 8, rp_q8_0_r8),
    T.Q5_0_R4: Interleaved(T.Q5_0, 4, rp_q5_0_r4, positive_zero=True),
    T.Q6_0_R4: Interleaved(T.Q6_0, 4, rp_q6_0_r4, positive_zero=True),
    T.IQ4_NL_R4: Interleaved(T.IQ4_NL, 4, rp_iq4_nl_r4),
    T.IQ4_XS_R8: Interleaved(T.IQ4_XS, 8, rp_iq4_xs_r8),
    T.IQ4_KS_R4: Interleaved(T.IQ4_KS, 4, rp_iq4_ks_r4),
    T.Q4_K_R4: Interleaved(T.Q4_K, 4, rp_q4_k_r4),
    T.Q6_K_R4: Interleaved(T.Q6_K, 4, rp_q6_k_r4),
    T.Q2_K_R4: Interleaved(T.Q2_K, 4, rp_q2_k_r4),
    T.Q3_K_R4: Interleaved(T.Q3_K, 4, rp_q3_k_r4),
    T.Q5_K_R4: Interleaved(T.Q5_K, 4, rp_q5_k_r4),
    T.IQ2_K_R4: Interleaved(T.IQ2_K, 4, rp_iq2_k_r4),
    T.IQ3_K_R4: Interleaved(T.IQ3_K, 4, rp_iq3_k_r4),
    T.IQ4_K_R4: Interleaved(T.IQ4_K, 4, rp_iq4_k_r4),
    T.IQ5_K_R4: Interleaved(T.IQ5_K, 4, rp_iq5_k_r4),
    T.IQ5_KS_R4: Interleaved(T.IQ5_KS, 4, rp_iq5_ks_r4),
    T.IQ2_BN_R4: Interleaved(T.IQ2_BN, 4, rp_iq2_bn_r4),
    T.IQ2_S_R4: Interleaved(T.IQ2_S, 4, rp_iq2_s_r4),
    T.IQ3_S_R4: Interleaved(T.IQ3_S, 4, rp_iq3_s_r4),
    T.IQ2_XXS_R4: Interleaved(T.IQ2_XXS, 4, rp_iq2_xxs_r4, scrambled=tuple(range(8, 136))),
    T.IQ3_XXS_R4: Interleaved(T.IQ3_XXS, 4, rp_iq3_xxs_r4, scrambled=tuple(range(8, 136))),
    T.IQ2_XS_R4: Interleaved(T.IQ2_XS, 4, rp_iq2_xs_r4, scrambled=tuple(range(9, 264, 2))),
    T.Q8_K_R8: Interleaved(None, 8, rp_q8_k_r8, decode=decode_q8_k_r8),
    T.IQ1_S_R4: Interleaved(None, 4, rp_iq1_s_r4, decode=decode_iq1_s_r4),
    T.IQ1_M_R4: Interleaved(None, 4, rp_iq1_m_r4, decode=decode_iq1_m_r4),
}
del T


# --- the inverse permutation, and applying it with torch ----------------------------------------


@lru_cache(maxsize=64)
def _inverse(ggml_type: GGMLType) -> tuple[int, np.ndarray]:
    """``(unit, src)``: the big block undone in units of ``unit`` bits (8, 4, 2 or 1): base unit
    ``u`` (row-major over the group's ``ilv`` blocks) is the big block's unit ``src[u]``."""
    spec = INTERLEAVED[ggml_type]
    ts = LAYOUTS[ggml_type].type_size
    x = [Block(ts, first_label=8 * ts * k) for k in range(spec.ilv)]
    y = Block(spec.ilv * ts)
    spec.repack(x, y)
    labels = np.stack([b.lab[:8] for b in y.bytes]).reshape(-1)  # big block bit -> base bit
    nbits = 8 * spec.ilv * ts
    if sorted(labels.tolist()) != list(range(nbits)):
        msg = f"{ggml_type.name}: the repack is not a permutation of the base bits"
        raise AssertionError(msg)
    for unit in (8, 4, 2, 1):
        chunks = labels.reshape(-1, unit)
        aligned = (chunks[:, 0] % unit == 0) & (np.diff(chunks, axis=1) == 1).all(axis=1)
        if aligned.all():
            break
    src = np.empty(nbits // unit, dtype=np.int64)
    src[labels.reshape(-1, unit)[:, 0] // unit] = np.arange(nbits // unit)
    return unit, src


@lru_cache(maxsize=64)
def _index(ggml_type: GGMLType, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_inverse(ggml_type)[1]).to(device)


def _unscramble_table() -> np.ndarray:
    """uint8 ``[256]``: a byte with scrambled_sign's 7 bits in bits 1..7 -> the sign bits."""
    b = np.arange(256, dtype=np.int64)
    r = b >> 1
    signs = (r ^ (r << 1)) & 0x7F
    return ((signs << 1) | (b & 1)).astype(np.uint8)


@lru_cache(maxsize=8)
def _unscramble(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_unscramble_table()).to(device=device, dtype=torch.int64)


@lru_cache(maxsize=64)
def _scrambled(ggml_type: GGMLType, device: torch.device) -> torch.Tensor:
    return torch.tensor(INTERLEAVED[ggml_type].scrambled, dtype=torch.int64, device=device)


def _units(b: torch.Tensor, unit: int) -> torch.Tensor:
    """uint8 ``[..., n]`` -> ``[..., n * 8 / unit]`` fields of ``unit`` bits, low bits first."""
    if unit == 8:
        return b
    shifts = torch.arange(0, 8, unit, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & ((1 << unit) - 1)).flatten(-2)


def _pack(u: torch.Tensor, unit: int) -> torch.Tensor:
    if unit == 8:
        return u
    per = 8 // unit
    shifts = torch.arange(0, 8, unit, dtype=torch.uint8, device=u.device)
    parts = u.unflatten(-1, (-1, per)) << shifts
    out = parts[..., 0]
    for j in range(1, per):
        out = out | parts[..., j]
    return out


def deinterleave(raw: torch.Tensor, ggml_type: GGMLType, ne: tuple[int, ...]) -> torch.Tensor:
    """The base type's bytes of the tensor ``raw`` (1-D uint8, exactly its bytes, rows a
    multiple of the interleave, already checked), on ``raw``'s device."""
    spec = INTERLEAVED[ggml_type]
    layout = LAYOUTS[ggml_type]
    ilv, ts, meta = spec.ilv, layout.type_size, layout.row_meta
    nb = ne[0] // layout.block_size
    groups = math.prod(ne[1:]) // ilv
    g = raw.view(groups, ilv * (meta + nb * ts))
    unit, _ = _inverse(ggml_type)
    big = g[:, ilv * meta :].reshape(groups, nb, ilv * ts)
    if spec.scrambled:
        at = _scrambled(ggml_type, raw.device)
        big = big.clone()
        big[..., at] = _unscramble(raw.device)[big[..., at].long()].to(torch.uint8)
    blocks = _pack(_units(big, unit)[..., _index(ggml_type, raw.device)], unit)
    blocks = blocks.view(groups, nb, ilv, ts).transpose(1, 2).reshape(groups, ilv, nb * ts)
    if meta:
        blocks = torch.cat((g[:, : ilv * meta].reshape(groups, ilv, meta), blocks), dim=2)
    return blocks.reshape(-1)
