"""Where a sweep round's quantized tensors come from.

- :class:`RequantSource`: re-encode the model's own tensor with ``shards.requantize`` (the
  project's quantizers: every target ``SUPPORTED_TARGETS`` lists, K-quants when requant has
  them). The tensor's bytes are first copied into a one-tensor GGUF in the scratch directory and
  requantized there, so a round writes two files the size of that tensor, never the model.
- a model in the target type laid out like the swept one (``--source q4_K=DIR/model.gguf``):
  its record is planned as it is, nothing is written.

The user's model files are never written: the runtime loads the swapped tensor from the scratch
(or source) file and the original back from the model's own file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from gguf import GGMLQuantizationType

from ggufswap.runtime.serving.errors import ServingError
from ggufswap.runtime.serving.recipe import qtype_name
from ggufswap.shards import (
    RequantError,
    ShardSet,
    TensorRecord,
    read_header,
    read_tensor_bytes,
    requantize,
)
from ggufswap.shards.writer import RawTensor, write_gguf


class SourceError(ServingError):
    """No quantized tensor could be made or found for a round; the message says which and why."""


def _file_name(name: str, suffix: str) -> str:
    return f"{name}.{suffix}.gguf"


class TensorSources:
    """The record to plan for ``(tensor, target)``: from a source model of that type when one is
    given, else requantized into ``scratch``."""

    def __init__(
        self,
        *,
        scratch: Path,
        originals: Mapping[str, TensorRecord],
        models: Mapping[GGMLQuantizationType, ShardSet] | None = None,
    ) -> None:
        self.scratch = scratch
        self.originals = originals
        self.models = dict(models or {})
        scratch.mkdir(parents=True, exist_ok=True)

    @property
    def roots(self) -> list[str]:
        """The directories the runtime must allow plans to read from."""
        dirs = {str(self.scratch)}
        for shard_set in self.models.values():
            dirs.update(os.path.dirname(p) for p in shard_set.paths)
        return sorted(dirs)

    def record(self, name: str, target: GGMLQuantizationType) -> TensorRecord:
        original = self.originals.get(name)
        if original is None:
            raise SourceError(f"{name}: the swept model has no such tensor")
        model = self.models.get(target)
        if model is not None:
            return self._from_model(model, name, target, original)
        return self._requantized(name, target, original)

    def _from_model(
        self, model: ShardSet, name: str, target: GGMLQuantizationType, original: TensorRecord
    ) -> TensorRecord:
        rec = model.tensors.get(name)
        where = f"source model {model.first.path} (for {qtype_name(target)})"
        if rec is None:
            raise SourceError(f"{name}: {where} has no tensor of this name")
        if rec.shape != original.shape:
            raise SourceError(
                f"{name}: {where} has shape {list(rec.shape)}, the model {list(original.shape)}"
            )
        if int(rec.ggml_type) != int(target):
            raise SourceError(
                f"{name}: {where} holds it as {rec.ggml_type.name}, not {target.name}"
            )
        return rec

    def _requantized(
        self, name: str, target: GGMLQuantizationType, original: TensorRecord
    ) -> TensorRecord:
        alone = self.scratch / _file_name(name, "original")
        if not alone.exists():
            data = read_tensor_bytes(original)
            raw = RawTensor(name, original.ggml_type, original.ne, data)
            write_gguf(alone, n_kv=0, kv_bytes=b"", tensors=[raw])
        out = self.scratch / _file_name(name, qtype_name(target))
        try:
            requantize(alone, name, target, out=out)
        except RequantError as exc:
            raise SourceError(f"{name}: cannot requantize to {qtype_name(target)}: {exc}") from None
        return read_header(out).tensor_map()[name]
