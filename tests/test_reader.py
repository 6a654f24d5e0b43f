"""The pread header reader agrees with gguf-py's GGUFReader, and survives mutated headers.

Agreement runs over models written by the project's writer (every writable GGML type, all three
layouts). The fuzz tests mutate valid headers (byte flips, truncations, insertions, extreme u64
values at every count, length, dimension and offset) and require that ``read_header`` only ever
raises ``ShardError``, returns quickly, and allocates no more than the file could justify.
"""

from __future__ import annotations

import os
import tempfile
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import fuzz_budget
import ggufbytes as gb
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufswap.shards import (
    ArrayRef,
    FileChangedError,
    ShardError,
    read_array,
    read_header,
    value_types,
)
from ggufswap.shards.arrays import StringArray, scalars
from ggufswap.shards.keys import TensorNames
from ggufswap.shards.reader import read_array_bytes
from ggufswap.shards.writer import WRITABLE_TYPES, Layout, ModelSpec, Role, write_model

FUZZ_EXAMPLES = fuzz_budget.examples(300)
ALLOC_SLACK = 4 << 20  # bytes a parse may allocate beyond the file size

# A model whose roles use every writable type: a qwen2moe (routed and shared experts, the most
# roles of any architecture llama.cpp accepts from the writer) with its routers quantized too,
# 256-wide so that K-quant rows fill whole blocks; the norms are the F32 tensors.
_ROLES = (
    Role.TOKEN_EMBD,
    Role.ATTN_Q,
    Role.ATTN_K,
    Role.ATTN_V,
    Role.ATTN_O,
    Role.FFN_GATE_INP,
    Role.FFN_GATE_INP_SHEXP,
    Role.FFN_GATE_EXPS,
    Role.FFN_UP_EXPS,
    Role.FFN_DOWN_EXPS,
    Role.FFN_GATE_SHEXP,
    Role.FFN_UP_SHEXP,
    Role.FFN_DOWN_SHEXP,
    Role.OUTPUT,
    Role.FFN_NORM,  # one more role than the matrices offer (MXFP4 made 15 non-F32 types)
)
_NON_F32 = [t for t in WRITABLE_TYPES if t.name != "F32"]
ALL_TYPES_SPEC = ModelSpec(
    arch="qwen2moe",
    name="alltypes",
    n_layers=2,
    n_embd=256,
    n_head=4,
    n_head_kv=2,
    n_ff=256,
    n_vocab=300,  # > 64 tokens: the vocabulary stays on disk as an ArrayRef
    n_expert=2,
    n_expert_used=1,
    n_ff_expert=256,
    shared_expert=True,
    n_ff_shexp=256,
    types={role: _NON_F32[i % len(_NON_F32)] for i, role in enumerate(_ROLES)},
)


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[Layout, list[Path]]:
    root = tmp_path_factory.mktemp("alltypes")
    return {
        layout: write_model(ALL_TYPES_SPEC, root / layout.value, layout=layout) for layout in Layout
    }


def _reference(path: Path) -> GGUFReader:
    return GGUFReader(path, "r")


def test_value_types_are_gguf_pys() -> None:
    """The project's own GGUFValueType (the reader's, which imports no gguf-py) has gguf-py's
    names and codes, member for member."""
    ours = {t.name: t.value for t in value_types.GGUFValueType}
    assert ours == {t.name: t.value for t in GGUFValueType}


# What follows a tensor's base name in TensorNames' templates.
TENSOR_SUFFIXES = ("weight", "bias", "scale", "{}", "{}.weight", "")


def test_tensor_names_are_gguf_pys() -> None:
    """Every TensorNames template (literal, so that reading a file imports no gguf-py) is one of
    gguf-py's TENSOR_NAMES followed by a weight/bias/scale suffix."""
    from gguf.constants import TENSOR_NAMES

    bases = {name.replace("{bid}", "{}") for name in TENSOR_NAMES.values()}
    templates = {k: v for k, v in vars(TensorNames).items() if not k.startswith("_")}
    assert len(templates) > 60, "the class's attributes are its templates"
    unknown = [
        f"{attr} = {name!r}"
        for attr, name in templates.items()
        if not any(
            name == base + ("." + suffix if suffix else "")
            for base in bases
            for suffix in TENSOR_SUFFIXES
        )
    ]
    assert not unknown, f"not gguf-py's tensor names: {unknown}"


