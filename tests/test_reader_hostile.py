"""Hostile GGUF headers, one malformation per test, each with the error class and message it earns.

Files are built byte by byte (``ggufbytes``); every rejection must name the file and say what was
expected and what was found. The paired tests at the end check that valid edge cases still parse.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import ggufbytes as gb
import pytest
import reliability
from ggufbytes import KV, TI, T, V, build, kv_array, kv_str, kv_u32

from ggufswap.shards import (
    ArrayRef,
    CorruptHeaderError,
    NotGGUFError,
    ShardError,
    ShardHeader,
    TensorLayoutError,
    TruncatedError,
    UnsupportedVersionError,
    read_array,
    read_header,
)
from ggufswap.shards.reader import INLINE_ARRAY_MAX, MAX_ALIGNMENT, MAX_KEY_BYTES, MAX_NAME_BYTES

Write = Callable[..., Path]
ARCH = kv_str("general.architecture", "llama")


def rejects(path: Path, cls: type[ShardError], *fragments: str) -> ShardError:
    """Assert that reading ``path`` raises exactly ``cls`` with the path and every fragment."""
    with pytest.raises(ShardError) as info:
        read_header(path)
    err = info.value
    assert type(err) is cls, f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    message = str(err)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    test = reliability.current_test()
    reliability.record(
        "bad input",
        "hostile GGUF header: " + test.rsplit("::", 1)[-1].removeprefix("test_").replace("_", " "),
        tries=1,
        outcome=f"{cls.__name__} naming the file and expected vs found",
        test=test,
    )
    return err


def one_tensor(**kw: object) -> list[TI]:
    return [TI("w", (32, 2), **kw)]  # type: ignore[arg-type]


# --- preamble ----------------------------------------------------------------------------------


def test_bad_magic(gguf_file: Write) -> None:
    """A file that does not start with b'GGUF' is NotGGUFError naming both magics."""
    path = gguf_file(build(magic=b"GGML", kvs=[ARCH]))
    rejects(path, NotGGUFError, "expected magic b'GGUF'", "found b'GGML'")


def test_empty_file(gguf_file: Write) -> None:
    """An empty file is truncated: it says how many bytes a header needs."""
    path = gguf_file(b"")
    rejects(path, TruncatedError, "file has 0 bytes", "at least 24")


def test_shorter_than_preamble(gguf_file: Write) -> None:
    """A file ending inside the 24-byte preamble is truncated, with both sizes."""
    path = gguf_file(build(kvs=[ARCH]).data[:10])
    rejects(path, TruncatedError, "file has 10 bytes", "at least 24")


def test_short_non_gguf_file(gguf_file: Write) -> None:
    """A short file with the wrong magic is NotGGUFError rather than truncated."""
    path = gguf_file(b"PK\x03\x04 not a gguf")
    rejects(path, NotGGUFError, "missing GGUF magic")


@pytest.mark.parametrize("version", [1, 4])
def test_unsupported_version(gguf_file: Write, version: int) -> None:
    """Versions other than 2 and 3 are refused, stating the expected and found version."""
    path = gguf_file(build(version=version, kvs=[ARCH]))
    rejects(path, UnsupportedVersionError, "expected GGUF version 2 or 3", f"found {version}")


def test_big_endian_file(gguf_file: Write) -> None:
    """A big-endian file is refused with a hint that only little-endian GGUF is supported."""
    path = gguf_file(build(endian=">", kvs=[ARCH], tensors=one_tensor()))
    rejects(path, UnsupportedVersionError, "found 50331648", "big-endian")


def test_tensor_count_too_large(gguf_file: Write) -> None:
    """A tensor count that cannot fit in the file is refused before anything is allocated."""
    path = gguf_file(build(kvs=[ARCH], n_tensors=1 << 60))
    rejects(path, CorruptHeaderError, f"tensor count {1 << 60}", "bytes that remain")


def test_kv_count_too_large(gguf_file: Write) -> None:
    """A metadata count that cannot fit in the file is refused with the count."""
    path = gguf_file(build(kvs=[ARCH], n_kv=(1 << 64) - 1))
    rejects(path, CorruptHeaderError, f"metadata count {(1 << 64) - 1}", "cannot fit")


# --- metadata ----------------------------------------------------------------------------------


def test_key_length_past_eof(gguf_file: Write) -> None:
    """A key whose length runs past the end of the file is truncated, with both sizes."""
    path = gguf_file(build(kvs=[KV("general.architecture", V.STRING, "x", key_length=5000)]))
    rejects(path, TruncatedError, "metadata key #0", "declares 5000 bytes", "remain")


def test_key_length_over_limit(gguf_file: Write) -> None:
    """A key longer than the limit is corrupt, naming the length and the limit."""
    path = gguf_file(build(kvs=[KV("k", V.UINT8, 1, key_length=MAX_KEY_BYTES + 1)]))
    rejects(path, CorruptHeaderError, f"length {MAX_KEY_BYTES + 1}", f"limit of {MAX_KEY_BYTES}")


def test_empty_key(gguf_file: Write) -> None:
    """An empty metadata key is corrupt."""
    path = gguf_file(build(kvs=[ARCH, kv_u32("", 1)]))
    rejects(path, CorruptHeaderError, "metadata key #1 is empty")


def test_duplicate_key(gguf_file: Write) -> None:
    """The same key twice is corrupt and the key is named."""
    path = gguf_file(build(kvs=[ARCH, kv_u32("a.b", 1), kv_u32("a.b", 2)]))
    rejects(path, CorruptHeaderError, "duplicate metadata key 'a.b'")


def test_unknown_value_type(gguf_file: Write) -> None:
    """A value type code outside the GGUF set is corrupt, with expected range and found code."""
    path = gguf_file(build(kvs=[ARCH, KV("odd", 13, b"\0" * 8)]))
    rejects(path, CorruptHeaderError, "odd", "unknown value type 13", "expected 0-12")


def test_nested_array(gguf_file: Write) -> None:
    """An array of arrays is refused (GGUF readers do not support it)."""
    path = gguf_file(build(kvs=[ARCH, KV("nest", V.ARRAY, [], sub=V.ARRAY)]))
    rejects(path, CorruptHeaderError, "nest: nested arrays are not supported")


def test_string_array_count_too_large(gguf_file: Write) -> None:
    """A string array declaring more strings than the file could hold is refused."""
    kv = KV("tokenizer.ggml.tokens", V.ARRAY, ["a", "b"], sub=V.STRING, count=1 << 40)
    path = gguf_file(build(kvs=[ARCH, kv]))
    rejects(path, TruncatedError, f"declares {1 << 40} strings", "bytes remain")


def test_fixed_array_count_too_large(gguf_file: Write) -> None:
    """A numeric array declaring more elements than the file could hold is refused."""
    kv = KV("tokenizer.ggml.scores", V.ARRAY, [1.0], sub=V.FLOAT32, count=1 << 61)
    path = gguf_file(build(kvs=[ARCH, kv]))
    rejects(path, TruncatedError, f"declares {1 << 61} elements of 4 bytes", "bytes remain")


def test_long_string_array_element_past_eof(gguf_file: Write) -> None:
    """An on-disk string array whose last string runs past the end of the file is truncated."""
    kv = kv_array("tokenizer.ggml.tokens", V.STRING, [f"t{i}" for i in range(100)])
    built = build(kvs=[ARCH, kv])
    path = gguf_file(built.data[: built.header_end - 1])  # cut the last token's last byte
    rejects(path, TruncatedError, "tokenizer.ggml.tokens[99]", "past the end of the file")


def test_string_value_past_eof(gguf_file: Write) -> None:
    """A string value whose length runs past the end of the file is truncated."""
    path = gguf_file(build(kvs=[KV("general.name", V.STRING, "tiny", value_length=1 << 33)]))
    rejects(path, TruncatedError, "general.name", f"declares {1 << 33} bytes", "remain")


def test_invalid_utf8_key(gguf_file: Write) -> None:
    """A key that is not UTF-8 is corrupt."""
    path = gguf_file(build(kvs=[ARCH, KV(b"bad\xff\xfekey", V.UINT8, 1)]))
    rejects(path, CorruptHeaderError, "metadata key #1", "not valid UTF-8")


def test_alignment_not_power_of_two(gguf_file: Write) -> None:
    """An alignment of 48 is refused with the rule and the value."""
    path = gguf_file(build(kvs=[ARCH, kv_u32("general.alignment", 48)], alignment=48))
    rejects(path, CorruptHeaderError, "general.alignment", "power of two", "found 48")


def test_alignment_too_large(gguf_file: Write) -> None:
    """An alignment beyond the limit is refused with the limit."""
    value = MAX_ALIGNMENT * 2
    path = gguf_file(build(kvs=[ARCH, kv_u32("general.alignment", value)]))
    rejects(path, CorruptHeaderError, f"between 1 and {MAX_ALIGNMENT}", f"found {value}")


@pytest.mark.parametrize(
    ("kv", "found"),
    [
        (KV("general.alignment", V.UINT64, 32), "UINT64"),
        (kv_str("general.alignment", "32"), "STRING"),
    ],
)
def test_alignment_wrong_type(gguf_file: Write, kv: KV, found: str) -> None:
    """general.alignment must be a UINT32; another type is named in the error."""
    path = gguf_file(build(kvs=[ARCH, kv]))
    rejects(path, CorruptHeaderError, "expected a UINT32", f"found {found}")


def test_alignment_zero(gguf_file: Write) -> None:
    """An alignment of zero is refused."""
    path = gguf_file(build(kvs=[ARCH, kv_u32("general.alignment", 0)]))
    rejects(path, CorruptHeaderError, "power of two", "found 0")


# --- tensor infos ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_dims", [0, 5])
def test_bad_n_dims(gguf_file: Write, n_dims: int) -> None:
    """A tensor with 0 or more than 4 dimensions is refused with the count found."""
    ne = (32,) * n_dims if n_dims else ()
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("w", ne, n_dims=n_dims, data=bytes(64))]))
    rejects(path, TensorLayoutError, "w: n_dims must be 1..4", f"found {n_dims}")


def test_zero_dimension(gguf_file: Write) -> None:
    """A dimension of zero is refused, showing ne."""
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("w", (32, 0), data=b"")]))
    rejects(path, TensorLayoutError, "every dimension must be > 0", "ne=[32, 0]")


def test_element_count_overflow(gguf_file: Write) -> None:
    """Dimensions whose product overflows int64 are refused."""
    ne = (1 << 32, 1 << 32)
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("w", ne, data=b"")]))
    rejects(path, TensorLayoutError, "overflows int64", f"ne={list(ne)}")


def test_unknown_ggml_type(gguf_file: Write) -> None:
    """A ggml type code that does not exist (4 was Q4_2, removed) is refused with the code."""
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("w", (32,), ggml_type=4, data=b"\0" * 32)]))
    rejects(path, TensorLayoutError, "w: unknown ggml type 4")


def test_row_not_multiple_of_block(gguf_file: Write) -> None:
    """A Q8_0 row of 40 elements (block size 32) is refused with both numbers."""
    t = TI("w", (40, 2), ggml_type=T.Q8_0, data=b"\0" * 68)
    path = gguf_file(build(kvs=[ARCH], tensors=[t]))
    rejects(path, TensorLayoutError, "ne[0]=40", "Q8_0 block size 32")


def test_unaligned_tensor_offset(gguf_file: Write) -> None:
    """A data offset that is not a multiple of the alignment is refused."""
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("w", (32,), offset=8)]))
    rejects(path, TensorLayoutError, "w: data offset 8", "not a multiple of 32")


def test_tensor_past_eof(gguf_file: Write) -> None:
    """Data cut short (a copy in progress) is TruncatedError naming the tensor and both ends."""
    built = build(kvs=[ARCH], tensors=[TI("a", (32,)), TI("b", (64,))], truncate_data=16)
    path = gguf_file(built)
    end = built.tensor_offsets[1] + 256
    rejects(path, TruncatedError, f"b: data ends at byte {end}", f"file has {end - 16} bytes")


def test_overlapping_tensors(gguf_file: Write) -> None:
    """Two tensors sharing bytes are refused, naming both ranges."""
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("a", (64,)), TI("b", (32,), offset=128)]))
    rejects(path, TensorLayoutError, "b (bytes", "overlaps a (bytes")


def test_duplicate_tensor_names(gguf_file: Write) -> None:
    """The same tensor name twice is refused and named."""
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("w", (32,)), TI("w", (32,))]))
    rejects(path, TensorLayoutError, "duplicate tensor name 'w'")


def test_tensor_name_too_long(gguf_file: Write) -> None:
    """A tensor name of 64 bytes exceeds ggml's limit of 63 (GGML_MAX_NAME with its NUL)."""
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("x" * 64, (32,))]))
    rejects(path, CorruptHeaderError, "tensor #0 name", f"limit of {MAX_NAME_BYTES}")


