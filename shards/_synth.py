"""Deterministic, real-looking tensor bytes for every GGML type the test models use.

Types that ``gguf.quants`` can quantize are produced the honest way: normal floats, then
quantized. For the others (K-quants, IQ4_*) gguf-py has only a dequantizer, so valid blocks are
synthesized: random quant codes, with each block's fp16 scale fields (``d``, ``dmin``) set so that
``gguf.quants.dequantize`` yields finite values of the intended magnitude.
"""

from __future__ import annotations

import zlib
from typing import Final

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, TokenType
from gguf.quants import dequantize, quantize

Q = GGMLQuantizationType

# Types gguf.quants.quantize encodes from floats (the targets ``requantize`` accepts).
QUANTIZABLE_TYPES: Final = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4)

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
WRITABLE_TYPES: Final = QUANTIZABLE_TYPES + SYNTHESIZED_TYPES


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """A generator that depends only on the model seed and the tensor name (not on write order)."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def encode_floats(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Quantize floats (last axis = ``ne[0]``) to the raw bytes of ``ggml_type``, as flat uint8."""
    if ggml_type not in QUANTIZABLE_TYPES:
        names = ", ".join(t.name for t in QUANTIZABLE_TYPES)
        raise ValueError(f"cannot quantize to {ggml_type.name}: supported targets are {names}")
    encoded = quantize(np.ascontiguousarray(values, dtype=np.float32), ggml_type)
    return np.ascontiguousarray(encoded).view(np.uint8).reshape(-1)


def decode_floats(
    raw: bytes | memoryview | np.ndarray, ggml_type: GGMLQuantizationType, ne0: int
) -> np.ndarray:
    """Dequantize raw bytes of rows of ``ne0`` elements to float32 of shape ``(rows, ne0)``."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    row_bytes = ne0 // block_size * type_size
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, row_bytes)
    return np.asarray(dequantize(rows, ggml_type), dtype=np.float32).reshape(-1, ne0)


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
    unit = np.asarray(dequantize(blocks, ggml_type), dtype=np.float32)
    rms = float(np.sqrt(np.mean(np.square(unit)))) or 1.0
    per_block = (std / rms) * rng.uniform(0.75, 1.25, size=n_blocks)
    scales = per_block.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    for off in fields:
        blocks[:, off : off + 2] = scales
    return blocks.reshape(-1)


def synth_tensor(
    rng: np.random.Generator,
    ggml_type: GGMLQuantizationType,
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
    if ggml_type in SYNTHESIZED_TYPES:
        return synth_blocks(rng, ggml_type, n_elements, std=std)
    values = rng.standard_normal(size=(n_elements // ne[0], ne[0]), dtype=np.float32)
    values *= np.float32(std)
    values += np.float32(mean)
    return encode_floats(values, ggml_type)


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
