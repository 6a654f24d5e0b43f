"""Crash-safe file replacement: hidden temp file beside the target, fsync, rename, fsync the dir.

A reader (or the agent's watcher) therefore sees either the old file or the complete new one,
never a partial write. Temp files are named ``.NAME.tmp-XXXXXXXX`` in the target's directory: the
same file system (so the rename is atomic), and hidden (so the agent's default ``.*`` ignore skips
them). A write that raises removes its temp file and leaves the old file untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ggufswap.logs import get_logger

log = get_logger(__name__)

TEMP_INFIX = ".tmp-"
DEFAULT_MODE = 0o644
COPY_CHUNK = 1 << 20


def temp_path_for(dst: str | os.PathLike[str]) -> Path:
    """A fresh, unused hidden temp path in the directory of ``dst`` (the file is created, empty)."""
    dst = Path(dst)
    fd, name = tempfile.mkstemp(prefix=f".{dst.name}{TEMP_INFIX}", dir=dst.parent)
    os.close(fd)
    return Path(name)


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of this module's temp files."""
    return name.startswith(".") and TEMP_INFIX in name


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _target_mode(dst: Path) -> int:
    """Keep the permission bits of the file being replaced; new files get 0644."""
    try:
        return stat.S_IMODE(os.stat(dst).st_mode)
    except FileNotFoundError:
        return DEFAULT_MODE


def atomic_replace(tmp: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """fsync ``tmp``, rename it over ``dst`` and fsync the directory; returns ``dst``.

    ``tmp`` must be in the same directory as ``dst`` (a rename across file systems is not atomic).
    """
    tmp, dst = Path(tmp), Path(dst)
    if tmp.parent.resolve() != dst.parent.resolve():
        raise ValueError(f"{tmp}: temp file must be in the directory of {dst} for an atomic rename")
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dst)
    fsync_dir(dst.parent)
    return dst


def atomic_write(path: str | os.PathLike[str], write_fn: Callable[[BinaryIO], None]) -> Path:
    """Write ``path`` through ``write_fn(file)`` into a temp file, then atomically replace ``path``.

    If ``write_fn`` raises (or the process is interrupted), the temp file is removed and the
    previous content of ``path`` is left untouched.
    """
    path = Path(path)
    mode = _target_mode(path)
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Copy ``src`` to ``dst`` atomically (restoring a saved shard is exactly this)."""
    src = Path(src)
    with open(src, "rb") as fsrc:

        def copy(fdst: BinaryIO) -> None:
            shutil.copyfileobj(fsrc, fdst, COPY_CHUNK)

        return atomic_write(dst, copy)
