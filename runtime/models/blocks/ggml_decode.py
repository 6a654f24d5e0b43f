"""A decoder's whole decode step in one compiled call, in ggml's numerics
(``ggufswap.runtime.kernels.ggml_step``, ``csrc/ggmlstep.c``): gemma3's GeGLU stack, and the
stacks of pre-norm blocks with MoE experts (qwen3moe's).

Block by block, a decode step crosses from Python into C once a block
(:func:`~.ggml_steps.block_layer`, :func:`~.ggml_steps.block_moe_layer`) and builds each block's
arguments in Python, then runs the final norm and the head from Python too. :func:`stack_step`
runs the whole step in one call: the blocks, the final norm, the head. Its logits are, bit for
bit, those of the steps block by block (``tests/test_ggml_step.py``), and it reads what they
read: the blocks' weights and the head looked up once per commit (kept in the store's forward
views, which a commit clears: a swap is what the next step reads), the KV cache's F16 buffers
where they are (their addresses taken again when the cache makes or grows them).

What changes from step to step goes in without a tensor op where it can, since after a call
that streamed the weights through the caches each small op costs tens of microseconds: the
token's embedding row is decoded straight into the step's row by the compiled decoder the
store's look-up uses (scaled in the call), and the RoPE rows and first keys come from what the
stack tells its steps (``step_kinds``: each layer's RoPE tables and window, read at the
token's position). A stack that does not tell (its ``layer_inputs`` differ from what it would
tell) gives its steps ``layer_inputs``, each kind of layer once, read back from the masks.

Every block says what it adds to the step (its ``step_layer(kind)``: gemma3's blocks, and
:class:`~.decoder.TransformerBlock` where its FFN is a MoE one); the step is None where a block
says nothing, or elsewhere where it does not apply (exact numerics, an F32 cache, more than one
token, a matrix ggml does not multiply, another attention, no libggml with the call): the caller
then steps block by block. :func:`per_block_steps` turns it off within a block of code (what it
is checked and measured against).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ggufswap.runtime.kernels.dequant import row_decoder
from ggufswap.runtime.kernels.ggml_step import (
    MAX_KINDS,
    RopeRow,
    StepLayer,
    StepWeights,
    available,
    decode_step,
    rope_row,
    step_caches,
    step_weights,
)
from ggufswap.runtime.models.blocks.attention import decode_keys
from ggufswap.runtime.models.blocks.rope import RopeTables, RotaryEmbedding
from ggufswap.runtime.models.ggml_numerics import GgmlMatrix, GgmlWeights, ggml_norms_active, kv_f16
from ggufswap.runtime.models.hparams import RopeType

if TYPE_CHECKING:
    from ggufswap.runtime.models.blocks.decoder import DecoderStack, LayerInputs
    from ggufswap.runtime.models.kv_cache import KVCache

__all__ = ["per_block_steps", "stack_step"]

_PER_BLOCK: ContextVar[bool] = ContextVar("ggufswap_per_block_steps", default=False)


@contextmanager
def per_block_steps() -> Iterator[None]:
    """Within the block (this thread / context), decode steps run block by block, not as one
    call."""
    token = _PER_BLOCK.set(True)
    try:
        yield
    finally:
        _PER_BLOCK.reset(token)


def _kinds(inputs: Sequence[LayerInputs], end: int) -> tuple[tuple[int, ...], list[RopeRow]] | None:
    """Which kind each layer is (the layers that share their RoPE and mask, one object in
    ``layer_inputs``), and each kind's RoPE row (the addresses of ``inputs``' tensors, which
    the caller keeps through the call) and first key; None where a kind's keys are not one run
    ending at the token's own, or there are more kinds than a call tells apart."""
    seen: dict[int, int] = {}
    ropes: list[RopeRow] = []
    kinds = []
    for item in inputs:
        kind = seen.get(id(item))
        if kind is None:
            rope, mask = item
            keys = decode_keys(mask, end)
            if not isinstance(rope, RopeTables) or keys is None or len(ropes) == MAX_KINDS:
                return None
            row = rope_row(rope.cos, rope.sin, rope.n_rot, rope.neox, keys[0])
            if row is None:
                return None
            kind = seen[id(item)] = len(ropes)
            ropes.append(row)
        kinds.append(kind)
    return tuple(kinds), ropes


