"""Per-role scratch buffers: where a product decodes weights it does not keep.

One reused buffer per tensor role (``ffn_up_exps.weight``, ``attn_q.weight``...) and thread,
shared by every block: a decoded expert, or a band of rows of a dense matrix, lives there until
the next decode of that role. No allocation per token.
"""

from __future__ import annotations

import re
import threading
from typing import Final

import torch

__all__ = ["role_scratch"]

_BLOCK_PREFIX: Final = re.compile(r"^blk\.\d+\.")

_local = threading.local()


def role_scratch(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This thread's scratch of ``shape`` for tensor ``name``'s role, shared by every block.

    The buffer is keyed by the role (``ffn_up_exps.weight`` for ``blk.7.ffn_up_exps.weight``):
    what is decoded into it stays valid until the next decode of the same role on this thread,
    which is what a layer needs (gate, up and down of one expert at a time; q, k, v and o).
    """
    buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] | None = getattr(
        _local, "buffers", None
    )
    if buffers is None:
        buffers = _local.buffers = {}
    key = (_BLOCK_PREFIX.sub("", name), dtype, device)
    numel = 1
    for n in shape:
        numel *= n
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)