def test_every_writable_type_is_covered(model_files: dict[Layout, list[Path]]) -> None:
    """The agreement model really contains a tensor of every type the writer can produce."""
    (path,) = model_files[Layout.SINGLE]
    found = {t.ggml_type for t in read_header(path).tensors}
    assert found == set(WRITABLE_TYPES)


@pytest.mark.parametrize("layout", list(Layout))
def test_tensor_table_agrees_with_gguf_reader(
    model_files: dict[Layout, list[Path]], layout: Layout
) -> None:
    """Names, types, ne, absolute offsets and byte sizes equal GGUFReader's in every file."""
    for path in model_files[layout]:
        ours = read_header(path)
        ref = _reference(path)
        assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
        for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
            assert mine.ggml_type == theirs.tensor_type, mine.name
            assert mine.ne == tuple(int(d) for d in theirs.shape), mine.name
            assert mine.offset == theirs.data_offset, mine.name
            assert mine.nbytes == theirs.n_bytes, mine.name
            assert mine.n_elements == theirs.n_elements, mine.name
        assert ours.alignment == ref.alignment
        assert ours.data_offset == ref.data_offset


@pytest.mark.parametrize("layout", list(Layout))
def test_metadata_agrees_with_gguf_reader(
    model_files: dict[Layout, list[Path]], layout: Layout
) -> None:
    """Every metadata key and value (scalars, strings, inline and on-disk arrays) matches."""
    for path in model_files[layout]:
        ours = read_header(path)
        ref = _reference(path)
        ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(ours.metadata) == ref_keys
        for key in ref_keys:
            field = ref.fields[key]
            expected = field.contents()
            value = ours.metadata[key]
            if field.types[0] == GGUFValueType.ARRAY:
                assert read_array(ours, key) == list(expected), key
            else:
                assert value == expected, key


def test_tokens_array_equals_gguf_reader(model_files: dict[Layout, list[Path]]) -> None:
    """read_array of the on-disk vocabulary equals GGUFReader's decoded tokens."""
    path = model_files[Layout.SPLIT][0]
    header = read_header(path)
    ref = _reference(path).fields["tokenizer.ggml.tokens"].contents()
    assert isinstance(header.metadata["tokenizer.ggml.tokens"], ArrayRef)
    tokens = read_array(header, "tokenizer.ggml.tokens")
    assert tokens == ref
    assert len(tokens) == ALL_TYPES_SPEC.n_vocab


def test_arrays_decoded_from_their_stored_bytes_equal_read_array(
    model_files: dict[Layout, list[Path]],
) -> None:
    """StringArray (strings decoded on look-up: indexes, negative indexes, slices, iteration)
    and scalars() over read_array_bytes give what read_array gives, for every on-disk array."""
    header = read_header(model_files[Layout.SINGLE][0])
    on_disk = [k for k, v in header.metadata.items() if isinstance(v, ArrayRef)]
    assert "tokenizer.ggml.tokens" in on_disk
    for key in on_disk:
        ref = header.metadata[key]
        assert isinstance(ref, ArrayRef)
        expected = read_array(header, key)
        stored = read_array_bytes(header, key)
        if ref.elem_type == GGUFValueType.STRING:
            strings = StringArray(stored, ref.count)
            assert list(strings) == expected, key
            assert [strings[i] for i in range(len(strings))] == expected, key
            assert strings[-1] == expected[-1]
            assert strings[3:9:2] == expected[3:9:2]
            with pytest.raises(IndexError):
                strings[ref.count]
        else:
            assert scalars(ref.elem_type, stored) == expected, key


def test_a_string_array_cut_short_or_not_utf8_is_refused_or_replaced() -> None:
    """Bytes cut inside a string raise ValueError at the first look-up (never a wrong string);
    invalid UTF-8 decodes with U+FFFD, as read_array does."""
    stored = b"".join(len(s).to_bytes(8, "little") + s for s in [b"ab", b"\xff\xfe", b"cde"])
    assert list(StringArray(stored, 3)) == ["ab", "\ufffd\ufffd", "cde"]
    assert StringArray(stored, 3)[2] == "cde"
    for cut in (len(stored) - 1, len(stored) - 6):
        with pytest.raises(ValueError, match="past their array"):
            StringArray(stored[:cut], 3)[0]


