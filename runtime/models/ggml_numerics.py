"""ggml's CPU arithmetic for the reference decoders: ``numerics="ggml"``.

The decoders compute in float by default (``numerics="exact"``): a weight's decoded values times
float activations. ggml's CPU matrix multiply does not: it first rounds the activations to the
weight type's ``vec_dot_type`` (``VEC_DOT``) and takes integer dot products per block, and gemma's
GELU reads a table of F16 values. llama.cpp's figures carry that rounding, so a small weight change
(a Q5_0 tensor requantized to Q8_0) moves its KL divergence to the level of the rounding noise
(docs/models.md, finding 3; docs/sweep.md). With ``numerics="ggml"`` the decoders round exactly as
ggml does and reproduce llama.cpp's logits to float-summation noise on the cross-check's small
models, so a sweep's figures compare with ``llama-perplexity --kl-divergence``'s. On a real model
that noise flips 8-bit roundings that flip more, layer after layer: the logits differ from
llama.cpp's as much as llama.cpp's own do between its kernel settings, and a round's mean KLD
agrees in expectation, within its standard error (docs/sweep.md).

- F16 / BF16 weights: activations rounded to F16 / BF16.
- Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4, ...: activations as Q8_0 (blocks of 32, ``d = amax / 127``
  stored as F16, ``q = round(x * 127 / amax)``, half to even as the AVX2 kernels round).
- Q4_1, Q5_1: Q8_1 (Q8_0's values plus ``s = d * sum(q)`` stored as F16): the dot product is
  ``d_w d_x sum(q_w q_x) + m_w s_x``, so the weight block minimum ``m_w`` meets an F16-rounded sum
  (read from the weight's blocks).
- K-quants and the i-quants of 256: Q8_K (blocks of 256, ``q = nearest_int(-127 x / peak)``, the
  float scale ``-peak / 127``).
- F32 weights (norms, routers, F32 matrices): exact, as ggml multiplies them in float.
- RMS norms as ggml_compute_forward_rms_norm_f32 computes them (:func:`rms_norm`): the squares
  summed in double, the mean rounded to float, ``1.0f / sqrtf(mean + eps)``, ``(x * scale) * w``.
  The decoders' float32 norm differs by an ulp in a fifth of the rows, and a real model's
  activations hold many values within an ulp of an 8-bit rounding tie: that ulp flips them.
- The KV cache as ``llama-perplexity`` keeps it by default (``--cache-type-k/-v f16``, flash
  attention ``auto``, which is on for the CPU): keys (after RoPE) and values rounded to F16
  (:func:`kv_cache`); a batch's flash attention on the CPU reads them as F16 values and computes
  in float32 (ggml-cpu's ``ggml_compute_forward_flash_attn_ext_tiled``), as the decoders' float32
  attention does in a prefill. The cache holds them as F16 tensors (:func:`kv_f16`), and a
  decode step's attention (one token through the cache) is ggml's own ``flash_attn_ext`` over
  them, read in place (``blocks/attention.py``'s ``ggml_decode_step``), as llama.cpp's decode
  step computes it: the queries rounded to F16 for the scores. :func:`kv_cache_type` sets F32
  instead (llama-cpp-python's ``Llama`` with ``type_k = type_v = F32``,
  ``crosscheck/llama_logits.py``'s reference; its decode steps keep the torch attention).

How: ``build_model(..., numerics="ggml")`` gives the decoder a :class:`GgmlWeights` over the
store (native storage: the weight's type and blocks are at hand); its ``matrix`` and
``experts(...)[e]`` return :class:`GgmlMatrix`, which ``llama.linear`` multiplies with the
rounding above, and ``geglu`` uses :func:`gelu` when its gate is one; the decoder's forward runs
under :func:`ggml_norms` (``build_model`` wraps it), so ``llama.rms_norm`` is :func:`rms_norm`.
Where a libggml is loaded (``ggufswap.runtime.kernels._ggml``: ik_llama.cpp's from the
``ik-llama-cpp-python`` wheel, or mainline's from ``llama-cpp-python``), the products of the types
it multiplies are ggml's own, bit for bit (its ``mul_mat``; the routed experts' one
``mul_mat_id``), and ik_llama.cpp's own types have ggml numerics too. Elsewhere the products are
emulated: the rounded activations times the decoded weights (gguf-py's values, bit for bit), in
float32, or float64 where ggml's F16 dot products need the wider sums (mainline's rounding: ik's
fork rounds some activation types its own way, so the emulation is closest to mainline's
llama.cpp).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import Tensor

from ggufswap.config import Storage
from ggufswap.runtime import QuantizedExperts, QuantizedMatrix, grouped
from ggufswap.runtime.kernels import ggml_library
from ggufswap.runtime.models.errors import ModelError
from ggufswap.shards.ggml_types import GGMLType

if TYPE_CHECKING:
    from ggufswap.runtime import TensorStore

__all__ = [
    "VEC_DOT",
    "GgmlMatrix",
    "GgmlWeights",
    "Numerics",
    "gelu",
    "ggml_fast_path",
    "ggml_norms",
    "ggml_norms_active",
    "kv_cache",
    "kv_cache_type",
    "kv_f16",
    "q8_blocks",
    "q8_k",
    "rms_norm",
    "round_activations",
    "with_ggml_norms",
]


class Numerics(enum.StrEnum):
    """How the decoders multiply: in float, or with ggml's CPU activation rounding."""

    EXACT = "exact"
    GGML = "ggml"