def test_empty_tensor_name(gguf_file: Write) -> None:
    """An empty tensor name is refused."""
    path = gguf_file(build(kvs=[ARCH], tensors=[TI("", (32,), data=b"\0" * 128)]))
    rejects(path, TensorLayoutError, "tensor #0 has an empty name")


def test_tensor_info_truncated(gguf_file: Write) -> None:
    """A file ending inside the tensor infos is truncated, naming the field it was reading."""
    name = "blk.0.ffn_down_exps.weight"  # long enough that the count check passes
    built = build(kvs=[ARCH], tensors=[TI(name, (32,))])
    path = gguf_file(built.data[: built.header_end - 4])
    rejects(path, TruncatedError, f"{name}: offset", "needs 8 bytes", "ends after 4")


def test_missing_file(tmp_path: Path) -> None:
    """A path that does not exist is a ShardError naming it."""
    path = tmp_path / "absent.gguf"
    rejects(path, ShardError, "no such file")


def test_directory(tmp_path: Path) -> None:
    """A directory is not a shard."""
    rejects(tmp_path, ShardError, "not a regular file")


# --- not over-rejecting ------------------------------------------------------------------------


def parse(path: Path) -> ShardHeader:
    return read_header(path)


def test_zero_tensors_ok(gguf_file: Write) -> None:
    """A file with metadata and no tensors parses."""
    header = parse(gguf_file(build(kvs=[ARCH])))
    assert header.tensors == ()
    assert header.architecture == "llama"