def _stored(strings: list[bytes]) -> bytes:
    return b"".join(len(s).to_bytes(8, "little") + s for s in strings)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize(
    "strings",
    [
        [b"ab", "\u2581caf\u00e9".encode(), "\U0001f916".encode(), b"", b"ab"],
        [b"ok", b"nul\x00inside", b"bad\xff\xfe", b"cde"],
        [],
    ],
    ids=["duplicates", "nul-and-invalid", "empty"],
)
def test_a_string_array_decodes_whole_as_one_by_one(
    monkeypatch: pytest.MonkeyPatch, compiled: bool, strings: list[bytes]
) -> None:
    """tolist() and with_index() (the compiled one-pass decoder, or the Python passes where it
    is not built) give the strings one look-up each gives, U+FFFD for invalid UTF-8, a NUL kept,
    and each string's later position when it is held twice."""
    from ggufswap.shards import arrays

    if compiled and arrays._compiled_strings() is None:
        pytest.skip("the optional extension ggufswap.shards._strings is not built")
    if not compiled:
        monkeypatch.setattr(arrays, "_compiled_strings", lambda: None)
    array = StringArray(_stored(strings), len(strings))
    expected = [array[i] for i in range(len(strings))]
    assert array.tolist() == expected
    decoded, index = array.with_index()
    assert decoded == expected
    assert index == {text: i for i, text in enumerate(expected)}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_string_array_cut_short_is_refused_whole(
    monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """Decoding every string of an array cut inside its last string raises ValueError."""
    from ggufswap.shards import arrays

    if compiled and arrays._compiled_strings() is None:
        pytest.skip("the optional extension ggufswap.shards._strings is not built")
    if not compiled:
        monkeypatch.setattr(arrays, "_compiled_strings", lambda: None)
    stored = _stored([b"ab", b"cde"])
    for cut in (len(stored) - 1, len(stored) - 6):
        with pytest.raises(ValueError, match="past"):
            StringArray(stored[:cut], 2).with_index()


def test_tensor_data_agrees_with_gguf_reader(model_files: dict[Layout, list[Path]]) -> None:
    """The bytes at each record's offset are the bytes GGUFReader maps for that tensor."""
    (path,) = model_files[Layout.SINGLE]
    raw = path.read_bytes()
    for mine, theirs in zip(read_header(path).tensors, _reference(path).tensors, strict=True):
        assert raw[mine.offset : mine.end] == np.asarray(theirs.data).tobytes(), mine.name


def test_header_records_identity(model_files: dict[Layout, list[Path]]) -> None:
    """Every record carries the path and identity of the file version it came from."""
    (path,) = model_files[Layout.SINGLE]
    header = read_header(path)
    st_ = path.stat()
    assert header.identity.as_tuple() == (
        st_.st_dev,
        st_.st_ino,
        st_.st_size,
        st_.st_mtime_ns,
        st_.st_ctime_ns,
    )
    assert {t.path for t in header.tensors} == {str(path.resolve())}
    assert {t.identity for t in header.tensors} == {header.identity}


def test_read_array_after_replace_raises(tmp_path: Path) -> None:
    """read_array refuses to decode an array from a file replaced since its header was read."""
    kvs, tensors = gb.sample_model()
    path = tmp_path / "m.gguf"
    path.write_bytes(gb.build(kvs=kvs, tensors=tensors).data)
    header = read_header(path)
    other = tmp_path / "m.tmp"
    other.write_bytes(gb.build(kvs=kvs, tensors=tensors[:1]).data)
    os.replace(other, path)
    with pytest.raises(FileChangedError, match=r"tokenizer\.ggml\.tokens"):
        read_array(header, "tokenizer.ggml.tokens")


def test_read_array_of_removed_file_raises(tmp_path: Path) -> None:
    """read_array of a file deleted since its header was read is a FileChangedError, not OSError."""
    kvs, tensors = gb.sample_model()
    path = tmp_path / "m.gguf"
    path.write_bytes(gb.build(kvs=kvs, tensors=tensors).data)
    header = read_header(path)
    path.unlink()
    with pytest.raises(FileChangedError, match=r"tokenizer\.ggml\.tokens"):
        read_array(header, "tokenizer.ggml.tokens")


def test_read_array_rejects_scalar(tmp_path: Path) -> None:
    """read_array of a scalar key is a TypeError naming the key."""
    kvs, tensors = gb.sample_model()
    path = tmp_path / "m.gguf"
    path.write_bytes(gb.build(kvs=kvs, tensors=tensors).data)
    with pytest.raises(TypeError, match=r"general\.architecture"):
        read_array(read_header(path), "general.architecture")


# --- fuzz --------------------------------------------------------------------------------------

_KVS, _TENSORS = gb.sample_model(n_tensors=3, vocab=70)
BASE = gb.build(kvs=_KVS, tensors=_TENSORS)
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=timedelta(seconds=2),  # generous: a parse of this file takes about a millisecond
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
_SMALL = [0, 1, 2, 7, 8, 31, 32, 33, 63, 64, 65, len(BASE.data)]
_HUGE = [1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
INTERESTING_U64 = st.sampled_from([*_SMALL, *_HUGE])


@pytest.fixture(scope="module")
def fuzz_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ggufswap-fuzz-") as tmp:
        yield Path(tmp) / "fuzz.gguf"


def _parse_bounded(path: Path, data: bytes) -> None:
    """Parse ``data``: only ShardError may escape, and the peak allocation stays bounded."""
    path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            header = read_header(path)
        except ShardError:
            return
        for key, value in header.metadata.items():
            if isinstance(value, ArrayRef):
                read_array(header, key)
        for t in header.tensors:
            assert t.end <= len(data), t
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < len(data) + ALLOC_SLACK, f"peak allocation {peak} for {len(data)} bytes"


def test_base_file_is_valid() -> None:
    """The fuzz corpus starts from a file that parses (so mutations explore past the preamble)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "base.gguf"
        path.write_bytes(BASE.data)
        assert len(read_header(path).tensors) == len(_TENSORS)


@pytest.mark.reliability(
    "bad input",
    "GGUF header with flipped bytes (hypothesis)",
    tries=FUZZ_EXAMPLES,
    outcome="only ShardError; bounded time and memory",
)
@pytest.mark.timeout(120)
@FUZZ_SETTINGS
@given(
    flips=st.lists(
        st.tuples(st.integers(0, BASE.data_offset - 1), st.integers(1, 255)), min_size=1, max_size=8
    )
)
def test_fuzz_byte_flips(fuzz_path: Path, flips: list[tuple[int, int]]) -> None:
    """Flipped header bytes never raise anything but ShardError."""
    data = bytearray(BASE.data)
    for pos, mask in flips:
        data[pos] ^= mask
    _parse_bounded(fuzz_path, bytes(data))


@pytest.mark.reliability(
    "bad input",
    "GGUF file cut anywhere (hypothesis)",
    tries=FUZZ_EXAMPLES,
    outcome="only ShardError; bounded time and memory",
)
@pytest.mark.timeout(120)
@FUZZ_SETTINGS
@given(cut=st.integers(0, len(BASE.data)))
def test_fuzz_truncation(fuzz_path: Path, cut: int) -> None:
    """A file cut anywhere parses or raises ShardError (TruncatedError at least past the header)."""
    _parse_bounded(fuzz_path, BASE.data[:cut])


@pytest.mark.reliability(
    "bad input",
    "GGUF header with inserted bytes (hypothesis)",
    tries=FUZZ_EXAMPLES,
    outcome="only ShardError; bounded time and memory",
)
@pytest.mark.timeout(120)
@FUZZ_SETTINGS
@given(pos=st.integers(0, BASE.data_offset), blob=st.binary(min_size=1, max_size=64))
def test_fuzz_insertion(fuzz_path: Path, pos: int, blob: bytes) -> None:
    """Bytes inserted into the header never raise anything but ShardError."""
    _parse_bounded(fuzz_path, BASE.data[:pos] + blob + BASE.data[pos:])


@pytest.mark.reliability(
    "bad input",
    "GGUF count, length, dim and offset fields set to any u64 (hypothesis)",
    tries=FUZZ_EXAMPLES,
    outcome="only ShardError; bounded time and memory",
)
@pytest.mark.timeout(120)
@FUZZ_SETTINGS
@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from(BASE.u64_fields),
            st.one_of(INTERESTING_U64, st.integers(0, (1 << 64) - 1)),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_fuzz_u64_fields(fuzz_path: Path, edits: list[tuple[int, int]]) -> None:
    """Any value in any count, length, dimension or offset field only ever raises ShardError."""
    data = bytearray(BASE.data)
    for pos, value in edits:
        data[pos : pos + 8] = value.to_bytes(8, "little")
    _parse_bounded(fuzz_path, bytes(data))
