"""Content fingerprints and identity-verified tensor reads on real files."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import ggufbytes as gb
import pytest
import xxhash
from ggufbytes import TI

from ggufswap.shards import (
    FileChangedError,
    Fingerprinter,
    TensorRecord,
    check_readable,
    fingerprint,
    fingerprint_bytes,
    read_header,
    read_tensor_bytes,
)
from ggufswap.shards.data import READ_CHUNK, iter_chunks, open_verified

PAYLOAD = bytes(random.Random(7).getrandbits(8) for _ in range(4096))


def _write(path: Path, tensors: list[TI]) -> dict[str, TensorRecord]:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gb.build(tensors=tensors).data)
    os.replace(tmp, path)  # a new inode every time, as an atomic writer does
    return read_header(path).tensor_map()


def test_same_content_elsewhere_same_fingerprint(tmp_path: Path) -> None:
    """Equal bytes in another file, at another offset, under another name fingerprint equally."""
    a = _write(tmp_path / "a.gguf", [TI("w", (1024,), data=PAYLOAD)])["w"]
    b_table = _write(tmp_path / "b.gguf", [TI("pad", (100,)), TI("moved", (1024,), data=PAYLOAD)])
    b = b_table["moved"]
    assert (a.path, a.offset) != (b.path, b.offset)
    fp = Fingerprinter()
    assert fp(a) == fp(b) == fingerprint(a) == fingerprint_bytes(PAYLOAD)
    assert fp(a) == xxhash.xxh3_128_hexdigest(PAYLOAD)
    assert fp(b_table["pad"]) != fp(a)


def test_one_flipped_byte_changes_fingerprint(tmp_path: Path) -> None:
    """Flipping any single byte of a tensor changes its fingerprint."""
    flipped = bytearray(PAYLOAD)
    flipped[2049] ^= 0x01
    a = _write(tmp_path / "a.gguf", [TI("w", (1024,), data=PAYLOAD)])["w"]
    b = _write(tmp_path / "b.gguf", [TI("w", (1024,), data=bytes(flipped))])["w"]
    assert fingerprint(a) != fingerprint(b)


def test_cache_hit_does_not_reread(tmp_path: Path) -> None:
    """A second request for the same file version is served from the cache (no bytes hashed)."""
    table = _write(tmp_path / "a.gguf", [TI("w", (1024,), data=PAYLOAD), TI("v", (64,))])
    fp = Fingerprinter()
    first = fp(table["w"])
    assert fp.hashed_bytes == 4096
    assert fp(table["w"]) == first
    assert fp.hashed_bytes == 4096
    fp(table["v"])
    assert fp.hashed_bytes == 4096 + 256


def test_cache_capacity_evicts_oldest(tmp_path: Path) -> None:
    """With capacity 1, a tensor evicted by another is hashed again."""
    table = _write(tmp_path / "a.gguf", [TI("w", (1024,), data=PAYLOAD), TI("v", (64,))])
    fp = Fingerprinter(capacity=1)
    fp(table["w"])
    fp(table["v"])
    fp(table["w"])
    assert fp.hashed_bytes == 4096 + 256 + 4096


def test_new_file_version_is_hashed_again(tmp_path: Path) -> None:
    """The cache is keyed by identity: a rewritten file is hashed anew, even with equal bytes."""
    path = tmp_path / "a.gguf"
    old = _write(path, [TI("w", (1024,), data=PAYLOAD)])["w"]
    fp = Fingerprinter()
    digest = fp(old)
    new = _write(path, [TI("w", (1024,), data=PAYLOAD)])["w"]
    assert new.identity != old.identity
    assert fp(new) == digest
    assert fp.hashed_bytes == 2 * 4096


def test_multi_chunk_tensor(tmp_path: Path) -> None:
    """A tensor larger than one read chunk fingerprints and reads back exactly."""
    n = READ_CHUNK // 4 + 1024  # F32 elements: a bit over one chunk
    data = random.Random(3).randbytes(n * 4)
    record = _write(tmp_path / "big.gguf", [TI("big", (n,), data=data)])["big"]
    assert record.nbytes > READ_CHUNK
    assert Fingerprinter()(record) == fingerprint_bytes(data)
    assert bytes(read_tensor_bytes(record)) == data


def test_read_tensor_bytes_into_buffer(tmp_path: Path) -> None:
    """read_tensor_bytes fills a caller's buffer of the right size and refuses a wrong one."""
    record = _write(tmp_path / "a.gguf", [TI("w", (1024,), data=PAYLOAD)])["w"]
    out = memoryview(bytearray(record.nbytes))
    assert read_tensor_bytes(record, out) is out
    assert bytes(out) == PAYLOAD
    with pytest.raises(ValueError, match="buffer has 10 bytes, the tensor has 4096"):
        read_tensor_bytes(record, memoryview(bytearray(10)))