def test_zero_kvs_ok(gguf_file: Write) -> None:
    """A file with tensors and no metadata parses with the default alignment."""
    header = parse(gguf_file(build(tensors=[TI("w", (32, 2))])))
    assert header.metadata == {}
    assert header.alignment == 32
    assert [t.name for t in header.tensors] == ["w"]


def test_empty_file_header_only_ok(gguf_file: Write) -> None:
    """The 24-byte preamble alone (no tensors, no metadata) is a valid, empty GGUF."""
    header = parse(gguf_file(build()))
    assert (header.tensors, dict(header.metadata)) == ((), {})


@pytest.mark.parametrize("alignment", [1, 8, MAX_ALIGNMENT])
def test_valid_alignments_ok(gguf_file: Write, alignment: int) -> None:
    """Alignments 1, 8 and the largest allowed are honoured for the data section and offsets."""
    kvs = [ARCH, kv_u32("general.alignment", alignment)]
    built = build(kvs=kvs, tensors=[TI("a", (3,)), TI("b", (5,))], alignment=alignment)
    header = parse(gguf_file(built))
    assert header.alignment == alignment
    assert header.data_offset == built.data_offset
    assert [t.offset for t in header.tensors] == list(built.tensor_offsets)


def test_four_dim_tensor_ok(gguf_file: Write) -> None:
    """A 4-D tensor parses with ne in file order and the logical shape reversed."""
    header = parse(gguf_file(build(tensors=[TI("w", (32, 3, 2, 2), ggml_type=T.Q8_0)])))
    (t,) = header.tensors
    assert t.ne == (32, 3, 2, 2)
    assert t.shape == (2, 2, 3, 32)
    assert t.nbytes == 12 * 34