T = GGMLType
# ggml-cpu.c's type_traits_cpu[type].vec_dot_type: what a matmul rounds the activations to.
VEC_DOT: Final[Mapping[GGMLType, GGMLType]] = {
    T.F32: T.F32,
    T.F16: T.F16,
    T.BF16: T.BF16,
    **dict.fromkeys((T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL, T.MXFP4, T.NVFP4, T.Q1_0), T.Q8_0),
    **dict.fromkeys((T.Q4_1, T.Q5_1), T.Q8_1),
    **dict.fromkeys(
        (
            T.Q2_K,
            T.Q3_K,
            T.Q4_K,
            T.Q5_K,
            T.Q6_K,
            T.IQ2_XXS,
            T.IQ2_XS,
            T.IQ2_S,
            T.IQ3_XXS,
            T.IQ3_S,
            T.IQ1_S,
            T.IQ1_M,
            T.IQ4_XS,
            T.TQ1_0,
            T.TQ2_0,
        ),
        T.Q8_K,
    ),
}
Q8_BLOCK: Final = 32
Q8_K_BLOCK: Final = 256
# Q4_1 and Q5_1 blocks start with d (F16) then m (F16): the minimum at bytes 2..4.
_MIN_OFFSET: Final = 2
# Products whose float32 sums alone differ from ggml's by more than float noise (F16 weights:
# mean KLD 5e-8 against llama.cpp on tiny-dense, 3e-10 with float64 sums); the 8-bit
# activation types agree to the fixtures' resolution in float32.
_WIDE_SUMS: Final = frozenset({T.F16, T.BF16})
# ggml's GELU table: the identity from here up, zero from minus this down.
GELU_CLAMP: Final = 10.0
_TORCH_GELU: Final = F.gelu  # torch's, whatever patches F.gelu later (crosscheck/emulate.py)


def _div(numerator: float, x: Tensor) -> Tensor:
    """``numerator / x`` correctly rounded, as C's float division: torch's ``scalar / tensor`` is
    ``reciprocal(x) * scalar``, two roundings, one ulp off ggml's ``127.f / amax`` in a quarter
    of the blocks, which flips the activations that sit on a rounding tie (a real model's have
    many: Gemma 3's layer 0 rounds 71 of 256 rows of a product differently)."""
    return torch.full_like(x, numerator) / x


