"""The user's files of a model in one quant type, for ``--source TYPE=PATH``.

- :class:`GgufSet`: a GGUF file, or any shard of a gguf-split set (``open_shard_set``).
- :class:`ShardDir`: a directory of the model's per-tensor shards as the GGUF Tool Suite's
  ``quant_downloader.sh`` lays them out: ``<model>-<MAINTAINER>-<QTYPE>-SPECIAL_TENSOR-NNNNN-of-
  MMMMM.gguf``, one tensor a shard (the first shard holds the metadata only), and the type's map
  ``tensors.<qtype>.map`` whose lines are ``file:sha256:tensor:shape=(..):dtype=..:elements=..:
  bytes=..``. With the map, a tensor's shard is the map's file (checked against the map's dtype
  and against its own header); without one, every ``*.gguf`` in the directory is read once
  (headers only) and the tensors of the requested type are indexed. A downloader directory may
  hold several types' shards side by side: only the tensors of the source's type are taken.
  Compressed ``.gguf.zbst`` shards are not read (decompress them with ``quant_downloader.sh
  -zd``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ggufswap.shards import ShardError, TensorRecord, open_shard_set, read_header
from ggufswap.sweep.errors import SourceError
from ggufswap.sweep.qtypes import qtype_name


class GgufSet:
    """A GGUF of the model in the source type."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            self._set = open_shard_set(path)
        except ShardError as exc:
            raise SourceError(f"--source {path}: {exc}") from None
        self.where = str(self._set.first.path)
        self.roots = sorted({os.path.dirname(p) for p in self._set.paths})

    def get(self, name: str) -> TensorRecord | None:
        return self._set.tensors.get(name)


class ShardDir:
    """A directory of per-tensor shards in ``target`` (the Tool Suite's download layout)."""

    def __init__(self, path: str | os.PathLike[str], target: int) -> None:
        self.path = Path(path).resolve()
        self.target = int(target)
        self.where = f"{self.path}/"
        self.roots = [str(self.path)]
        self.map_path = self.path / f"tensors.{qtype_name(target)}.map"
        self._files = self._read_map() if self.map_path.exists() else None
        self._scanned: dict[str, TensorRecord] | None = None

    def _read_map(self) -> dict[str, tuple[str, str]]:
        """``{tensor: (file, dtype)}`` of the map; SourceError naming a malformed line."""
        files = {}
        for number, line in enumerate(self.map_path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            fields = line.split(":")
            if len(fields) < 3 or not fields[0].endswith(".gguf"):
                raise SourceError(
                    f"{self.map_path}:{number}: expected file.gguf:sha256:tensor:..., "
                    f"found {line[:80]!r}"
                )
            dtype = next((f[6:] for f in fields[3:] if f.startswith("dtype=")), "")
            files[fields[2]] = (fields[0], dtype)
        return files

    def get(self, name: str) -> TensorRecord | None:
        if self._files is None:
            return self._scan().get(name)
        entry = self._files.get(name)
        if entry is None:
            return None
        file, dtype = entry
        if dtype and dtype.lower() != qtype_name(self.target).lower():
            raise SourceError(
                f"{name}: {self.map_path} lists it as {dtype}, not {qtype_name(self.target)} "
                "(an impure download: give a directory of that type only)"
            )
        shard = self.path / file
        if not shard.exists():
            missing = f"{shard} (listed in {self.map_path}) is not in the directory"
            zbst = " (only its .zbst: decompress it)" if Path(f"{shard}.zbst").exists() else ""
            raise SourceError(f"{name}: {missing}{zbst}; download it with quant_downloader.sh")
        try:
            return read_header(shard).tensor_map().get(name)
        except ShardError as exc:
            raise SourceError(f"{name}: {exc}") from None

    def _scan(self) -> dict[str, TensorRecord]:
        if self._scanned is None:
            found: dict[str, TensorRecord] = {}
            for shard in sorted(self.path.glob("*.gguf")):
                try:
                    header = read_header(shard)
                except ShardError as exc:
                    raise SourceError(f"--source {self.path}: {exc}") from None
                for rec in header.tensors:
                    if int(rec.ggml_type) == self.target:
                        found.setdefault(rec.name, rec)
            self._scanned = found
        return self._scanned


def open_source(path: str | os.PathLike[str], target: int) -> GgufSet | ShardDir:
    """The source at ``path`` for ``target``: a shard directory or a GGUF."""
    if Path(path).is_dir():
        return ShardDir(path, target)
    if not Path(path).exists():
        raise SourceError(f"--source {qtype_name(target)}={path}: no such file or directory")
    return GgufSet(path)
