"""Shard commands: ``inspect`` (tensor table of a file or shard set) and ``diff`` (two models).

Their work is in ``_shards_view``, imported when one of them runs: building the parser must not
import gguf-py and numpy (every command pays for it, a runtime before its port opens)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    inspect = subparsers.add_parser(
        "inspect", help="show the tensor table and metadata of a GGUF file or shard set"
    )
    inspect.add_argument("path", help="a GGUF file, or any shard of a gguf-split set")
    inspect.add_argument("--json", action="store_true", help="print one JSON document")
    inspect.set_defaults(func=_run_inspect)

    diff = subparsers.add_parser("diff", help="tensor-level differences between two models")
    diff.add_argument("old", help="a GGUF file or any shard of a set")
    diff.add_argument("new", help="a GGUF file or any shard of a set")
    diff.add_argument("--json", action="store_true", help="print one JSON document")
    diff.add_argument(
        "--checksum",
        action="store_true",
        help="compare tensor contents by fingerprint (reads the data of moved tensors)",
    )
    diff.set_defaults(func=_run_diff)


def _run_inspect(args: argparse.Namespace) -> int:
    from ggufswap._shards_view import run_inspect

    return run_inspect(args)


def _run_diff(args: argparse.Namespace) -> int:
    from ggufswap._shards_view import run_diff

    return run_diff(args)
