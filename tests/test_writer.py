"""The deterministic model writer, the atomic file helpers and the ``make-model`` command."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from processes import run_ggufswap

from ggufswap.shards.atomic import atomic_copy, atomic_replace, atomic_write, is_temp_name
from ggufswap.shards.data import read_tensor_bytes
from ggufswap.shards.presets import demo_moe, tiny_arch, tiny_dense, tiny_llama3, tiny_moe
from ggufswap.shards.reader import read_header
from ggufswap.shards.writer import (
    NORM_ROLES,
    WRITABLE_TYPES,
    Arch,
    Layout,
    ModelSpec,
    Role,
    plan_tensors,
    write_model,
    write_sparse_model,
)

SPLIT_KEYS = {"split.no", "split.count", "split.tensors.count"}
F32_ROLES = NORM_ROLES | {Role.FFN_GATE_INP, Role.FFN_GATE_INP_SHEXP}


def _fields(reader: gguf.GGUFReader) -> dict[str, object]:
    """Every metadata key of a file with its decoded value (arrays as lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensors(paths: list[Path]) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for p in paths for t in gguf.GGUFReader(p).tensors}


def _wide_spec(ggml_type: Q) -> ModelSpec:
    """A one-block qwen2moe (routed and shared experts) with rows of 256, every matrix role set
    to ``ggml_type``."""
    spec = ModelSpec(
        arch=Arch.QWEN2MOE,
        name="wide",
        n_layers=1,
        n_embd=256,
        n_head=8,
        n_head_kv=4,
        n_ff=256,
        n_vocab=64,
        n_expert=2,
        n_expert_used=1,
        n_ff_expert=256,
        n_ff_shexp=256,
        shared_expert=True,
    )
    return spec.with_types(**{r.name: ggml_type for r in Role if r not in F32_ROLES})


@pytest.mark.parametrize("ggml_type", WRITABLE_TYPES, ids=lambda t: t.name)
def test_every_writable_type_reads_back_with_sensible_values(tmp_path: Path, ggml_type: Q) -> None:
    """Each writable type gives tensors gguf-py reads and dequantizes to finite N(0, 1/sqrt(n))."""
    spec = _wide_spec(ggml_type)
    (path,) = write_model(spec, tmp_path)
    tensors = _tensors([path])
    planned = plan_tensors(spec)
    assert list(tensors) == [t.name for t in planned]
    for t in planned:
        got = tensors[t.name]
        assert got.tensor_type == t.ggml_type, t.name
        assert tuple(int(n) for n in got.shape) == t.ne, t.name
        values = gguf.quants.dequantize(got.data, got.tensor_type)
        assert np.isfinite(values).all(), t.name
        if t.role in NORM_ROLES:
            assert abs(float(values.mean()) - 1.0) < 0.1, t.name
        else:
            std, target = float(values.std()), 1.0 / np.sqrt(t.ne[0])
            assert target / 3 < std < target * 3, (t.name, std, target)
    assert {t.ggml_type for t in planned if t.role not in F32_ROLES} == {ggml_type}


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("preset", [tiny_dense, tiny_moe], ids=["llama", "qwen3moe"])
def test_layouts_hold_every_planned_tensor_with_gguf_split_keys(
    tmp_path: Path, layout: Layout, preset: object
) -> None:
    """Every layout holds each planned tensor once; split shards carry gguf-split's keys."""
    spec = preset()  # type: ignore[operator]
    paths = write_model(spec, tmp_path, layout=layout)
    planned = plan_tensors(spec)
    tensors = _tensors(paths)
    assert list(tensors) == [t.name for t in planned]
    for t in planned:
        assert tensors[t.name].tensor_type == t.ggml_type
        assert tuple(int(n) for n in tensors[t.name].shape) == t.ne
    first = _fields(gguf.GGUFReader(paths[0]))
    assert first["general.architecture"] == spec.arch_name
    assert first[f"{spec.arch_name}.block_count"] == spec.n_layers
    if layout is Layout.SINGLE:
        assert paths == [tmp_path / f"{spec.name}.gguf"]
        assert not SPLIT_KEYS & set(first)
        return
    expected_count = len(planned) if layout is Layout.PER_TENSOR else 4
    assert len(paths) == expected_count
    for i, path in enumerate(paths):
        assert path.name == f"{spec.name}-{i + 1:05d}-of-{expected_count:05d}.gguf"
        fields = _fields(gguf.GGUFReader(path))
        assert fields["split.no"] == i
        assert fields["split.count"] == expected_count
        assert fields["split.tensors.count"] == len(planned)
        if i > 0:
            assert set(fields) == SPLIT_KEYS


