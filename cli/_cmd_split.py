"""``ggufswap split``: re-lay a model as one tensor per shard, or back into one file.

``--per-tensor`` makes a sweep (or an operator's swap) rewrite one small shard instead of the
whole model; ``--merge`` writes one file again. Tensor bytes, types and metadata are unchanged.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Final

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "split",
        help="re-lay a model as one tensor per shard (--per-tensor) or as one file (--merge)",
        description=(
            "Write MODEL (a file or any shard of a set) into OUT: with --per-tensor a directory "
            "of gguf-split shards holding one tensor each, with --merge one GGUF file. Tensor "
            "bytes, types and metadata keys are copied unchanged; prints the file to load."
        ),
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("out", metavar="OUT", help="a directory (--per-tensor) or a file (--merge)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--per-tensor", action="store_true", help="one tensor per shard")
    mode.add_argument("--merge", action="store_true", help="everything in one file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ggufswap.shards import ShardError
    from ggufswap.shards.resplit import merge_to_one, split_per_tensor

    try:
        if args.per_tensor:
            paths = split_per_tensor(args.model, args.out)
        else:
            paths = [merge_to_one(args.model, args.out)]
    except ShardError as exc:
        print(f"ggufswap split: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"ggufswap split: error: {exc.filename or args.out}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    if args.per_tensor:
        print(f"{paths[0]} (and {len(paths) - 1} more shards)" if len(paths) > 1 else paths[0])
    else:
        print(paths[0])
    return EXIT_OK
