"""The project's own table of GGML tensor types: mainline ggml's and ik_llama.cpp's.

gguf-py knows mainline's types only; a shard quantized with ik_llama.cpp (``IQ2_KS``, ``IQ4_KT``,
row-interleaved ``_R4`` variants...) would be refused as holding an unknown type. ``GGMLType``
lists both families. Its members are ints, so a mainline member compares and hashes equal to
gguf's ``GGMLQuantizationType`` member of the same code, and either works as a key of a table made
with the other.

Layout: a tensor is rows of ``ne[0]`` elements. A row is ``row_meta`` bytes of per-row header (the
row scale of ik's ``_KS``/``_KT``/``_BN`` types, zero for everything else) followed by
``ne[0] / block_size`` blocks of ``type_size`` bytes. Sources of truth: gguf-py's
``GGML_QUANT_SIZES`` for mainline codes (checked equal by the tests), ik_llama.cpp's
``ggml/src/ggml.c`` type traits and ``ggml/include/ggml.h`` codes (commit 8337e4cd3) for the rest.
ik's reuse of a mainline code with the same layout (``Q1_0``, ik's ``Q1_0_G128``) keeps mainline's
name. Intermediate activation types that never reach a file (``Q8_K``'s ik variants,
``Q8_0_X4``...) and ``I2_S``, whose size is not rows of blocks, are not listed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from types import MappingProxyType
from typing import Final

__all__ = [
    "LAYOUTS",
    "GGMLType",
    "Origin",
    "TypeLayout",
    "ggml_type",
    "row_nbytes",
    "tensor_nbytes",
]


class GGMLType(IntEnum):
    """GGML tensor type codes, as they are stored in a GGUF tensor table."""

    # mainline ggml (gguf-py's GGMLQuantizationType, same names)
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    # ik_llama.cpp
    Q4_0_4_4 = 31
    Q4_0_4_8 = 32
    Q4_0_8_8 = 33
    Q6_0 = 133
    IQ1_BN = 134
    IQ2_BN = 135
    IQ2_K = 137
    IQ3_K = 138
    IQ4_K = 139
    IQ5_K = 140
    IQ6_K = 141
    IQ4_KS = 144
    IQ2_KS = 145
    IQ4_KSS = 146
    IQ5_KS = 152
    IQ2_KT = 153
    IQ3_KT = 154
    IQ4_KT = 155
    IQ3_KS = 156
    IQ2_KL = 157
    IQ1_KT = 158
    Q4_0_R8 = 202
    Q5_0_R4 = 206
    Q8_0_R8 = 208
    Q2_K_R4 = 210
    Q3_K_R4 = 211
    Q4_K_R4 = 212
    Q5_K_R4 = 213
    Q6_K_R4 = 214
    IQ2_XXS_R4 = 216
    IQ2_XS_R4 = 217
    IQ3_XXS_R4 = 218
    IQ1_S_R4 = 219
    IQ4_NL_R4 = 220
    IQ3_S_R4 = 221
    IQ2_S_R4 = 222
    IQ4_XS_R8 = 223
    IQ1_M_R4 = 229
    BF16_R16 = 230
    Q6_0_R4 = 233
    IQ2_BN_R4 = 335
    IQ2_K_R4 = 337
    IQ3_K_R4 = 338
    IQ4_K_R4 = 339
    IQ5_K_R4 = 340
    IQ4_KS_R4 = 344
    IQ5_KS_R4 = 352
    MXFP4_R8 = 353
    Q8_K_R8 = 399


class Origin(Enum):
    """Which project defines a type (and so which source decides its layout)."""

    MAINLINE = "ggml"
    IK = "ik_llama.cpp"


@dataclass(frozen=True, slots=True)
class TypeLayout:
    """How a type lays out its bytes: blocks of ``block_size`` elements in ``type_size`` bytes,
    after ``row_meta`` bytes of per-row header."""

    block_size: int
    type_size: int
    row_meta: int
    origin: Origin


def _m(block_size: int, type_size: int) -> TypeLayout:
    return TypeLayout(block_size, type_size, 0, Origin.MAINLINE)


def _ik(block_size: int, type_size: int, row_meta: int = 0) -> TypeLayout:
    return TypeLayout(block_size, type_size, row_meta, Origin.IK)


T = GGMLType
_QK_K: Final = 256
LAYOUTS: Final[Mapping[GGMLType, TypeLayout]] = MappingProxyType(
    {
        T.F32: _m(1, 4),
        T.F16: _m(1, 2),
        T.Q4_0: _m(32, 18),
        T.Q4_1: _m(32, 20),
        T.Q5_0: _m(32, 22),
        T.Q5_1: _m(32, 24),
        T.Q8_0: _m(32, 34),
        T.Q8_1: _m(32, 40),
        T.Q2_K: _m(_QK_K, 84),
        T.Q3_K: _m(_QK_K, 110),
        T.Q4_K: _m(_QK_K, 144),
        T.Q5_K: _m(_QK_K, 176),
        T.Q6_K: _m(_QK_K, 210),
        T.Q8_K: _m(_QK_K, 292),
        T.IQ2_XXS: _m(_QK_K, 66),
        T.IQ2_XS: _m(_QK_K, 74),
        T.IQ3_XXS: _m(_QK_K, 98),
        T.IQ1_S: _m(_QK_K, 50),
        T.IQ4_NL: _m(32, 18),
        T.IQ3_S: _m(_QK_K, 110),
        T.IQ2_S: _m(_QK_K, 82),
        T.IQ4_XS: _m(_QK_K, 136),
        T.I8: _m(1, 1),
        T.I16: _m(1, 2),
        T.I32: _m(1, 4),
        T.I64: _m(1, 8),
        T.F64: _m(1, 8),
        T.IQ1_M: _m(_QK_K, 56),
        T.BF16: _m(1, 2),
        T.TQ1_0: _m(_QK_K, 54),
        T.TQ2_0: _m(_QK_K, 66),
        T.MXFP4: _m(32, 17),
        T.NVFP4: _m(64, 36),
        T.Q1_0: _m(128, 18),
        # ik_llama.cpp: ggml.c type_traits (blck_size, type_size, row_meta_size)
        T.Q4_0_4_4: _ik(32, 18),
        T.Q4_0_4_8: _ik(32, 18),
        T.Q4_0_8_8: _ik(32, 18),
        T.Q6_0: _ik(32, 26),
        T.IQ1_BN: _ik(64, 13, 2),
        T.IQ2_BN: _ik(64, 16, 4),
        T.IQ2_K: _ik(_QK_K, 76),
        T.IQ3_K: _ik(_QK_K, 110),
        T.IQ4_K: _ik(_QK_K, 144),
        T.IQ5_K: _ik(_QK_K, 176),
        T.IQ6_K: _ik(_QK_K, 212),
        T.IQ4_KS: _ik(_QK_K, 136, 4),
        T.IQ2_KS: _ik(_QK_K, 70, 2),
        T.IQ4_KSS: _ik(_QK_K, 128, 4),
        T.IQ5_KS: _ik(_QK_K, 168, 4),
        T.IQ2_KT: _ik(_QK_K, 68, 4),
        T.IQ3_KT: _ik(_QK_K, 100, 4),
        T.IQ4_KT: _ik(_QK_K, 128, 4),
        T.IQ3_KS: _ik(_QK_K, 102, 2),
        T.IQ2_KL: _ik(_QK_K, 86, 2),
        T.IQ1_KT: _ik(_QK_K, 56, 4),
        # row-interleaved variants: the same bytes per row as their base type, rows in groups
        T.Q4_0_R8: _ik(32, 18),
        T.Q5_0_R4: _ik(32, 22),
        T.Q8_0_R8: _ik(32, 34),
        T.Q2_K_R4: _ik(_QK_K, 84),
        T.Q3_K_R4: _ik(_QK_K, 110),
        T.Q4_K_R4: _ik(_QK_K, 144),
        T.Q5_K_R4: _ik(_QK_K, 176),
        T.Q6_K_R4: _ik(_QK_K, 210),
        T.IQ2_XXS_R4: _ik(_QK_K, 66),
        T.IQ2_XS_R4: _ik(_QK_K, 74),
        T.IQ3_XXS_R4: _ik(_QK_K, 98),
        T.IQ1_S_R4: _ik(32, 6, 2),
        T.IQ4_NL_R4: _ik(32, 18),
        T.IQ3_S_R4: _ik(_QK_K, 110),
        T.IQ2_S_R4: _ik(_QK_K, 82),
        T.IQ4_XS_R8: _ik(_QK_K, 136),
        T.IQ1_M_R4: _ik(32, 7, 2),
        T.BF16_R16: _ik(1, 2),
        T.Q6_0_R4: _ik(32, 26),
        T.IQ2_BN_R4: _ik(64, 16, 4),
        T.IQ2_K_R4: _ik(_QK_K, 76),
        T.IQ3_K_R4: _ik(_QK_K, 110),
        T.IQ4_K_R4: _ik(_QK_K, 144),
        T.IQ5_K_R4: _ik(_QK_K, 176),
        T.IQ4_KS_R4: _ik(_QK_K, 136, 4),
        T.IQ5_KS_R4: _ik(_QK_K, 168, 4),
        T.MXFP4_R8: _ik(32, 17),
        T.Q8_K_R8: _ik(_QK_K, 258),
    }
)
del T

_BY_CODE: Final[Mapping[int, GGMLType]] = MappingProxyType({int(t): t for t in LAYOUTS})


def ggml_type(code: int) -> GGMLType | None:
    """The table's member for ``code`` (an int or any int-valued enum), or None if unknown."""
    return _BY_CODE.get(int(code))


def row_nbytes(ggml_type: int, n_per_row: int) -> int:
    """Bytes of one row of ``n_per_row`` elements, per-row header included.

    ``n_per_row`` must be a multiple of the block size (the caller checks and names the tensor).
    """
    layout = LAYOUTS[GGMLType(ggml_type)]
    return layout.row_meta + n_per_row // layout.block_size * layout.type_size


def tensor_nbytes(ggml_type: int, ne: tuple[int, ...]) -> int:
    """Bytes of a tensor of shape ``ne`` (ggml order, ``ne[0]`` the row length)."""
    return math.prod(ne[1:]) * row_nbytes(ggml_type, ne[0])
