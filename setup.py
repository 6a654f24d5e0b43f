"""The compiled pieces: quantized products straight from GGUF blocks (runtime/csrc), and ggml's
reference K-quant/IQ4 quantizers (shards/csrc, used by requant, the agent-side tools and the sweep).

Everything else is declared in pyproject.toml. The extension is optional: where it cannot be
built (no C compiler), the runtime decodes blocks with its torch kernels instead
(runtime/qmatmul.py says which path runs), and shards/kquants.py quantizes with numpy (the same
bytes, slower).
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
    ]
)