def test_tensor_ending_exactly_at_eof_ok(gguf_file: Write) -> None:
    """A tensor whose last byte is the file's last byte (no trailing padding) parses."""
    built = build(tensors=[TI("w", (33,))])  # 132 bytes: padded to 160 by the builder
    data = built.data[: built.tensor_offsets[0] + 132]
    (t,) = parse(gguf_file(data)).tensors
    assert t.end == len(data)


def test_empty_string_value_ok(gguf_file: Write) -> None:
    """An empty string value is a valid value."""
    header = parse(gguf_file(build(kvs=[kv_str("general.name", "")])))
    assert header.metadata["general.name"] == ""


@pytest.mark.parametrize("sub", [V.STRING, V.INT32])
def test_empty_array_ok(gguf_file: Write, sub: V) -> None:
    """An empty array is a valid value (an empty tuple)."""
    header = parse(gguf_file(build(kvs=[kv_array("a", sub, [])])))
    assert header.metadata["a"] == ()
    assert read_array(header, "a") == []


@pytest.mark.parametrize("count", [INLINE_ARRAY_MAX, INLINE_ARRAY_MAX + 1])
@pytest.mark.parametrize("sub", [V.STRING, V.UINT16])
def test_array_inline_boundary(gguf_file: Write, count: int, sub: V) -> None:
    """Arrays of 64 elements are decoded into the header, 65 stay on disk; both read back equal."""
    values = [f"s{i}" for i in range(count)] if sub == V.STRING else list(range(count))
    header = parse(gguf_file(build(kvs=[kv_array("arr", sub, values)])))
    value = header.metadata["arr"]
    if count <= INLINE_ARRAY_MAX:
        assert value == tuple(values)
    else:
        assert isinstance(value, ArrayRef)
        assert (value.elem_type, value.count) == (sub, count)
    assert read_array(header, "arr") == values