def test_split_respects_max_tensors_per_shard(tmp_path: Path) -> None:
    """SPLIT with max_tensors_per_shard=5 puts at most five tensors in each shard, in order."""
    spec = tiny_moe()
    paths = write_model(spec, tmp_path, layout=Layout.SPLIT, max_tensors_per_shard=5)
    counts = [len(gguf.GGUFReader(p).tensors) for p in paths]
    assert all(c == 5 for c in counts[:-1])
    assert 0 < counts[-1] <= 5
    assert sum(counts) == len(plan_tensors(spec))


def test_moe_tensors_have_llama_cpp_shapes_and_metadata(tmp_path: Path) -> None:
    """A qwen3moe model has llama.cpp's expert shapes, router, q/k norms and expert keys."""
    spec = tiny_moe()
    (path,) = write_model(spec, tmp_path)
    reader = gguf.GGUFReader(path)
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    e, f, x, hd = spec.n_embd, spec.n_ff_expert, spec.n_expert, spec.n_embd_head
    assert shapes["blk.2.ffn_gate_inp.weight"] == (e, x)
    assert shapes["blk.2.ffn_gate_exps.weight"] == (e, f, x)
    assert shapes["blk.2.ffn_up_exps.weight"] == (e, f, x)
    assert shapes["blk.2.ffn_down_exps.weight"] == (f, e, x)
    assert shapes["blk.2.attn_q_norm.weight"] == (hd,)
    assert shapes["output.weight"] == (e, spec.n_vocab)
    assert "blk.0.ffn_up.weight" not in shapes
    assert not any("shexp" in name for name in shapes)
    fields = _fields(reader)
    assert fields["qwen3moe.expert_count"] == 4
    assert fields["qwen3moe.expert_used_count"] == 2
    assert fields["qwen3moe.expert_feed_forward_length"] == f
    assert "qwen3moe.expert_shared_feed_forward_length" not in fields
    assert fields["qwen3moe.attention.head_count_kv"] == spec.n_head_kv
    assert fields["tokenizer.ggml.model"] == "llama"
    assert len(fields["tokenizer.ggml.tokens"]) == spec.n_vocab  # type: ignore[arg-type]
    assert len(fields["tokenizer.ggml.scores"]) == spec.n_vocab  # type: ignore[arg-type]


def test_qwen2moe_has_its_shared_expert_in_every_block(tmp_path: Path) -> None:
    """qwen2moe gets ffn_*_shexp and the sigmoid gate in every block, sized by its own key."""
    spec = tiny_arch("qwen2moe", n_ff_shexp=32)
    reader = gguf.GGUFReader(write_model(spec, tmp_path)[0])
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    e = spec.n_embd
    for b in range(spec.n_layers):
        assert shapes[f"blk.{b}.ffn_gate_inp_shexp.weight"] == (e,)
        assert shapes[f"blk.{b}.ffn_up_shexp.weight"] == (e, 32)
        assert shapes[f"blk.{b}.ffn_down_shexp.weight"] == (32, e)
    assert _fields(reader)["qwen2moe.expert_shared_feed_forward_length"] == 32


def test_llama_moe_is_written_in_mixtral_form(tmp_path: Path) -> None:
    """llama with experts: feed_forward_length is the per-expert width and there is no
    expert_feed_forward_length (llama.cpp sizes llama's expert tensors by feed_forward_length)."""
    spec = tiny_moe(arch="llama")
    assert spec.n_ff != spec.n_ff_expert
    reader = gguf.GGUFReader(write_model(spec, tmp_path)[0])
    fields = _fields(reader)
    assert fields["llama.feed_forward_length"] == spec.n_ff_expert
    assert "llama.expert_feed_forward_length" not in fields
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes["blk.0.ffn_up_exps.weight"] == (spec.n_embd, spec.n_ff_expert, spec.n_expert)