@dataclass(frozen=True)
class _Told:
    """A stack's one-token steps as its ``step_kinds`` tells them: each layer's kind, and each
    kind's RoPE and window (0: every earlier key)."""

    kinds: tuple[int, ...]
    ropes: tuple[tuple[RotaryEmbedding, int], ...]

    def rows(self, pos: int) -> tuple[list[RopeRow], list[Tensor]]:
        """Each kind's RoPE rows of ``pos`` (read where the tables hold them) and first key,
        and the tables, which the caller keeps through the call."""
        end = pos + 1
        rows: list[RopeRow] = []
        tables: list[Tensor] = []
        for rope, window in self.ropes:
            cos, sin, offset = rope.rows_at(pos)
            tables += (cos, sin)
            neox, lo = rope.rope_type != RopeType.NORM, max(0, end - window) if window > 0 else 0
            rows.append((cos.data_ptr() + offset, sin.data_ptr() + offset, rope.n_rot, neox, lo))
        return rows, tables


# Each stack's _Told (None: its steps read layer_inputs), with the class that told it: a stack's
# split of its layers does not change.
_TOLD: weakref.WeakKeyDictionary[DecoderStack, tuple[type, _Told | None]] = (
    weakref.WeakKeyDictionary()
)


def _told(stack: DecoderStack) -> _Told | None:
    known = _TOLD.get(stack)
    if known is not None and known[0] is type(stack):
        return known[1]
    told = None
    spec = stack.step_kinds()
    if spec is not None:
        index: dict[tuple[int, int], int] = {}
        for rope, window in spec:
            index.setdefault((id(rope), window), len(index))
        ropes = {index[id(rope), window]: (rope, window) for rope, window in spec}  # in order
        kinds = tuple(index[id(rope), window] for rope, window in spec)
        if len(ropes) <= MAX_KINDS:
            told = _Told(kinds, tuple(ropes.values()))
    _TOLD[stack] = (type(stack), told)
    return told


@dataclass(frozen=True)
class _Step:
    """A stack's step weights for layers of ``kinds`` (None: the call does not apply), what
    they point into (kept alive with them until the store's next commit), and how a token's
    embedding row is decoded straight into the step's row (None: the stack's embedding)."""

    kinds: tuple[int, ...]
    weights: StepWeights | None
    held: tuple[object, ...]
    embedding: _Embedding | None = None


@dataclass(frozen=True)
class _Embedding:
    """A token's embedding row decoded from the table's blocks into a row of the step's (one
    per thread)."""

    decode: Callable[[int, int], bool]
    blocks: Tensor  # [rows, row bytes]
    d: int
    rows: threading.local = field(default_factory=threading.local)

    def row(self, token: int) -> Tensor | None:
        """This thread's row (``[1, 1, d]`` float32) holding ``token``'s embedding, not scaled
        (the call scales it), or None where the token is not a row (the stack's embedding
        refuses it) or the compiled decoder is off."""
        if not 0 <= token < self.blocks.shape[0]:
            return None
        x = getattr(self.rows, "x", None)
        if x is None:
            x = self.rows.x = torch.empty(1, 1, self.d, dtype=torch.float32)
        src = self.blocks.data_ptr() + token * self.blocks.stride(0)
        return x if self.decode(src, x.data_ptr()) else None


def _embedding(weights: GgmlWeights, stack: DecoderStack, d: int) -> _Embedding | None:
    """Where the stack embeds as :class:`DecoderStack` does (a subclass may not) from a table
    whose rows the compiled decoder decodes."""
    from ggufswap.runtime.models.blocks.decoder import DecoderStack as Base  # (imports this)

    if type(stack).embedding is not Base.embedding:
        return None
    source = weights.store.row_blocks(stack.tok_embd)  # GgmlWeights: float32 values
    if source is None:
        return None
    blocks, ggml_type, cols = source
    decode = row_decoder(ggml_type, cols) if cols == d and blocks.is_cpu else None
    return None if decode is None else _Embedding(decode, blocks, d)


