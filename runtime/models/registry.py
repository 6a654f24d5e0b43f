"""Which module runs which ``general.architecture``: one line per architecture.

Each architecture's module (``runtime/models/<arch>.py``) gives its :class:`Architecture`: the
decoder, the keys of its own it reads, its state. ``build_model(config, weights, store=...)``
builds the decoder of ``config.arch``, which computes with the store's fastest kernels (the
default: in native storage, ggml's own products where a libggml is loaded), in float
(``numerics="exact"``), or as ggml's CPU kernels round everywhere (``numerics="ggml"``,
:mod:`.ggml_numerics`: figures comparable with llama.cpp's).

Every decoder reads every weight through the provider at forward time. A tied output head is read
from ``token_embd.weight``'s own slot rather than copied, so a swap of the embedding is the head's
swap too; no supported architecture builds a fused or pre-scaled copy of a weight at load. When a
store is given, every tensor the model reads is checked against it, and any tensor an
architecture derives must be registered with ``TensorStore.register_derived`` here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from ggufswap.runtime import float_products
from ggufswap.runtime.models import (
    deepseek2,
    deepseek32,
    dots1,
    gemma3,
    gemma4,
    glm4moe,
    glm_dsa,
    gpt_oss,
    llama,
    llama4,
    minimax_m2,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    qwen3next,
    qwen3vlmoe,
    qwen35,
    qwen35moe,
)
from ggufswap.runtime.models.architecture import Architecture
from ggufswap.runtime.models.blocks.decoder import DecoderStack
from ggufswap.runtime.models.blocks.weights import WeightProvider
from ggufswap.runtime.models.errors import HParamsError, MissingWeightError, ModelError
from ggufswap.runtime.models.ggml_numerics import GgmlWeights, Numerics, with_ggml_norms
from ggufswap.runtime.models.hparams import Arch, HParams

if TYPE_CHECKING:
    from ggufswap.runtime import TensorStore

Decoder = DecoderStack  # what build_model returns

ARCHITECTURES: Final[Mapping[Arch, Architecture]] = MappingProxyType(
    {
        Arch.LLAMA: llama.ARCHITECTURE,
        Arch.QWEN2: qwen2.ARCHITECTURE,
        Arch.QWEN3: qwen3.ARCHITECTURE,
        Arch.QWEN2MOE: qwen2moe.ARCHITECTURE,
        Arch.QWEN3MOE: qwen3moe.ARCHITECTURE,
        Arch.GEMMA3: gemma3.ARCHITECTURE,
        Arch.DEEPSEEK2: deepseek2.ARCHITECTURE,
        Arch.GLM4MOE: glm4moe.ARCHITECTURE,
        Arch.GPT_OSS: gpt_oss.ARCHITECTURE,
        Arch.QWEN3VLMOE: qwen3vlmoe.ARCHITECTURE,
        Arch.MINIMAX_M2: minimax_m2.ARCHITECTURE,
        Arch.LLAMA4: llama4.ARCHITECTURE,
        Arch.GEMMA4: gemma4.ARCHITECTURE,
        Arch.DOTS1: dots1.ARCHITECTURE,
        Arch.QWEN35: qwen35.ARCHITECTURE,
        Arch.QWEN35MOE: qwen35moe.ARCHITECTURE,
        Arch.QWEN3NEXT: qwen3next.ARCHITECTURE,
        Arch.DEEPSEEK32: deepseek32.ARCHITECTURE,
        Arch.GLM_DSA: glm_dsa.ARCHITECTURE,
    }
)
DECODERS: Final[Mapping[Arch, type[DecoderStack]]] = MappingProxyType(
    {arch: a.decoder for arch, a in ARCHITECTURES.items()}
)


def architecture(arch: Arch | str) -> Architecture:
    """The registered module of ``arch`` (a ``general.architecture`` value)."""
    try:
        return ARCHITECTURES[Arch(arch)]
    except (KeyError, ValueError):
        supported = ", ".join(a.value for a in ARCHITECTURES)
        raise HParamsError(
            f"unsupported architecture {arch!r}; the reference decoder implements: {supported}"
        ) from None


def unused_tensors(model: Decoder, names: Iterable[str]) -> list[str]:
    """The tensors among ``names`` no forward of ``model`` reads, sorted: glm4moe's (or a
    deepseek2 file's) NextN/MTP blocks, loaded as llama.cpp loads them and never computed. A swap
    of only these cannot change the logits, so a sweep can skip them."""
    return model.unused(names)


def build_model(
    config: HParams,
    weights: WeightProvider,
    *,
    store: TensorStore | None = None,
    numerics: Numerics | str | None = None,
) -> Decoder:
    """The decoder for ``config.arch`` over ``weights`` (the store itself when serving).

    ``numerics``: None (serving) multiplies with the store's fastest kernels (in native storage
    ggml's own where a libggml is loaded: llama.cpp's rounding); ``"exact"`` multiplies in float,
    decoded weights by float activations (:func:`~ggufswap.runtime.float_products` around the
    forward); ``"ggml"`` multiplies as ggml's CPU kernels do everywhere (:mod:`.ggml_numerics`):
    it reads the ``store`` (native storage) through :class:`~.ggml_numerics.GgmlWeights`."""
    chosen = None if numerics is None else Numerics(numerics)
    if chosen is Numerics.GGML:
        if store is None or weights is not store:
            raise ModelError("numerics 'ggml' reads the weights' blocks: pass the tensor store")
        weights = GgmlWeights(store)
    model = architecture(config.arch).decoder(config, weights)
    if isinstance(weights, GgmlWeights):  # ggml's RMS norms inside its forward
        model.forward = with_ggml_norms(model.forward)  # type: ignore[method-assign]
    if chosen is Numerics.EXACT:  # float products, even where ggml's kernels could run
        model.forward = with_float_products(model.forward)  # type: ignore[method-assign]
    if store is not None:
        required: Mapping[str, tuple[int, ...]] = model.required
        unknown = sorted(name for name in required if not store.has(name))
        if unknown:
            raise MissingWeightError(f"the tensor store lacks tensors the model reads: {unknown}")
    return model


def with_float_products(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run under :func:`~ggufswap.runtime.float_products`."""

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with float_products():
            return forward(*args, **kwargs)

    return wrapped
