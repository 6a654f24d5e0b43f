"""``ggufswap make-model`` (write a small test/demo GGUF model) and ``ggufswap requant``.

The writer is imported when a command runs, not when the parser is built, so that other
commands never pay for numpy and gguf-py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
PRESETS = (
    "tiny-dense",
    "tiny-moe",
    "demo-moe",
    "tiny-deepseek2",
    "tiny-glm4moe",
    "tiny-llama3",
    "tiny-gpt-oss",
    "tiny-qwen3vlmoe",
    "tiny-minimax-m2",
    "tiny-llama4",
    "tiny-gemma4",
    "tiny-dots1",
    "tiny-qwen35",
    "tiny-qwen35moe",
    "tiny-qwen3next",
    "tiny-deepseek2-ik",
    "tiny-deepseek32",
    "tiny-glm-dsa",
)
ARCHES = (
    "llama",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
    "gemma3",
    "deepseek2",
    "glm4moe",
    "gpt-oss",
    "qwen3vlmoe",
    "minimax-m2",
    "llama4",
    "gemma4",
    "dots1",
    "qwen35",
    "qwen35moe",
    "qwen3next",
    "deepseek32",
    "glm-dsa",
)  # shards.keys.Arch values
# Architectures whose tiny model is a preset of its own (the default --preset for --arch).
ARCH_PRESETS = {
    "deepseek2": "tiny-deepseek2",
    "glm4moe": "tiny-glm4moe",
    "gpt-oss": "tiny-gpt-oss",
    "qwen3vlmoe": "tiny-qwen3vlmoe",
    "minimax-m2": "tiny-minimax-m2",
    "llama4": "tiny-llama4",
    "gemma4": "tiny-gemma4",
    "dots1": "tiny-dots1",
    "qwen35": "tiny-qwen35",
    "qwen35moe": "tiny-qwen35moe",
    "qwen3next": "tiny-qwen3next",
    "deepseek32": "tiny-deepseek32",
    "glm-dsa": "tiny-glm-dsa",
}
MOE_ONLY_ARCHES = ("qwen2moe", "qwen3moe")  # default preset tiny-moe (qwen2moe: shared expert)
LAYOUTS = ("single", "split", "per-tensor")  # ggufswap.shards.writer.Layout values


def register(subparsers: Any) -> None:
    _register_make_model(subparsers)
    _register_requant(subparsers)


def _register_make_model(subparsers: Any) -> None:
    make = subparsers.add_parser(
        "make-model",
        help="write a small deterministic GGUF model (tests, demo)",
        description=(
            "Write a small GGUF model with seeded weights that llama.cpp loads as the "
            "architecture it names (options llama.cpp would refuse, such as a shared expert for "
            "qwen3moe or a tied output for qwen2moe, are refused with the reason); prints the "
            "written files, the file to load first. Same options, byte-identical files."
        ),
    )
    make.add_argument("out_dir", metavar="OUT_DIR")
    make.add_argument(
        "--preset",
        choices=PRESETS,
        help=(
            "base model (default: tiny-moe for qwen2moe/qwen3moe, tiny-ARCH for "
            f"{', '.join(ARCH_PRESETS)}, else tiny-dense; tiny-deepseek2-ik: ik_llama.cpp's "
            "three-tensor deepseek2 form)"
        ),
    )
    make.add_argument("--arch", choices=ARCHES)
    make.add_argument("--layers", type=int, metavar="N", help="number of blocks")
    make.add_argument("--experts", type=int, metavar="N", help="experts per MoE block (0: dense)")
    make.add_argument("--experts-used", type=int, metavar="N", help="experts used per token")
    make.add_argument(
        "--shared-expert", action="store_true", help="add ffn_*_shexp tensors (qwen2moe: always)"
    )
    make.add_argument("--tied-output", action="store_true", help="no output.weight")
    make.add_argument("--layout", choices=LAYOUTS, default="single")
    make.add_argument("--max-tensors-per-shard", type=int, metavar="N", help="for --layout split")
    make.add_argument(
        "--type",
        dest="types",
        action="append",
        default=[],
        metavar="ROLE=TYPE",
        help="GGML type of a tensor role, e.g. ffn_up_exps=q4_k (repeatable)",
    )
    make.add_argument("--vocab-strings", type=int, metavar="N", help="extra tokenizer strings")
    make.add_argument("--seed", type=int)
    make.add_argument("--name", help="model name (file name stem)")
    make.set_defaults(func=run_make_model)


def _register_requant(subparsers: Any) -> None:
    requant = subparsers.add_parser(
        "requant",
        help="re-encode one tensor of a shard to another GGML type",
        description=(
            "Dequantize TENSOR and quantize it to TYPE; every other tensor and metadata key stays "
            "byte-identical. Replaces SHARD atomically unless --out is given. TYPE is one of "
            "f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0 (gguf-py's quantizers) or q2_k, q3_k, "
            "q4_k, q5_k, q6_k, iq4_nl, iq4_xs (ggml's reference quantizers, the bytes "
            "llama-quantize writes without --imatrix). Any other type (IQ1/IQ2/IQ3, TQ, MXFP4, "
            "ik_llama.cpp's IQ*_K...) is refused with the llama-quantize command that writes it."
        ),
    )
    requant.add_argument("shard", metavar="SHARD")
    requant.add_argument("tensor", metavar="TENSOR")
    requant.add_argument("type", metavar="TYPE", help="target type, e.g. q4_k, q8_0, iq4_xs, f16")
    requant.add_argument("--out", metavar="PATH", help="write here instead of replacing SHARD")
    requant.set_defaults(func=run_requant)


def _error(command: str, message: str) -> None:
    print(f"ggufswap {command}: error: {message}", file=sys.stderr)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from ggufswap.shards.writer import Arch, parse_role, parse_type

    out: dict[str, Any] = {}
    if args.arch is not None:
        out["arch"] = Arch(args.arch)
        if args.arch == Arch.QWEN2MOE.value:
            out["shared_expert"] = True  # llama.cpp's qwen2moe requires it
    if args.layers is not None:
        out["n_layers"] = args.layers
    if args.experts is not None:
        out["n_expert"] = args.experts
        if args.experts_used is None:
            out["n_expert_used"] = min(2, args.experts)
    if args.experts_used is not None:
        out["n_expert_used"] = args.experts_used
    if args.shared_expert:
        out["shared_expert"] = True
    if args.tied_output:
        out["tied_output"] = True
    if args.vocab_strings is not None:
        out["extra_vocab_strings"] = args.vocab_strings
    if args.seed is not None:
        out["seed"] = args.seed
    if args.name is not None:
        out["name"] = args.name
    types = {}
    for item in args.types:
        role, sep, type_name = item.partition("=")
        if not sep:
            raise ValueError(f"--type expects ROLE=TYPE, found {item!r}")
        types[parse_role(role)] = parse_type(type_name)
    if types:
        out["types"] = types
    return out


def run_make_model(args: argparse.Namespace) -> int:
    from ggufswap.shards import presets
    from ggufswap.shards.writer import Layout, write_model

    preset = args.preset or ("tiny-moe" if args.arch in MOE_ONLY_ARCHES else "tiny-dense")
    if args.preset is None and args.arch in ARCH_PRESETS:
        preset = ARCH_PRESETS[args.arch]
    try:
        # each preset is the function of its name in shards.presets (tiny-gpt-oss: tiny_gpt_oss)
        spec = getattr(presets, preset.replace("-", "_"))(**_overrides(args))
        paths = write_model(
            spec,
            args.out_dir,
            layout=Layout(args.layout),
            max_tensors_per_shard=args.max_tensors_per_shard,
        )
    except ValueError as exc:
        _error("make-model", str(exc))
        return EXIT_USAGE
    except OSError as exc:
        _error("make-model", f"{exc.filename or args.out_dir}: {exc.strerror or exc}")
        return EXIT_FAILURE
    for path in paths:
        print(path)
    return EXIT_OK


def run_requant(args: argparse.Namespace) -> int:
    from ggufswap.shards import read_header
    from ggufswap.shards.errors import ShardError
    from ggufswap.shards.requant import requantize

    try:
        before = read_header(args.shard).tensor_map().get(args.tensor)
        path = requantize(args.shard, args.tensor, args.type, out=args.out)
        after = read_header(path).tensor_map()[args.tensor]
    except ShardError as exc:
        _error("requant", str(exc))
        return EXIT_FAILURE
    except OSError as exc:
        _error("requant", f"{exc.filename or args.shard}: {exc.strerror or exc}")
        return EXIT_FAILURE
    if before is not None:  # "blk.3.attn_q.weight: Q5_0 → Q8_0, 450,560 → 696,320 bytes"
        print(
            f"{args.tensor}: {before.ggml_type.name} → {after.ggml_type.name}, "
            f"{before.nbytes:,} → {after.nbytes:,} bytes"
        )
    print(path)
    return EXIT_OK
