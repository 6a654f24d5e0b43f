"""The ``ggufswap`` command: one console script, one subcommand per job.

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` as the handler. Only this function turns results into exit codes.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ggufswap import __version__
from ggufswap._logsetup import configure_logging

# Command modules. Each imports torch (and the runtime) only inside its handler, so building
# the parser, and commands such as ``ggufswap status``, never pay for torch (tests/test_layout.py).
COMMAND_MODULES = (
    "ggufswap._cmd_shards",
    "ggufswap._cmd_config",
    "ggufswap._cmd_install",
    "ggufswap._cmd_make",
    "ggufswap._cmd_runtime",
    "ggufswap._cmd_status",
    "ggufswap._cmd_demo",
    "ggufswap._cmd_agent",
    "ggufswap._cmd_perplexity",
    "ggufswap._cmd_sweep",
    "ggufswap._cmd_split",
    "ggufswap._cmd_sweep_runtime",
)

# Modules of the ``runtime`` extra: a command that needs one says which extra to install.
RUNTIME_EXTRA_MODULES = frozenset({"torch", "tokenizers", "tqdm"})

LOG_LEVELS = ("debug", "info", "warning", "error")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_SIGINT = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ggufswap", description="Live per-tensor hot-swap of GGUF weights."
    )
    parser.add_argument("--version", action="version", version=f"ggufswap {__version__}")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    # `ggufswap runtime --config X --log-level debug` works as well as before the command; a
    # subcommand's value (SUPPRESS: only when given) wins over the global one.
    for command in subparsers.choices.values():
        command.add_argument(
            "--log-level",
            choices=LOG_LEVELS,
            default=argparse.SUPPRESS,
            help="debug, info (default), warning or error; also accepted before the command",
        )
    return parser


# Idle OpenMP workers sleep instead of spinning: the runtime holds two OpenMP runtimes (torch's,
# and the one ik's libggml brings for its kernels), and workers of one spinning on a few cores
# starve the other's (a 2-thread decode step of Gemma 3 270M: 3.3 s spinning, 0.16 s passive, on
# the 2-core host; docs/operations.md, "ggml's kernels"). Read by each runtime as it loads, before
# any command imports torch; an explicit OMP_WAIT_POLICY in the environment wins.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Garbage collection is paused while the command line is read, and for a
    command that asks (``gc_paused_until_ready``: the runtime, until it is ready) while it
    starts: a start allocates much and frees little, so collections are wasted work."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _main(argv, collecting=collecting)
    finally:
        if collecting:
            gc.enable()


def _main(argv: Sequence[str] | None, *, collecting: bool) -> int:
    for key, value in OPENMP_ENV.items():
        os.environ.setdefault(key, value)
    parser = build_parser()
    args = parser.parse_args(argv)
    if collecting and not getattr(args, "gc_paused_until_ready", False):
        gc.enable()
    configure_logging(level=args.log_level)
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        return EXIT_SIGINT
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in RUNTIME_EXTRA_MODULES:
            raise
        print(
            f"ggufswap {args.command}: needs the 'runtime' extra ({exc.name} is not installed): "
            f"{Path(sys.executable).parent / 'pip'} install 'ggufswap[runtime]' (from a "
            "checkout: pip install '.[runtime]'; see docs/operations.md, Install)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except BrokenPipeError:  # `ggufswap inspect big.gguf | head`
        sys.stderr.close()
        return EXIT_OK
    return result


if __name__ == "__main__":
    raise SystemExit(main())
