"""``ggufswap runtime --config FILE``: run the reference inference process."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ggufswap._signals import ProcessSignals
from ggufswap.config import ConfigError, load_config

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
        choices=["probe", "perplexity"],
        default="probe",
        help="probe: a fixed batch, logits digest per weight version; "
        "perplexity: evaluate a token stream, perplexity per weight version",
    )
    parser.add_argument(
        "--batch-interval", type=float, default=0.01, metavar="S", help="pause between batches"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        config.require_runtime()
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    from ggufswap.runtime import daemon  # torch is imported only by the runtime command
    from ggufswap.runtime.serve import Mode, ServeOptions

    signals = ProcessSignals().install()
    options = ServeOptions(mode=Mode(args.mode), batch_interval_s=args.batch_interval)
    return daemon.run(config, options=options, stop=signals.stop)
