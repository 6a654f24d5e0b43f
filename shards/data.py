"""Reading tensor data with the file identity checked before and after.

Both the agent's fingerprints and the runtime's stager read tensor bytes through here: the file is
opened, its identity compared with the record's, the bytes read with ``preadv`` straight into the
caller's buffer, and the identity compared again. A file replaced, truncated or rewritten between
planning and reading raises :class:`FileChangedError`; the caller treats the job as stale.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from ggufswap.shards.errors import FileChangedError, TruncatedError
from ggufswap.shards.records import FileIdentity, TensorRecord

READ_CHUNK: Final = 8 << 20


@contextmanager
def open_verified(record: TensorRecord) -> Iterator[int]:
    """Open ``record.path`` and yield its fd if it is still the version the record was read from."""
    try:
        fd = os.open(record.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise FileChangedError(
            record.path, f"cannot open for {record.name}: {exc.strerror}"
        ) from None
    try:
        _expect_identity(fd, record, "before reading")
        try:
            yield fd
        except TruncatedError:
            # A file shrunk while being read is a changed file (the job is stale), not damage.
            _expect_identity(fd, record, "while reading")
            raise
        _expect_identity(fd, record, "after reading")
    finally:
        os.close(fd)


def _expect_identity(fd: int, record: TensorRecord, when: str) -> None:
    found = FileIdentity.of_fd(fd)
    if found != record.identity:
        raise FileChangedError(
            record.path,
            f"{record.name}: file identity changed {when} "
            f"(expected {record.identity.as_tuple()}, found {found.as_tuple()})",
        )


def iter_chunks(fd: int, record: TensorRecord, scratch: memoryview) -> Iterator[memoryview]:
    """Yield the tensor's bytes in pieces read into ``scratch`` (each valid until the next)."""
    done = 0
    while done < record.nbytes:
        want = min(scratch.nbytes, record.nbytes - done)
        n = os.preadv(fd, [scratch[:want]], record.offset + done)
        if n == 0:
            raise TruncatedError(
                record.path,
                f"{record.name}: file ends inside the tensor data",
                pos=record.offset + done,
            )
        yield scratch[:n]
        done += n


def read_into(fd: int, record: TensorRecord, out: memoryview) -> None:
    """Fill ``out`` (exactly ``record.nbytes`` long) with the tensor's bytes from ``fd``."""
    if out.nbytes != record.nbytes:
        raise ValueError(
            f"{record.name}: buffer has {out.nbytes} bytes, the tensor has {record.nbytes}"
        )
    view = out.cast("B")
    for done in range(0, record.nbytes, READ_CHUNK):
        read_range(fd, record, done, view[done : done + READ_CHUNK])


def read_range(fd: int, record: TensorRecord, start: int, out: memoryview) -> None:
    """Fill ``out`` with the tensor's bytes ``[start, start + len(out))`` from ``fd``."""
    view = out.cast("B") if out.format != "B" else out
    if start < 0 or start + view.nbytes > record.nbytes:
        raise ValueError(
            f"{record.name}: bytes [{start}, {start + view.nbytes}) are outside the tensor's "
            f"{record.nbytes}"
        )
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], record.offset + start + done)
        if n == 0:
            raise TruncatedError(
                record.path,
                f"{record.name}: file ends inside the tensor data",
                pos=record.offset + start + done,
            )
        done += n


def read_tensor_bytes(record: TensorRecord, out: memoryview | None = None) -> memoryview:
    """Read a tensor's bytes with identity checks; into ``out`` when given."""
    buf = out if out is not None else memoryview(bytearray(record.nbytes))
    with open_verified(record) as fd:
        read_into(fd, record, buf)
    return buf


def check_readable(record: TensorRecord) -> None:
    """Raise unless ``record``'s file is present with the same identity (no data read)."""
    try:
        found = FileIdentity.of_path(record.path)
    except OSError as exc:
        raise FileChangedError(record.path, f"{record.name}: {exc.strerror}") from None
    if found != record.identity:
        raise FileChangedError(record.path, f"{record.name}: file changed since it was planned")
