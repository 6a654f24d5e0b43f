"""Deterministic, real-looking tensor bytes for every GGML type the test models use.

Types that ``gguf.quants`` can quantize are produced the honest way: normal floats, then
quantized. For the others (K-quants, IQ4_*) valid blocks are synthesized: random quant codes, with
each block's fp16 scale fields (``d``, ``dmin``) set so that ``gguf.quants.dequantize`` yields
finite values of the intended magnitude. (``encode_floats`` can quantize to those types too, with
``shards.kquants``; the model writer keeps synthesizing them so that its files stay the same.)
"""

from __future__ import annotations

import zlib
from typing import Final

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, TokenType
from gguf.quants import dequantize, quantize

from ggufswap.shards import ggml_types, kquants
from ggufswap.shards.ggml_types import GGMLType

Q = GGMLQuantizationType

# Types gguf.quants.quantize encodes from floats.
GGUF_PY_QUANTIZABLE: Final = (
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q8_0,
    Q.MXFP4,
)
# Types ``encode_floats`` encodes from floats (the targets ``requantize`` accepts): gguf-py's, then
# the K-quant and IQ4 types of ggml's reference quantizers (``kquants``).
QUANTIZABLE_TYPES: Final = GGUF_PY_QUANTIZABLE + kquants.TYPES

# Types whose blocks are synthesized: byte offsets of the fp16 scale fields within one block.
_SCALE_FIELDS: Final[dict[GGMLQuantizationType, tuple[int, ...]]] = {
    Q.Q2_K: (80, 82),  # scales[16] qs[64] d dmin
    Q.Q3_K: (108,),  # hmask[32] qs[64] scales[12] d
    Q.Q4_K: (0, 2),  # d dmin scales[12] qs[128]
    Q.Q5_K: (0, 2),  # d dmin scales[12] qh[32] qs[128]
    Q.Q6_K: (208,),  # ql[128] qh[64] scales[16] d
    Q.IQ4_NL: (0,),  # d qs[16]
    Q.IQ4_XS: (0,),  # d scales_h scales_l[4] qs[128]
}
SYNTHESIZED_TYPES: Final = tuple(_SCALE_FIELDS)
WRITABLE_TYPES: Final = GGUF_PY_QUANTIZABLE + SYNTHESIZED_TYPES

# ik_llama.cpp's types (and Q1_0), which neither gguf-py nor llama.cpp reads: random codes, with
# the scale that multiplies every value set for the intended spread. Where it lives ("block": the
# fp16 d at byte 0 of each block; "f16"/"f32": the per-row header) and the rms of the type's
# values at scale 1 over uniformly random codes (measured with runtime/kernels/_ik.py on 4096
# random blocks; shards/ cannot import the runtime).
_IK_SCALES: Final[dict[GGMLType, tuple[str, float]]] = {
    GGMLType.Q1_0: ("block", 1.0),
    GGMLType.Q6_0: ("block", 18.47),
    GGMLType.IQ1_BN: ("f16", 0.817),
    GGMLType.IQ2_BN: ("f32", 1.226),
    GGMLType.IQ2_K: ("block", 84.8),
    GGMLType.IQ3_K: ("block", 628.0),
    GGMLType.IQ4_K: ("block", 1249.0),
    GGMLType.IQ5_K: ("block", 1227.0),
    GGMLType.IQ6_K: ("block", 4793.0),
    GGMLType.IQ2_KS: ("f16", 169.7),
    GGMLType.IQ2_KL: ("f16", 542.3),
    GGMLType.IQ3_KS: ("f16", 314.5),
    GGMLType.IQ4_KS: ("f32", 4991.0),
    GGMLType.IQ4_KSS: ("f32", 5002.0),
    GGMLType.IQ5_KS: ("f32", 4905.0),
    GGMLType.IQ1_KT: ("f32", 2492.0),
    GGMLType.IQ2_KT: ("f32", 2482.0),
    GGMLType.IQ3_KT: ("f32", 324.5),
    GGMLType.IQ4_KT: ("f32", 1363.0),
}
IK_TYPES: Final = tuple(_IK_SCALES)


# gguf.quants works through an array 16 rows at a time (to bound its temporaries): for the
# writer's small tensors that is mostly per-call overhead. These hand it chunks of whole blocks
# as one row each: the same element-wise and per-block arithmetic, so the same bytes, with
# temporaries bounded by the chunk.
_CHUNK_ELEMENTS: Final = 1 << 20


