"""Shard commands."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    del subparsers