def test_replaced_file_fails_reads(tmp_path: Path) -> None:
    """A file replaced between planning and reading is FileChangedError for data and fingerprint."""
    path = tmp_path / "a.gguf"
    planned = _write(path, [TI("w", (1024,), data=PAYLOAD)])["w"]
    _write(path, [TI("w", (1024,), data=PAYLOAD[::-1])])
    with pytest.raises(FileChangedError, match="w: file identity changed before reading"):
        read_tensor_bytes(planned)
    with pytest.raises(FileChangedError, match="w: file identity changed"):
        Fingerprinter()(planned)
    with pytest.raises(FileChangedError, match="changed since it was planned"):
        check_readable(planned)


def test_truncated_in_place_fails_reads(tmp_path: Path) -> None:
    """A file truncated in place (same inode, new size) is FileChangedError, never short data."""
    path = tmp_path / "a.gguf"
    planned = _write(path, [TI("w", (1024,), data=PAYLOAD)])["w"]
    os.truncate(path, planned.offset + 100)
    with pytest.raises(FileChangedError):
        read_tensor_bytes(planned)
    with pytest.raises(FileChangedError):
        fingerprint(planned)


def test_removed_file_fails_reads(tmp_path: Path) -> None:
    """A removed file is FileChangedError naming the tensor."""
    path = tmp_path / "a.gguf"
    planned = _write(path, [TI("w", (1024,), data=PAYLOAD)])["w"]
    path.unlink()
    for fn in (read_tensor_bytes, Fingerprinter(), check_readable):
        with pytest.raises(FileChangedError, match="w"):
            fn(planned)


def test_unchanged_file_is_readable(tmp_path: Path) -> None:
    """check_readable passes for the planned version (no over-rejection)."""
    record = _write(tmp_path / "a.gguf", [TI("w", (1024,), data=PAYLOAD)])["w"]
    check_readable(record)


def test_concurrent_fingerprints_agree(tmp_path: Path) -> None:
    """Threads fingerprinting the same tensors through one Fingerprinter get the same digests."""
    table = _write(tmp_path / "a.gguf", [TI(f"t{i}", (256,)) for i in range(8)])
    fp = Fingerprinter()
    expected = {name: fingerprint(r) for name, r in table.items()}
    results: list[dict[str, str]] = []
    lock = threading.Lock()

    def work() -> None:
        got = {name: fp(r) for name, r in table.items()}
        with lock:
            results.append(got)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    assert results == [expected] * 4


def test_truncated_while_reading_is_file_changed(tmp_path: Path) -> None:
    """A file truncated between two chunks of a read is FileChangedError, not TruncatedError."""
    path = tmp_path / "a.gguf"
    record = _write(path, [TI("w", (1024,), data=PAYLOAD)])["w"]
    scratch = memoryview(bytearray(1024))
    with pytest.raises(FileChangedError, match="w: file identity changed while reading"):  # noqa: PT012
        with open_verified(record) as fd:
            pieces = iter_chunks(fd, record, scratch)
            assert bytes(next(pieces)) == PAYLOAD[:1024]
            os.truncate(path, record.offset + 1024)
            for _ in pieces:
                pass
