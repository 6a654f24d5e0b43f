"""``ggufswap runtime --config FILE``: run the reference inference process."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from ggufswap._signals import ProcessSignals
from ggufswap.config import AUTO_THREADS, MAX_THREADS, ConfigError, load_config, parse_threads

EXIT_CONFIG = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "runtime",
        help="run the reference runtime (load a model, serve batches, apply plans)",
        description=(
            "Load the model of the config's runtime section onto its pools, serve batches, and "
            "apply reload plans between them. SIGTERM/SIGINT shut down cleanly."
        ),
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    parser.add_argument(
        "--mode",
        choices=["probe", "perplexity", "http"],
        default="probe",
        help="probe: a fixed batch, logits digest per weight version; "
        "perplexity: evaluate a token stream, perplexity per weight version; "
        "http: serve OpenAI-style completions (docs/serving.md)",
    )
    parser.add_argument(
        "--batch-interval", type=float, default=0.01, metavar="S", help="pause between batches"
    )
    add_threads_option(parser)
    http = parser.add_argument_group("http mode")
    http.add_argument("--http-host", default="127.0.0.1", metavar="HOST", help="bind address")
    http.add_argument(
        "--http-port", type=int, default=8000, metavar="N", help="port (0: any free port)"
    )
    http.add_argument(
        "--max-batch", type=int, default=8, metavar="N", help="sequences decoded per batch"
    )
    http.add_argument(
        "--max-queue", type=int, default=64, metavar="N", help="waiting requests before 503"
    )
    http.add_argument(
        "--request-timeout", type=float, default=60.0, metavar="S", help="per-request limit"
    )
    parser.set_defaults(func=run)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's CPU thread count, overriding ``runtime.threads`` (``None``: not
    given)."""
    parser.add_argument(
        "--threads",
        type=_thread_count,
        default=None,
        metavar="N",
        help="torch CPU threads, overriding runtime.threads (default: the config's value, else "
        "one per CPU of this process's affinity; see docs/operations.md)",
    )


def _thread_count(text: str) -> int:
    count = None
    with contextlib.suppress(ValueError):
        count = parse_threads(text)
    if count is None:  # "auto" is what leaving the flag out means
        raise argparse.ArgumentTypeError(
            f"expected an integer between 1 and {MAX_THREADS}, found {text!r} "
            f"(leave --threads out for {AUTO_THREADS})"
        )
    return count


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        config.require_runtime()
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    from ggufswap.runtime.serving import daemon  # torch is imported only by the runtime command
    from ggufswap.runtime.serving.errors import ListenError
    from ggufswap.runtime.serving.serve import Mode, ServeOptions

    signals = ProcessSignals().install()
    options = ServeOptions(
        mode=Mode(args.mode),
        batch_interval_s=args.batch_interval,
        http_host=args.http_host,
        http_port=args.http_port,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
    )
    try:
        return daemon.run(config, options=options, stop=signals.stop, threads=args.threads)
    except ListenError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
