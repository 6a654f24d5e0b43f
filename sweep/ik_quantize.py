"""ik_llama.cpp's own ``llama-quantize`` run on the tensor under test.

The quantizer ships prebuilt in the ``ik-llama-cpp-python`` wheel (MIT; the ``ik`` extra:
``pip install 'ggufswap[ik]'``), or is given by path (``GGUFSWAP_IK_QUANTIZE``). It writes every
ik_llama.cpp type (``iq4_k``, ``iq4_ks``, ``iq2_kt``, ``q6_0``, the ``_r4``/``_r8`` variants...)
and the mainline types the project's own quantizers do not.

The tool quantizes whole models, applying a base type to every tensor it is not told about, so
it is given a model of one tensor: the swept model's metadata (``split.*`` dropped) and only the
tensor under test, in its type in the model, with the rule ``--custom-q 'NAME=TYPE'`` and
``--allow-requantize`` (``--imatrix FILE`` when the sweep has one; not ``--pure``, which makes
the tool ignore ``--custom-q``). The tool checks that a model has one ``attn_v`` per block, so
the model of one tensor has one block (``--override-kv ARCH.block_count=int:1``) and the tensor
is named as block 0's (``blk.17.attn_v.weight`` goes in as ``blk.0.attn_v.weight``; its name is
put back in the output). The tool's choices depend on the tensor's kind (the name's suffix), not
on its block. Its output's one tensor is the round's tensor. A
tensor the tool declines to quantize (it keeps 1-D tensors and norms in float) comes back in
another type and the round is refused, naming it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Final

from ggufswap.shards import TensorRecord, read_header, read_tensor_bytes
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType
from ggufswap.shards.resplit import kv_entries
from ggufswap.shards.writer import RawTensor, write_gguf
from ggufswap.sweep.errors import SourceError
from ggufswap.sweep.qtypes import NOT_STORAGE, qtype_name

ENV_BINARY: Final = "GGUFSWAP_IK_QUANTIZE"
PACKAGE: Final = "ik_llama_cpp"
TIMEOUT_S: Final = 3600.0
ARCH_KEY: Final = "general.architecture"
_BASE_FTYPE: Final = "Q8_0"
BLOCK: Final = re.compile(
    r"^blk\.\d+\."
)  # the tool's positional type; --custom-q decides the one tensor
# Types the tool does not write as a tensor: matmul intermediates, newer mainline formats.
_NOT_WRITTEN: Final = frozenset({GGMLType.Q8_K, GGMLType.Q8_K_R8, GGMLType.NVFP4, GGMLType.Q1_0})


def find_binary() -> Path | None:
    """``GGUFSWAP_IK_QUANTIZE``, else the ``ik-llama-cpp-python`` wheel's ``bin/llama-quantize``."""
    given = os.environ.get(ENV_BINARY)
    if given:
        return Path(given)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "llama-quantize"
    return candidate if candidate.is_file() else None


class IkQuantizer:
    """Quantizes one tensor of a model with ik_llama.cpp's ``llama-quantize``."""

    def __init__(
        self, binary: Path, *, metadata_shard: str, work: Path, imatrix: Path | None = None
    ) -> None:
        self.binary = binary
        self.metadata_shard = metadata_shard
        self.work = work
        self.imatrix = imatrix

    @classmethod
    def find(
        cls, *, metadata_shard: str, work: Path, imatrix: Path | None = None
    ) -> IkQuantizer | None:
        binary = find_binary()
        if binary is None:
            return None
        return cls(binary, metadata_shard=metadata_shard, work=work, imatrix=imatrix)

    def writes(self, target: int) -> bool:
        member = GGMLType(int(target))
        return member in LAYOUTS and member not in NOT_STORAGE and member not in _NOT_WRITTEN

    def _executable(self) -> Path:
        """The binary, made executable (a wheel installs it without the bit: a copy gets it)."""
        if os.access(self.binary, os.X_OK):
            return self.binary
        copy = self.work / ".ik-llama-quantize"
        if not copy.exists():
            self.work.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.binary, copy)
            copy.chmod(copy.stat().st_mode | stat.S_IXUSR)
        return copy

    def quantize(self, original: TensorRecord, target: int, *, out: Path) -> Path:
        """Write ``out``: a one-tensor GGUF holding ``original`` quantized to ``target``."""
        name = original.name
        inside = BLOCK.sub("blk.0.", name)  # the model of one tensor has one block
        self.work.mkdir(parents=True, exist_ok=True)
        alone = self.work / f".{name}.ik-input.gguf"
        header = read_header(self.metadata_shard)
        kv = [raw for key, raw in kv_entries(header.path, header.data_offset)
              if not key.startswith("split.")]  # fmt: skip
        raw = RawTensor(inside, original.ggml_type, original.ne, read_tensor_bytes(original))
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            write_gguf(alone, n_kv=len(kv), kv_bytes=b"".join(kv), tensors=[raw])
            arch = str(header.metadata.get(ARCH_KEY, ""))
            cmd = [str(self._executable()), "--allow-requantize"]
            if arch:
                cmd += ["--override-kv", f"{arch}.block_count=int:1"]
            if self.imatrix is not None:
                cmd += ["--imatrix", str(self.imatrix)]
            cmd += ["--custom-q", f"{_escape(inside)}={qtype_name(target)}"]
            cmd += [str(alone), str(tmp), _BASE_FTYPE, "1"]
            try:
                run = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
                )
            except OSError as exc:
                raise SourceError(f"{name}: cannot run {self.binary}: {exc}") from None
            if run.returncode != 0 or not tmp.exists():
                tail = "\n".join((run.stderr + run.stdout).strip().splitlines()[-5:])
                raise SourceError(
                    f"{name}: ik_llama.cpp's llama-quantize could not make "
                    f"{qtype_name(target)} (exit {run.returncode}): {tail}"
                )
            got = read_header(tmp).tensor_map().get(inside)
            if got is None or int(got.ggml_type) != int(target):
                kept = qtype_name(got.ggml_type) if got is not None else "nothing"
                raise SourceError(
                    f"{name}: ik_llama.cpp's llama-quantize wrote {kept}, not "
                    f"{qtype_name(target)} (it keeps some tensors in float)"
                )
            data = read_tensor_bytes(got)
            write_gguf(
                out, n_kv=0, kv_bytes=b"", tensors=[RawTensor(name, got.ggml_type, got.ne, data)]
            )
            return out
        finally:
            alone.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)


def _escape(name: str) -> str:
    return name.replace(".", r"\.")