def test_v2_file_ok(gguf_file: Write) -> None:
    """A version 2 file parses (v2 and v3 share the 64-bit layout)."""
    kvs, tensors = gb.sample_model()
    header = parse(gguf_file(build(version=2, kvs=kvs, tensors=tensors)))
    assert header.version == 2
    assert len(header.tensors) == len(tensors)


def test_all_scalar_types_ok(gguf_file: Write) -> None:
    """Every scalar value type round-trips with its value."""
    values = {
        V.UINT8: 255,
        V.INT8: -128,
        V.UINT16: 65535,
        V.INT16: -32768,
        V.UINT32: (1 << 32) - 1,
        V.INT32: -(1 << 31),
        V.FLOAT32: 0.5,
        V.BOOL: False,
        V.UINT64: (1 << 64) - 1,
        V.INT64: -(1 << 63),
        V.FLOAT64: 1e300,
    }
    kvs = [KV(f"k.{t.name}", t, v) for t, v in values.items()]
    header = parse(gguf_file(build(kvs=kvs)))
    assert {t: header.metadata[f"k.{t.name}"] for t in values} == values


def test_name_at_limit_ok(gguf_file: Write) -> None:
    """A tensor name of exactly 63 bytes is accepted."""
    (t,) = parse(gguf_file(build(tensors=[TI("n" * MAX_NAME_BYTES, (32,))]))).tensors
    assert len(t.name) == MAX_NAME_BYTES


def test_struct_layout_matches_spec() -> None:
    """The builder's preamble is magic, version u32, n_tensors u64, n_kv u64 (24 bytes)."""
    data = build(kvs=[ARCH]).data
    assert struct.unpack_from("<4sIQQ", data) == (b"GGUF", 3, 0, 1)


def test_fifo_named_like_a_shard_is_refused_without_blocking(tmp_path: Path) -> None:
    """A named pipe called *.gguf is refused at once as not a regular file (open never blocks)."""
    import concurrent.futures

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(read_header, fifo)
        try:
            exc = future.exception(timeout=5)
        except concurrent.futures.TimeoutError:
            with open(fifo, "wb"):  # unblock the reader so the test can end
                pass
            raise AssertionError("read_header blocked on a FIFO") from None
    assert isinstance(exc, ShardError)
    assert "not a regular file" in str(exc)
