"""The one compiled piece: quantized products straight from GGUF blocks (runtime/csrc).

Everything else is declared in pyproject.toml. The extension is optional: where it cannot be
built (no C compiler), the runtime decodes blocks with its torch kernels instead
(runtime/qmatmul.py says which path runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ggufswap.runtime._qkernels",
            sources=["runtime/csrc/qkernels.c"],
            # No FMA contraction: decoded weights must equal gguf.quants' bit for bit.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