def test_llama3_rope_scaling_writes_the_converters_rope_freqs(tmp_path: Path) -> None:
    """rope_llama3_factor writes rope_freqs.weight first, F32 [head_dim / 2], with the factors of
    llama.cpp's converter (1 for short wavelengths, the factor for long ones, smoothed between)
    and no rope scaling key (llama.cpp reads only the tensor)."""
    (path,) = write_model(tiny_dense(rope_llama3_factor=8.0), tmp_path)
    reader = gguf.GGUFReader(path)
    first = reader.tensors[0]
    assert first.name == "rope_freqs.weight"
    assert first.tensor_type == Q.F32
    assert tuple(int(n) for n in first.shape) == (8,)  # head width 16
    # head width 16, base 1e4: wavelengths 2*pi*1e4^(i/8); 8192/4 = 2048 and 8192 bound the ramp.
    wavelen = 2 * np.pi * 10000.0 ** (np.arange(8) / 8)
    smooth = (8192 / wavelen[6] - 1) / 3
    expected = [1.0] * 6 + [1 / ((1 - smooth) / 8 + smooth), 8.0]
    np.testing.assert_allclose(np.asarray(first.data), expected, rtol=1e-6)
    assert not any("rope.scaling" in key for key in _fields(reader))
    assert "rope_freqs.weight" not in {t.name for t in plan_tensors(tiny_dense())}


def test_tied_output_drops_output_weight(tmp_path: Path) -> None:
    """tied_output writes no output.weight (the head reads token_embd.weight)."""
    spec = tiny_dense(tied_output=True)
    names = {t.name for t in gguf.GGUFReader(write_model(spec, tmp_path)[0]).tensors}
    assert "output.weight" not in names
    assert "token_embd.weight" in names


REFUSED = {
    "qwen3moe + shared expert": (
        lambda: tiny_moe(shared_expert=True),
        r"qwen3moe has no shared expert.*qwen3moe\.cpp",
    ),
    "llama + shared expert": (
        lambda: tiny_moe(arch="llama", shared_expert=True),
        r"llama has no shared expert.*models/llama\.cpp",
    ),
    "qwen2moe + tied output": (
        lambda: tiny_arch("qwen2moe", tied_output=True),
        r"qwen2moe cannot tie its output: llama\.cpp requires output\.weight",
    ),
    "qwen2moe without shared expert": (
        lambda: tiny_arch("qwen2moe", shared_expert=False),
        r"qwen2moe needs shared_expert",
    ),
    "llama with experts in some blocks": (
        lambda: tiny_dense(n_layers=3, n_expert=4, n_expert_used=2, moe_layers=(1,)),
        r"llama has experts in every block or in none: moe_layers \[1\] of 3",
    ),
    "qwen2 with its own head width": (
        lambda: tiny_arch("qwen2", head_dim=32),
        r"qwen2 needs head_dim = n_embd / n_head",
    ),
    "dense arch with experts": (
        lambda: tiny_arch("gemma3", n_expert=4, n_expert_used=2),
        r"gemma3 is dense",
    ),
    "rope_freqs outside llama": (
        lambda: tiny_arch("qwen3", rope_llama3_factor=8.0),
        r"qwen3 has no rope_freqs tensor: llama\.cpp refuses the file.*qwen3\.cpp",
    ),
    "rope_freqs not in F32": (
        lambda: tiny_llama3(types={Role.ROPE_FREQS: Q.F16}),
        r"ROPE_FREQS must be F32 \(ggml reads it as floats\), found F16",
    ),
}


@pytest.mark.parametrize("combination", list(REFUSED))
def test_specs_llama_cpp_would_refuse_are_refused_with_the_reason(combination: str) -> None:
    """A writer option combination llama.cpp's loader rejects is refused, saying why."""
    build, reason = REFUSED[combination]
    with pytest.raises(ValueError, match=reason):
        build()


def test_every_allowed_combination_is_accepted() -> None:
    """The paired check: each architecture's allowed options (dense/MoE, tied output where the
    loader allows it, qwen2moe's shared expert) are accepted."""
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        tiny_arch(arch)
        tiny_arch(arch, tied_output=True)
    tiny_moe(arch="llama")
    tiny_moe(arch="llama", tied_output=True)
    tiny_moe(tied_output=True)
    tiny_arch("qwen2moe")
    tiny_dense(n_layers=3, n_expert=4, n_expert_used=2, moe_layers=(0, 1, 2))
    tiny_llama3()
    tiny_moe(arch="llama", rope_llama3_factor=8.0)


