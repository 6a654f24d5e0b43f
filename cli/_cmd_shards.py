"""Shard commands."""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    del subparsers
