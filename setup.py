"""The package map and the compiled pieces.

The map (import name -> folder) is read from pyproject.toml's ``[tool.ggufswap.packages]``, its one
place. The compiled pieces: quantized products straight from GGUF blocks
(runtime/kernels/csrc/qkernels.c), the glue that calls ggml's own kernels from a libggml found
at run time (runtime/kernels/csrc/ggmlcall.c), ggml's reference K-quant/IQ4 quantizers
(shards/csrc, used by requant, the agent-side tools and the sweep), the one-pass decoder of GGUF
string arrays (shards/csrc/strings.c: vocabularies), and the SIGBUS guard of mapped shards
(runtime/csrc). Everything else is declared in pyproject.toml.

The extensions are optional: where they cannot be built (no C compiler), the runtime decodes
blocks with its torch kernels instead (runtime/kernels/qmatmul.py says which path runs), and
shards/kquants.py quantizes with numpy (the same bytes, slower), shards/arrays.py decodes string
arrays in a few Python passes, and ``map_shards`` maps nothing
(``auto`` copies the files, ``true`` refuses, saying the guard is missing).
"""

import sys
from pathlib import Path

from setuptools import Extension, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the build requirement brings it
    import tomli as tomllib

PACKAGES: dict[str, str] = tomllib.loads(Path(__file__).with_name("pyproject.toml").read_text())[
    "tool"
]["ggufswap"]["packages"]

setup(
    package_dir=PACKAGES,
    packages=list(PACKAGES),
    ext_modules=[
        Extension(
            "ggufswap.runtime.kernels._qkernels",
            sources=["runtime/kernels/csrc/qkernels.c"],
            # No FMA contraction: decoded weights must equal gguf.quants' bit for bit.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "ggufswap.runtime.kernels._ggmlcall",
            sources=[
                "runtime/kernels/csrc/ggmlcall.c",
                "runtime/kernels/csrc/ggmlblock.c",
                "runtime/kernels/csrc/ggmlmoe.c",
                "runtime/kernels/csrc/ggmlstep.c",
            ],
            depends=[
                "runtime/kernels/csrc/ggmlcall.h",
                "runtime/kernels/csrc/ggmlblock.h",
                "runtime/kernels/csrc/rownorm.h",
                "runtime/kernels/csrc/rowrope.h",
            ],
            # Glue only: the libggml it calls is found and loaded at run time (dlopen), so the
            # build needs no ggml (runtime/kernels/_ggml.py). No FMA contraction: its norms are
            # ggml's float32 operations (rownorm.h).
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE", "-ffp-contract=off"],
            extra_link_args=["-ldl", "-pthread"],
            optional=True,
        ),
        Extension(
            # A decode step's RMS norms and RoPE in one call each (runtime/kernels/rowops.py);
            # no FMA contraction: the float32 operations of ggml's norm and of torch's rotation.
            "ggufswap.runtime.kernels._rowops",
            sources=["runtime/kernels/csrc/rowops.c"],
            depends=["runtime/kernels/csrc/rownorm.h", "runtime/kernels/csrc/rowrope.h"],
            extra_compile_args=["-O2", "-ffp-contract=off", "-fno-math-errno", "-std=c11"],
            optional=True,
        ),
        Extension(
            # The SIGBUS guard of mapped shards (runtime/mapping.py): without it, map_shards
            # cannot defend against a file truncated under its mapping, and maps nothing.
            "ggufswap.runtime._sigbus",
            sources=["runtime/csrc/sigbus.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
        Extension(
            # A GGUF string array decoded in one pass (shards/arrays.py StringArray.tolist, and a
            # SentencePiece tokenizer's look-up table); without it the same in a few Python passes.
            "ggufswap.shards._strings",
            sources=["shards/csrc/strings.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
        Extension(
            "ggufswap.shards._kquants",
            sources=["shards/csrc/kquants.c"],
            # No FMA contraction, no fast-math: ggml's float32 operations, each rounded, in order
            # (-O3 vectorizes across independent sub-blocks only; sums are never reassociated).
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ],
)