def test_same_spec_gives_byte_identical_files(tmp_path: Path) -> None:
    """Writing the same spec twice gives byte-identical files; another seed gives other bytes."""
    spec = demo_moe()
    a = write_model(spec, tmp_path / "a", layout=Layout.SPLIT)
    b = write_model(spec, tmp_path / "b", layout=Layout.SPLIT)
    c = write_model(demo_moe(seed=1), tmp_path / "c", layout=Layout.SPLIT)
    assert [p.name for p in a] == [p.name for p in b]
    assert all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))
    assert a[1].read_bytes() != c[1].read_bytes()


def test_changing_one_role_type_leaves_other_tensor_bytes_alone(tmp_path: Path) -> None:
    """Weights are seeded per tensor name: retyping one role changes only that role's tensors."""
    spec = tiny_moe()
    before = _tensors(write_model(spec, tmp_path / "a"))
    after = _tensors(write_model(spec.with_types(ffn_up_exps="q4_0"), tmp_path / "b"))
    changed = {n for n in before if bytes(before[n].data) != bytes(after[n].data)}
    assert changed == {f"blk.{b}.ffn_up_exps.weight" for b in range(spec.n_layers)}


def test_rows_not_filling_blocks_are_refused_naming_tensor_and_block(tmp_path: Path) -> None:
    """A type whose block does not divide the row length is refused, naming tensor and block."""
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up_exps\.weight.*Q4_K block size 256"):
        tiny_moe(types={Role.FFN_UP_EXPS: Q.Q4_K})
    assert not list(tmp_path.iterdir())


def test_inconsistent_specs_list_every_problem() -> None:
    """An inconsistent spec raises one ValueError that lists each problem."""
    with pytest.raises(ValueError) as info:
        ModelSpec(arch="qwen3moe", n_head=6, n_head_kv=4, n_expert=0, types={"attn_q": "iq2_xxs"})
    message = str(info.value)
    assert "multiple of n_head_kv" in message
    assert "qwen3moe needs n_expert > 0" in message
    assert "IQ2_XXS" in message


def test_long_vocabulary_arrays(tmp_path: Path) -> None:
    """extra_vocab_strings=256000 writes three 256256-entry tokenizer arrays the reader accepts,
    and (as llama.cpp sizes them by the token list) a token_embd of 256256 rows."""
    spec = tiny_dense(extra_vocab_strings=256_000, tied_output=True)
    header = read_header(write_model(spec, tmp_path)[0])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert header.metadata[key].count == 256 + 256_000  # type: ignore[union-attr]
    assert header.tensor_map()["token_embd.weight"].ne == (spec.n_embd, 256 + 256_000)
    assert header.metadata["llama.vocab_size"] == 256 + 256_000


# --- atomic ------------------------------------------------------------------------------------


def test_atomic_write_replaces_content_keeps_mode_and_leaves_no_temp(tmp_path: Path) -> None:
    """atomic_write replaces the file, keeps its permission bits and leaves no temp file."""
    target = tmp_path / "shard.gguf"
    target.write_bytes(b"old")
    target.chmod(0o640)
    seen: list[str] = []

    def write(f: BinaryIO) -> None:
        seen.append(os.path.basename(f.name))
        f.write(b"new content")

    atomic_write(target, write)
    assert target.read_bytes() == b"new content"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert is_temp_name(seen[0])
    assert seen[0].startswith(".shard.gguf.tmp-")
    assert [p.name for p in tmp_path.iterdir()] == ["shard.gguf"]


def test_interrupted_atomic_write_leaves_old_file_intact(tmp_path: Path) -> None:
    """An exception inside write_fn leaves the old content in place and removes the temp file."""
    target = tmp_path / "shard.gguf"
    target.write_bytes(b"old")

    def write(f: BinaryIO) -> None:
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["shard.gguf"]