def q8_blocks(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q8_0 rounding of ``x [N, K]`` (float32): ``(values, d [N, K/32, 1], sum q [N, K/32])``
    where ``values = q * F16(d)`` (quantize_row_q8_0's AVX2 path: ``q = round(x * 127/amax)``)."""
    blocks = x.reshape(x.shape[0], -1, Q8_BLOCK)  # [N, K/32, 32]
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, _div(127.0, amax), torch.zeros_like(amax))
    q = torch.round(blocks * inv)  # half to even
    return (q * d.half().float()).reshape(x.shape), d, q.sum(-1)


def q8_k(x: Tensor) -> Tensor:
    """Q8_K rounding of ``x [N, K]`` (quantize_row_q8_K_ref): ``q * d`` per block of 256."""
    blocks = x.reshape(x.shape[0], -1, Q8_K_BLOCK)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # signed, largest magnitude
    iscale = torch.where(peak != 0, _div(-127.0, peak), torch.zeros_like(peak))
    q = torch.clamp(torch.round(iscale * blocks), max=127)
    d = torch.where(peak != 0, 1.0 / iscale, torch.zeros_like(peak))
    return (q * d).reshape(x.shape)


def round_activations(x: Tensor, vec_dot: GGMLType) -> Tensor:
    """``x [N, K]`` (float32) as ggml holds it for a product with ``vec_dot`` (Q8_1 as Q8_0:
    its sums are :class:`GgmlMatrix`'s correction)."""
    if vec_dot is T.F16:
        return x.half().float()
    if vec_dot is T.BF16:
        return x.bfloat16().float()
    if vec_dot in (T.Q8_0, T.Q8_1):
        return q8_blocks(x)[0]
    if vec_dot is T.Q8_K:
        return q8_k(x)
    assert vec_dot is T.F32, f"no rounding for vec_dot type {vec_dot.name}"
    return x


def gelu(x: Tensor) -> Tensor:
    """ggml_vec_gelu_f32 / ggml_vec_geglu_f32 with GGML_GELU_FP16: the tanh GELU of the input
    rounded to F16, itself rounded to F16; the identity from 10 up, zero from -10 down."""
    xf = x.float()
    table = _TORCH_GELU(xf.half().float(), approximate="tanh").half().float()
    zero = torch.zeros_like(xf)
    out = torch.where(xf <= -GELU_CLAMP, zero, torch.where(xf >= GELU_CLAMP, xf, table))
    return out.to(x.dtype)


# Set while a decoder with ggml's numerics runs its forward (``with_ggml_norms``): the decoders'
# ``rms_norm`` then computes as ggml does. A context variable: other threads and models unaffected.
_GGML_NORMS: ContextVar[bool] = ContextVar("ggufswap_ggml_norms", default=False)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """ggml_compute_forward_rms_norm_f32 (and its fusion with the weight's mul): per row, the
    float32 squares summed in double, ``mean = (float)(sum / n)``, ``scale = 1.0f / sqrtf(mean +
    eps)``, then ``(x * scale) * w`` in float32. (``torch.rsqrt`` is that correctly rounded
    reciprocal of the square root; ``torch.sqrt`` of float32 is not correctly rounded on CPU.)"""
    xf = x.float()
    mean = ((xf * xf).double().sum(-1, keepdim=True) / xf.shape[-1]).float()
    scale = torch.rsqrt(mean + eps)
    return ((xf * scale) * w.to(device=x.device, dtype=torch.float32)).to(x.dtype)


@contextmanager
def _scoped(var: ContextVar[Any], value: Any) -> Iterator[None]:
    """``var`` holds ``value`` within the block (this thread / context), as it did after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


# The KV cache's type a ggml decoder's forward rounds keys and values to (llama-perplexity's
# default F16; F32: no rounding).
_KV_TYPE: ContextVar[GGMLType] = ContextVar("ggufswap_ggml_kv_type", default=T.F16)


@contextmanager
def kv_cache_type(ggml_type: GGMLType) -> Iterator[None]:
    """Within the block, ggml decoders' keys and values are held as ``ggml_type`` (F16 or F32)."""
    if ggml_type not in (T.F16, T.F32):
        raise ModelError(f"numerics 'ggml' holds the KV cache as F16 or F32, not {ggml_type.name}")
    with _scoped(_KV_TYPE, ggml_type):
        yield


def kv_cache_name() -> str:
    """``f16`` or ``f32``: what a ggml decoder's forward holds keys and values as here."""
    return _KV_TYPE.get().name.lower()


def kv_cache(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values as llama.cpp's KV cache holds them: inside a ggml decoder's forward
    (:func:`ggml_norms`) rounded to F16 unless :func:`kv_cache_type` says F32; else as given."""
    if not _GGML_NORMS.get() or _KV_TYPE.get() is not T.F16:
        return k, v
    return k.half().to(k.dtype), v.half().to(v.dtype)


def kv_f16() -> bool:
    """True inside a ggml decoder's forward with an F16 KV cache (the default): its cache holds
    F16 tensors, which its decode steps' attention (ggml's) reads in place."""
    return _GGML_NORMS.get() and _KV_TYPE.get() is T.F16


def ggml_norms_active() -> bool:
    """True inside :func:`ggml_norms`: ``llama.rms_norm`` computes as :func:`rms_norm`."""
    return _GGML_NORMS.get()


@contextmanager
def ggml_norms() -> Iterator[None]:
    """Within the block (this thread / context), the decoders' RMS norms are ggml's."""
    with _scoped(_GGML_NORMS, True):
        yield


def with_ggml_norms(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run under :func:`ggml_norms` (``build_model`` wraps a ggml decoder's)."""

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with ggml_norms():
            return forward(*args, **kwargs)

    return wrapped


@dataclass(frozen=True, eq=False)
class GgmlMatrix:
    """A weight (its GGUF blocks) that ``linear`` multiplies as ggml's CPU matmul does."""

    blocks: QuantizedMatrix

    @property
    def vec_dot(self) -> GGMLType:
        t = GGMLType(self.blocks.ggml_type)
        if t not in VEC_DOT:
            raise ModelError(
                f"{self.blocks.name}: numerics 'ggml' knows no activation rounding for {t.name} "
                "(ggml-cpu's vec_dot_type); use numerics 'exact'"
            )
        return VEC_DOT[t]

    def values(self) -> Tensor:
        """The decoded ``[rows, cols]`` float32 weight (the store's decoded copy, or scratch)."""
        if self.blocks.decoded is not None:
            return self.blocks.decoded().float()
        return self.blocks.decode(torch.float32)

    def linear(self, x: Tensor, b: Tensor | None = None) -> Tensor:
        """``x @ W.T (+ b)`` with ``x`` rounded to the weight's ``vec_dot`` type: ggml's own
        product where a libggml multiplies this type (bit for bit), else its emulation here; the
        result in ``x``'s device and dtype."""
        rows, cols = self.blocks.shape
        device = self.blocks.device
        if self.blocks.ggml:
            y = self.blocks.linear(x, dtype=torch.float32).reshape(-1, rows)  # [N, rows]
        else:
            y = self._emulated(x.reshape(-1, cols).to(device=device, dtype=torch.float32))
        if b is not None:
            y = y + b.to(device=device, dtype=torch.float32)
        return y.reshape(*x.shape[:-1], rows).to(device=x.device, dtype=x.dtype)

    def _emulated(self, flat: Tensor) -> Tensor:
        """``[N, rows]``: ggml's product of ``flat`` ``[N, K]`` (float32), emulated."""
        vec_dot = self.vec_dot
        xq = round_activations(flat, vec_dot)
        if vec_dot in _WIDE_SUMS:
            y = F.linear(xq.double(), self.values().double()).float()
        else:
            y = F.linear(xq, self.values())
        if vec_dot is T.Q8_1:
            y = y + self._q8_1_correction(flat)
        return y

    def _q8_1_correction(self, x: Tensor) -> Tensor:
        """``[N, rows]``: ``sum_blocks m_w (F16(d sum q) - F16(d) sum q)``, what Q8_1's rounded
        block sums add to the product of the rounded values."""
        _, d, qsum = q8_blocks(x)
        d = d[..., 0]  # [N, K/32]
        s16 = (d * qsum).half().float()
        return (s16 - d.half().float() * qsum) @ self._mins().T

    def _mins(self) -> Tensor:
        """``[rows, K/32]`` float32 block minima of a Q4_1 / Q5_1 weight."""
        rows, cols = self.blocks.shape
        raw = self.blocks.raw.reshape(rows * cols // Q8_BLOCK, -1)  # one block a row
        mins = raw[:, _MIN_OFFSET : _MIN_OFFSET + 2].contiguous().view(torch.float16)
        return mins.float().reshape(rows, cols // Q8_BLOCK)


def _linear(w: Tensor | GgmlMatrix, x: Tensor) -> Tensor:
    if isinstance(w, GgmlMatrix):
        return w.linear(x)
    return F.linear(x.to(device=w.device, dtype=w.dtype), w).to(device=x.device, dtype=x.dtype)


class _GgmlExperts:
    """A stacked expert tensor whose ``[e]`` is a :class:`GgmlMatrix` (a stack of bias rows,
    2-D, gives its rows as they are)."""

    def __init__(self, stack: object) -> None:
        self.stack = stack

    @property
    def shape(self) -> torch.Size:
        shape: torch.Size = self.stack.shape  # type: ignore[attr-defined]
        return shape

    def __getitem__(self, e: int, /) -> Tensor | GgmlMatrix:
        item = self.stack[e]  # type: ignore[index]
        return GgmlMatrix(item) if isinstance(item, QuantizedMatrix) else item

    def blocks(self) -> QuantizedExperts | None:
        """The whole stack in its GGUF blocks (the store's), or None (a split or decoded one)."""
        blocks = getattr(self.stack, "blocks", None)
        stack: QuantizedExperts | None = blocks() if blocks is not None else None
        return stack

    def routed(self, x: Tensor, ids: Tensor) -> Tensor:
        """``[N, k, rows]`` routed experts' products as ggml computes them: one ``mul_mat_id``
        through a libggml where it multiplies this stack, else each expert emulated."""
        stack = self.blocks()
        if stack is not None and stack.ggml:
            return stack.routed(x, ids, dtype=torch.float32).to(x.dtype)
        rows = self.shape[1]
        return grouped(lambda e, inputs: _linear(self[e], inputs), x, ids, rows)


class GgmlWeights:
    """The store as a decoder's weight provider, its matrices multiplied as ggml multiplies them.

    Reads go through the store at forward time (a committed swap is what the next forward
    computes with). Needs native storage (the weights' blocks and types) and float32 compute.
    """

    def __init__(self, store: TensorStore) -> None:
        problems = []
        if store.storage is not Storage.NATIVE:
            problems.append(f"storage is {store.storage.value}, it needs native")
        if store.compute_dtype != torch.float32:
            problems.append(f"compute dtype is {store.compute_dtype}, it needs float32")
        if problems:
            raise ModelError(
                "numerics 'ggml' rounds activations by the type of each weight's GGUF blocks: "
                + "; ".join(problems)
                + " (runtime.storage: native, or --storage native)"
            )
        self.store = store

    def weight(self, name: str) -> Tensor:
        return self.store.weight(name)

    def experts(self, name: str) -> _GgmlExperts:
        return _GgmlExperts(self.store.experts(name))

    def matrix(self, name: str) -> Tensor | GgmlMatrix:
        blocks = self.store.blocks(name)
        return self.store.weight(name) if blocks is None else GgmlMatrix(blocks)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.store.shape(name)

    def rows(self, name: str, ids: Tensor) -> Tensor:
        return self.store.rows(name, ids)

    def has(self, name: str) -> bool:
        return self.store.has(name)


def ggml_fast_path(store: TensorStore) -> str | None:
    """Why ggml's numerics are not the fast path for the model in ``store`` (what
    ``runtime.numerics: auto`` serves where they are), or None where they are: native storage
    in float32, a libggml loaded, and every matrix of the model (a 2-D weight or an expert
    stack, whole on the CPU) of a type and row length that libggml multiplies, so that no
    product is emulated. F32 matrices (routers, norms' rows) are exact either way."""
    library = ggml_library()
    if library is None:
        return "no libggml is loaded"
    if store.storage is not Storage.NATIVE:
        return f"storage is {store.storage.value}"
    if store.compute_dtype != torch.float32:
        return f"the compute dtype is {store.compute_dtype}"
    for name, slot in store.loaded_table().items():
        record = slot.record
        if len(record.ne) < 2 or record.ggml_type is T.F32:
            continue
        if slot.is_split:
            return f"{name} is split across pools"
        device = slot.active.tensor.device
        if not library.multiplies(record.ggml_type, record.ne[0], device):
            return f"{library.name} does not multiply {name} ({record.ggml_type.name} on {device})"
    return None
