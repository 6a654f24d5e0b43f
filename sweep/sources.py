"""Where a sweep round's quantized tensors come from, checked for every target before round one.

For a tensor and a target type, in this order:

1. **the user's files** (``--source TYPE=PATH``): a GGUF of the same model in that type (any shard
   of a split set), or a directory of the model's per-tensor shards in that type as the Tool
   Suite's ``quant_downloader.sh`` lays them out (:mod:`.suite_dir`). The record is planned as it
   is: nothing is written.
2. **requantization** (``shards.requantize_bytes``, the project's quantizers) for the types the
   project writes: the tensor's bytes are re-encoded into a one-tensor GGUF in the scratch
   directory (from a type gguf-py decodes; an ik-typed tensor goes to ik's quantizer when it is
   installed).
3. **ik_llama.cpp's own** ``llama-quantize`` (:mod:`.ik_quantize`) for every other type it
   writes, ik's and mainline's, when it is installed (the ``ik`` extra).

A type none of these can make is refused before the first round with one line naming how to
produce it (:meth:`TensorSources.problems`). Scratch files are per round: :meth:`release`
removes them once the round is restored, so the scratch directory never holds more than one
copy of each tensor under test. The user's model files are never written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

from gguf import GGML_QUANT_SIZES

from ggufswap.shards import (
    SUPPORTED_TARGETS,
    RequantError,
    TensorRecord,
    read_header,
    read_tensor_bytes,
    requantize_bytes,
)
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.requant import reference_tool_command
from ggufswap.shards.writer import RawTensor, write_gguf
from ggufswap.sweep.errors import SourceError
from ggufswap.sweep.ik_quantize import IkQuantizer
from ggufswap.sweep.qtypes import is_ik_type, qtype_name

SCRATCH = "scratch"
GGUF_DECODES = frozenset(int(t) for t in GGML_QUANT_SIZES)  # the types gguf-py dequantizes


class TensorSet(Protocol):
    """Files holding a model's tensors in one type: a GGUF (split) set or a shard directory."""

    @property
    def where(self) -> str: ...

    @property
    def roots(self) -> list[str]: ...

    def get(self, name: str) -> TensorRecord | None: ...


def scratch_name(name: str, target: int) -> str:
    return f"{name}.{qtype_name(target)}.gguf"


class TensorSources:
    """The record to plan for ``(tensor, target)`` (see the module docstring for the order)."""

    def __init__(
        self,
        *,
        scratch: Path,
        originals: Mapping[str, TensorRecord],
        models: Mapping[int, TensorSet] | None = None,
        ik: IkQuantizer | None = None,
    ) -> None:
        self.scratch = scratch
        self.originals = originals
        self.models = {int(t): m for t, m in (models or {}).items()}
        self.ik = ik
        scratch.mkdir(parents=True, exist_ok=True)

    @property
    def roots(self) -> list[str]:
        """The directories the runtime must allow plans to read from."""
        dirs = {str(self.scratch)}
        for tensor_set in self.models.values():
            dirs.update(tensor_set.roots)
        return sorted(dirs)

    def how(self, target: int) -> str | None:
        """How ``target`` is made (``source``, ``requant``, ``ik``), None when it cannot be."""
        if int(target) in self.models:
            return "source"
        if int(target) in {int(t) for t in SUPPORTED_TARGETS}:
            return "requant"
        if self.ik is not None and self.ik.writes(target):
            return "ik"
        return None

    def problems(self, targets: Iterable[int], example: str) -> list[str]:
        """One line per target type no source can make, naming how to produce it."""
        out = []
        for target in sorted({int(t) for t in targets}):
            if self.how(target) is not None:
                continue
            name = qtype_name(target)
            tool = reference_tool_command(example, GGMLType(target).name)
            if is_ik_type(target):
                hint = (
                    "install ik_llama.cpp's quantizer (pip install 'ggufswap[ik]') or give "
                    f"--source {name}=PATH (a GGUF of this model in {name}, or its per-tensor "
                    "shard directory)"
                )
            else:
                hint = f"give --source {name}=PATH (a GGUF of this model in {name})"
                if tool is not None:
                    hint += f", made e.g. by {tool}"
                hint += "; or install ik_llama.cpp's quantizer (pip install 'ggufswap[ik]')"
            out.append(f"{name}: the project cannot quantize to it: {hint}")
        return out

    def record(
        self, name: str, target: int, *, original: TensorRecord | None = None
    ) -> TensorRecord:
        """A file's record of ``name`` in ``target``. ``original``: where the tensor's original
        bytes are now (default: the model's record; the process sweep passes its saved copy,
        the model's shard having been rewritten since it was opened)."""
        original = original if original is not None else self.originals.get(name)
        if original is None:
            raise SourceError(f"{name}: the swept model has no such tensor")
        how = self.how(target)
        if how == "source":
            return self._from_set(self.models[int(target)], name, target, original)
        if how == "requant" and (self.ik is None or int(original.ggml_type) in GGUF_DECODES):
            return self._requantized(name, target, original)
        if how in ("requant", "ik") and self.ik is not None:
            # requant decodes with gguf-py, which reads no ik type: ik's tool requantizes those
            path = self.ik.quantize(original, target, out=self.scratch / scratch_name(name, target))
            return self._read(path, name, target, f"ik_llama.cpp's llama-quantize ({path})")
        raise SourceError(f"{name}: no source makes {qtype_name(target)}")

    def release(self, names: Iterable[str], target: int) -> None:
        """Remove the scratch files the round of ``names`` at ``target`` made."""
        for name in names:
            (self.scratch / scratch_name(name, target)).unlink(missing_ok=True)

    def _from_set(
        self, tensor_set: TensorSet, name: str, target: int, original: TensorRecord
    ) -> TensorRecord:
        rec = tensor_set.get(name)
        where = f"source {tensor_set.where} (for {qtype_name(target)})"
        if rec is None:
            raise SourceError(f"{name}: {where} has no tensor of this name")
        return _checked(rec, original, target, where)

    def _requantized(self, name: str, target: int, original: TensorRecord) -> TensorRecord:
        out = self.scratch / scratch_name(name, target)
        try:
            new_type, data = requantize_bytes(
                read_tensor_bytes(original),
                original.ggml_type,
                original.ne,
                qtype_name(target),
                where=original.path,
                tensor=name,
            )
        except RequantError as exc:
            raise SourceError(f"{name}: cannot requantize to {qtype_name(target)}: {exc}") from None
        write_gguf(
            out, n_kv=0, kv_bytes=b"", tensors=[RawTensor(name, new_type, original.ne, data)]
        )
        return self._read(out, name, target, f"requant ({out})")

    def _read(self, path: Path, name: str, target: int, where: str) -> TensorRecord:
        rec = read_header(path).tensor_map().get(name)
        if rec is None:
            raise SourceError(f"{name}: {where} wrote no tensor of this name")
        return _checked(rec, self.originals[name], target, where)


def _checked(rec: TensorRecord, original: TensorRecord, target: int, where: str) -> TensorRecord:
    if rec.shape != original.shape:
        raise SourceError(
            f"{rec.name}: {where} has shape {list(rec.shape)}, the model {list(original.shape)}"
        )
    if int(rec.ggml_type) != int(target):
        raise SourceError(
            f"{rec.name}: {where} holds it as {qtype_name(rec.ggml_type)}, not {qtype_name(target)}"
        )
    return rec


def scratch_bytes(directory: Path) -> int:
    """Bytes of the regular files under ``directory`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                continue
    return total