def test_atomic_copy_and_replace(tmp_path: Path) -> None:
    """atomic_copy copies bytes; atomic_replace refuses a temp file from another directory."""
    src = tmp_path / "a.gguf"
    src.write_bytes(bytes(range(256)) * 5000)
    dst = atomic_copy(src, tmp_path / "b.gguf")
    assert dst.read_bytes() == src.read_bytes()
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub" / ".x.tmp-1"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"same|directory"):
        atomic_replace(other, dst)
    tmp = tmp_path / ".b.gguf.tmp-2"
    tmp.write_bytes(b"replaced")
    atomic_replace(tmp, dst)
    assert dst.read_bytes() == b"replaced"
    assert not tmp.exists()


# --- command line ------------------------------------------------------------------------------


@pytest.mark.process
def test_make_model_command_prints_deterministic_files(tmp_path: Path) -> None:
    """make-model prints the written files, first the one to load; reruns are byte-identical."""
    args = ["--arch", "qwen3moe", "--layers", "2", "--experts", "4", "--layout", "split"]
    args += ["--type", "ffn_up_exps=q4_0", "--seed", "7", "--name", "m"]
    first = run_ggufswap("make-model", str(tmp_path / "a"), *args)
    again = run_ggufswap("make-model", str(tmp_path / "b"), *args)
    assert first.returncode == 0, first.stderr
    paths = [Path(line) for line in first.stdout.splitlines()]
    assert paths[0].name == "m-00001-of-00004.gguf"
    assert all(re.fullmatch(r"m-0000\d-of-00004\.gguf", p.name) for p in paths)
    tensors = _tensors(paths)
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == Q.Q4_0
    assert tensors["blk.1.ffn_up_exps.weight"].shape[2] == 4
    for p in paths:
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes()
    assert again.returncode == 0


@pytest.mark.process
def test_make_model_command_reports_bad_options(tmp_path: Path) -> None:
    """make-model exits 2 and names the problem for a bad --type, writing nothing."""
    bad_role = run_ggufswap("make-model", str(tmp_path), "--type", "ffn_upp=q8_0")
    assert bad_role.returncode == 2
    assert "unknown tensor role 'ffn_upp'" in bad_role.stderr
    bad_block = run_ggufswap("make-model", str(tmp_path), "--type", "attn_q=q6_k")
    assert bad_block.returncode == 2
    assert "blk.0.attn_q.weight" in bad_block.stderr
    assert "256" in bad_block.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.process
def test_make_model_refuses_what_llama_cpp_would_refuse(tmp_path: Path) -> None:
    """make-model exits 2 with llama.cpp's reason for qwen3moe + --shared-expert and qwen2moe +
    --tied-output, writing nothing; qwen2moe alone gets its required shared expert."""
    shexp = run_ggufswap("make-model", str(tmp_path), "--arch", "qwen3moe", "--shared-expert")
    assert shexp.returncode == 2
    assert "qwen3moe has no shared expert" in shexp.stderr
    tied = run_ggufswap("make-model", str(tmp_path), "--arch", "qwen2moe", "--tied-output")
    assert tied.returncode == 2
    assert "qwen2moe cannot tie its output" in tied.stderr
    assert not list(tmp_path.iterdir())
    ok = run_ggufswap("make-model", str(tmp_path / "q2"), "--arch", "qwen2moe")
    assert ok.returncode == 0, ok.stderr
    names = {t.name for t in read_header(Path(ok.stdout.split()[0])).tensors}
    assert "blk.0.ffn_gate_inp_shexp.weight" in names


def test_sparse_model_has_a_real_header_and_no_data_on_disk(tmp_path: Path) -> None:
    """A sparse model's header lists every tensor of its spec at its full size; the data is a
    hole that reads back as zeros and takes (almost) no disk."""
    spec = tiny_moe(n_embd=256, n_ff_expert=256, n_expert=64)
    path = write_sparse_model(spec, tmp_path)
    header = read_header(path)
    planned = plan_tensors(spec)
    assert [(t.name, t.ne) for t in header.tensors] == [(t.name, t.ne) for t in planned]
    last = header.tensors[-1]
    assert path.stat().st_size >= last.offset + last.nbytes
    assert os.stat(path).st_blocks * 512 < path.stat().st_size // 4
    assert bytes(read_tensor_bytes(header.tensor_map()[last.name])) == bytes(last.nbytes)
