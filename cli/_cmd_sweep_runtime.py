"""``ggufswap sweep-runtime``: the runtime process of ``ggufswap sweep --config``
(:mod:`ggufswap.sweep.runtime_proc`: it loads the config's model, computes or reuses the
baseline, and evaluates every committed weight version, reporting in ``status``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Final

from ggufswap._cmd_runtime import add_threads_option
from ggufswap._signals import ProcessSignals

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep-runtime",
        help="the runtime process of `ggufswap sweep --config` (evaluates every weight version)",
    )
    parser.add_argument("--config", required=True, metavar="FILE")
    parser.add_argument("--text", required=True, metavar="FILE")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")
    parser.add_argument("--ctx", type=int, required=True, metavar="N")
    parser.add_argument("--chunks", type=int, metavar="N")
    parser.add_argument("--numerics", choices=("exact", "ggml"), default="ggml")
    parser.add_argument("--verify-chunks", type=int, default=1, metavar="N")
    parser.add_argument("--ggml", default="auto", metavar="auto|mainline|ik|off|PATH")
    parser.add_argument("--baseline", metavar="MODEL", help="the KLD's reference model")
    add_threads_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Size: being reworked by issue 24; split there."""
    from ggufswap.config import ConfigError, load_config
    from ggufswap.runtime.models import Numerics
    from ggufswap.runtime.serving.daemon import open_runtime
    from ggufswap.runtime.serving.errors import EvalTextError
    from ggufswap.runtime.threads import apply_thread_policy, resolve_threads
    from ggufswap.sweep.errors import SweepLibraryError
    from ggufswap.sweep.runtime_proc import prepare, serve

    try:
        config = load_config(args.config)
        rc = config.require_runtime()
        text = Path(args.text).read_text(encoding="utf-8")
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        print(f"ggufswap sweep-runtime: {exc}", file=sys.stderr)
        return EXIT_FAILED
    apply_thread_policy(resolve_threads(flag=args.threads, config=rc.threads))
    if args.numerics == "ggml":
        from ggufswap.runtime.errors import GgmlLibraryError
        from ggufswap.runtime.kernels import ggml_select

        try:  # before the runtime loads: its products are this library's
            ggml_select(args.ggml)
        except GgmlLibraryError as exc:
            print(f"ggufswap sweep-runtime: {exc}", file=sys.stderr)
            return EXIT_FAILED
    signals = ProcessSignals().install()
    runtime = open_runtime(config)
    try:
        try:
            evaluator, baseline, base = prepare(
                runtime, text=text, out=args.out, n_ctx=args.ctx, max_chunks=args.chunks,
                numerics=Numerics(args.numerics), baseline_model=args.baseline,
                model_path=str(rc.model),
            )  # fmt: skip
        except (EvalTextError, SweepLibraryError) as exc:
            print(f"ggufswap sweep-runtime: {exc}", file=sys.stderr)
            return EXIT_FAILED
        serve(
            runtime, config, evaluator, baseline, base,
            verify_chunks=args.verify_chunks, stop=signals.stop,
        )  # fmt: skip
    finally:
        runtime.close()
    return EXIT_OK