def _quantize_in_chunks(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """``gguf.quants.quantize`` of float32 ``values`` (rows of whole blocks), as flat uint8."""
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    flat = values.reshape(-1)
    step = max(block_size, _CHUNK_ELEMENTS // block_size * block_size)
    parts = [
        np.ascontiguousarray(quantize(flat[i : i + step].reshape(1, -1), ggml_type))
        for i in range(0, flat.size, step)
    ]
    return np.concatenate([part.view(np.uint8).reshape(-1) for part in parts])


def _dequantize_blocks(blocks: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """``gguf.quants.dequantize`` of ``blocks`` (``(n, type_size)`` uint8): ``(n, block_size)``
    float32."""
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    step = max(1, _CHUNK_ELEMENTS // block_size)
    parts = [
        np.asarray(dequantize(blocks[i : i + step].reshape(1, -1), ggml_type), dtype=np.float32)
        for i in range(0, len(blocks), step)
    ]
    return np.concatenate(parts, axis=1).reshape(len(blocks), block_size)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """A generator that depends only on the model seed and the tensor name (not on write order)."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def encode_floats(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Quantize floats (last axis = ``ne[0]``) to the raw bytes of ``ggml_type``, as flat uint8."""
    if ggml_type not in QUANTIZABLE_TYPES:
        names = ", ".join(t.name for t in QUANTIZABLE_TYPES)
        raise ValueError(f"cannot quantize to {ggml_type.name}: supported targets are {names}")
    if ggml_type in kquants.TYPES:
        return kquants.quantize(values, ggml_type)
    return _quantize_in_chunks(np.ascontiguousarray(values, dtype=np.float32), ggml_type)


def decode_floats(
    raw: bytes | memoryview | np.ndarray, ggml_type: GGMLQuantizationType | GGMLType, ne0: int
) -> np.ndarray:
    """Dequantize raw bytes of rows of ``ne0`` elements to float32 of shape ``(rows, ne0)``."""
    if int(ggml_type) not in GGML_QUANT_SIZES:
        raise NotImplementedError(f"gguf cannot dequantize {ggml_type.name}")
    mainline = GGMLQuantizationType(int(ggml_type))
    block_size, type_size = GGML_QUANT_SIZES[mainline]
    row_bytes = ne0 // block_size * type_size
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, row_bytes)
    return np.asarray(dequantize(rows, mainline), dtype=np.float32).reshape(-1, ne0)


def synth_blocks(
    rng: np.random.Generator, ggml_type: GGMLQuantizationType, n_elements: int, *, std: float
) -> np.ndarray:
    """Valid random blocks of a dequantize-only type whose values have roughly ``std`` spread."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = n_elements // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    fields = _SCALE_FIELDS[ggml_type]
    one = np.float16(1.0).tobytes()
    for off in fields:
        blocks[:, off : off + 2] = np.frombuffer(one, dtype=np.uint8)
    # Dequantization is linear in (d, dmin) jointly: measure the spread at d = dmin = 1, then scale.
    unit = _dequantize_blocks(blocks, ggml_type)
    rms = float(np.sqrt(np.mean(np.square(unit)))) or 1.0
    per_block = (std / rms) * rng.uniform(0.75, 1.25, size=n_blocks)
    scales = per_block.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    for off in fields:
        blocks[:, off : off + 2] = scales
    return blocks.reshape(-1)


def synth_tensor(
    rng: np.random.Generator,
    ggml_type: GGMLQuantizationType | GGMLType,
    ne: tuple[int, ...],
    *,
    mean: float,
    std: float,
) -> np.ndarray:
    """Raw bytes (flat uint8) of a tensor of ``ne`` (ggml order) with values ~ N(mean, std).

    Synthesized (dequantize-only) types get values of spread ``std`` around zero; ``mean`` applies
    to quantizable types only.
    """
    n_elements = int(np.prod(ne))
    if ggml_type in _IK_SCALES:
        return synth_ik_tensor(rng, GGMLType(int(ggml_type)), ne, std=std)
    ggml_type = GGMLQuantizationType(int(ggml_type))  # gguf's own types from here on
    if ggml_type in SYNTHESIZED_TYPES:
        return synth_blocks(rng, ggml_type, n_elements, std=std)
    values = rng.standard_normal(size=(n_elements // ne[0], ne[0]), dtype=np.float32)
    values *= np.float32(std)
    values += np.float32(mean)
    return encode_floats(values, ggml_type)


def synth_ik_tensor(
    rng: np.random.Generator, ggml_type: GGMLType, ne: tuple[int, ...], *, std: float
) -> np.ndarray:
    """Valid random rows of an ik_llama.cpp type whose values have roughly ``std`` spread."""
    where, unit_rms = _IK_SCALES[ggml_type]
    layout = ggml_types.LAYOUTS[ggml_type]
    n_rows = int(np.prod(ne[1:]))
    rows = rng.integers(
        0, 256, size=(n_rows, ggml_types.row_nbytes(ggml_type, ne[0])), dtype=np.uint8
    )
    scale = (std / unit_rms) * rng.uniform(0.75, 1.25, size=n_rows)
    if where == "block":
        blocks = rows.reshape(-1, layout.type_size)
        per_block = np.repeat(scale, ne[0] // layout.block_size)
        blocks[:, :2] = per_block.astype(np.float16).view(np.uint8).reshape(-1, 2)
    else:
        dtype = np.float16 if where == "f16" else np.float32
        rows[:, : layout.row_meta] = 0
        head = scale.astype(dtype).view(np.uint8).reshape(n_rows, -1)
        rows[:, : head.shape[1]] = head
    return rows.reshape(-1)


def vocabulary(n_vocab: int, *, extra: int = 0) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A SentencePiece-style vocabulary: unk, bos, eos, byte tokens, then plain pieces.

    Returns ``(tokens, scores, token_types)`` of ``n_vocab + extra`` entries.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    n_bytes = min(256, max(0, n_vocab - len(tokens)))
    tokens += [f"<0x{i:02X}>" for i in range(n_bytes)]
    types += [TokenType.BYTE] * n_bytes
    n_plain = n_vocab + extra - len(tokens)
    tokens += [f"\u2581t{i}" for i in range(n_plain)]
    types += [TokenType.NORMAL] * n_plain
    scores = -np.arange(len(tokens), dtype=np.float32)
    return tokens, scores, np.asarray(types, dtype=np.int32)
