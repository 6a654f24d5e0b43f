"""Which decoder runs which ``general.architecture``: ``build_model(config, weights, store=...)``.

- ``llama``, ``qwen2``, ``qwen3``, ``qwen2moe``, ``qwen3moe``: ``llama.Transformer`` (pre-norm
  blocks, SwiGLU, dense or MoE FFNs per block);
- ``gemma3``: ``gemma3.Gemma3Transformer``;
- ``deepseek2``: ``deepseek2.Deepseek2Transformer`` (its latent-attention matrices are read from
  their own slots at every forward, never derived at load);
- ``glm4moe``: ``glm4moe.Glm4MoeTransformer`` (its NextN/MTP blocks are loaded, never run).
- ``gpt-oss``: ``gpt_oss.GptOssTransformer``.

Each computes with the store's fastest kernels (the default: in native storage, ggml's own
products where a libggml is loaded), in float (``numerics="exact"``), or as ggml's CPU kernels
round everywhere (``numerics="ggml"``, :mod:`.ggml_numerics`: figures comparable with
llama.cpp's).

Both read every weight through the provider at forward time. A tied output head is read from
``token_embd.weight``'s own slot rather than copied, so a swap of the embedding is the head's swap
too; no supported architecture builds a fused or pre-scaled copy of a weight at load. When a
store is given, every tensor the model reads is checked against it, and any tensor a future
architecture derives must be registered with ``TensorStore.register_derived`` here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from ggufswap.runtime import float_products
from ggufswap.runtime.models.deepseek2 import Deepseek2Transformer
from ggufswap.runtime.models.errors import MissingWeightError, ModelError
from ggufswap.runtime.models.gemma3 import Gemma3Transformer
from ggufswap.runtime.models.ggml_numerics import GgmlWeights, Numerics, with_ggml_norms
from ggufswap.runtime.models.glm4moe import Glm4MoeTransformer
from ggufswap.runtime.models.gpt_oss import GptOssTransformer
from ggufswap.runtime.models.hparams import Arch, HParams
from ggufswap.runtime.models.llama import DecoderStack, Transformer, WeightProvider

if TYPE_CHECKING:
    from ggufswap.runtime import TensorStore

Decoder = DecoderStack  # what build_model returns

DECODERS: Final[Mapping[Arch, type[DecoderStack]]] = {
    Arch.LLAMA: Transformer,
    Arch.QWEN2: Transformer,
    Arch.QWEN3: Transformer,
    Arch.QWEN2MOE: Transformer,
    Arch.QWEN3MOE: Transformer,
    Arch.GEMMA3: Gemma3Transformer,
    Arch.DEEPSEEK2: Deepseek2Transformer,
    Arch.GLM4MOE: Glm4MoeTransformer,
    Arch.GPT_OSS: GptOssTransformer,
}


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
    model = DECODERS[config.arch](config, weights)
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