def _step(weights: GgmlWeights, stack: DecoderStack, kinds: tuple[int, ...]) -> _Step:
    """The stack's :class:`StepWeights` (None: the call does not apply), once per commit (the
    store's forward views, under the head's name), for layers of ``kinds`` (the first step's
    after the commit: a stack's split of its layers into kinds does not change)."""

    def make() -> _Step:
        layers: list[StepLayer] = []
        for layer, kind in zip(stack.layers, kinds, strict=True):
            part = getattr(layer, "step_layer", None)
            made = None if part is None else part(kind)
            if not isinstance(made, StepLayer):
                return _Step(kinds, None, ())
            layers.append(made)
        head = weights.matrix(stack.output)
        norm = weights.weight(stack.norm)
        if not isinstance(head, GgmlMatrix):
            return _Step(kinds, None, ())
        held = step_weights(layers, norm, head.blocks)
        embedding = None if held is None else _embedding(weights, stack, held.d)
        return _Step(kinds, held, (head, norm), embedding)

    return weights.store.views.get("ggml-step", stack.output, _Step, make)


Caches = tuple[tuple[int, int, int], ...]  # per layer: k, v (addresses), capacity
# Each cache's buffers as the last step took them: (its generation, the step weights, caches).
_CACHES: weakref.WeakKeyDictionary[KVCache, tuple[int, StepWeights, Caches]] = (
    weakref.WeakKeyDictionary()
)


def _caches(cache: KVCache, held: StepWeights, end: int) -> Caches | None:
    """Every layer's F16 buffers with room for ``end`` positions (made or grown here where they
    do not have it), as the step takes them; None where they are not F16 ones."""
    if cache.capacity() < end:
        for layer, (n_head_kv, head_dim) in enumerate(held.heads):
            like = torch.empty(1, n_head_kv, 1, head_dim, dtype=torch.float16)
            cache.buffers(layer, end, like, like)
    last = _CACHES.get(cache)
    if last is not None and last[0] == cache.generation and last[1] is held:
        return last[2]
    buffers = [cache.room(layer, end) for layer in range(len(held.heads))]
    if any(b is None for b in buffers):
        return None
    made = step_caches(held, [b for b in buffers if b is not None])
    if made is not None:
        _CACHES[cache] = (cache.generation, held, made)
    return made


def stack_step(
    stack: DecoderStack, tokens: Tensor, start_pos: int, cache: KVCache
) -> Tensor | None:
    """``logits [1, 1, V]`` of one token ``tokens [1, 1]`` at ``start_pos`` (the cache's
    length) in one compiled call (the embedding row decoded into it where the compiled decoder
    reads the table), the token's keys and values appended to ``cache``; None where the call
    does not apply (the caller steps block by block; the cache may have grown its buffers for
    the token, nothing else is done)."""
    weights = stack.weights
    applies = (
        not _PER_BLOCK.get()
        and isinstance(weights, GgmlWeights)
        and ggml_norms_active()
        and kv_f16()
        and tokens.shape == (1, 1)
        and tokens.is_cpu
        and start_pos == cache.length
        and available()
    )
    if not applies:
        return None
    assert isinstance(weights, GgmlWeights)
    known = weights.store.views.find("ggml-step", stack.output)
    if isinstance(known, _Step) and known.weights is None:
        return None  # not this stack, until the next commit
    end = start_pos + 1
    told = _told(stack)
    kept: object  # what the RoPE rows' addresses point into, kept through the call
    if told is not None:
        kinds = told.kinds
        ropes, kept = told.rows(start_pos)
    else:
        kept = stack.layer_inputs(start_pos, 1, tokens.device, cached=True)
        found = _kinds(kept, end)
        if found is None:
            return None
        kinds, ropes = found
    step = _step(weights, stack, kinds)
    held = step.weights
    if held is None or step.kinds != kinds:
        return None
    caches = _caches(cache, held, end)
    if caches is None:
        return None
    c = stack.config
    x = None if step.embedding is None else step.embedding.row(int(tokens.item()))
    scale = c.embed_scale
    if x is None:
        x, scale = stack.embedding(tokens), 1.0
    logits = decode_step(x, held, ropes, caches, pos=start_pos, eps=c.norm_eps, x_scale=scale)
    del kept  # read by the call
    if logits is None:
        return None
    cache.advance(1)
    softcap = c.final_logit_softcap
    return logits if not softcap else torch.tanh(logits / softcap) * softcap
