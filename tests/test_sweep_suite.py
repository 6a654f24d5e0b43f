"""The sweep does the GGUF Tool Suite's job: every type named as llama.cpp and ik_llama.cpp spell
them, ik types from the user's per-tensor shard directory, outputs in the Suite's formats (404
cells, baseline-equivalent cells, per-round logs, group0/), a bounded scratch, and refusals
before the first round.

With ``GGUF_TOOL_SUITE=/path/to/a/GGUF-Tool-Suite/checkout`` the Suite's own
``collect_ppl_results.sh`` and ``quant_assign.py`` are run on a sweep's output directory (their
code is MIT and public, but is never copied into this repository)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import ModelDir, one_thread
from test_sweep import english

from ggufswap.config import Storage
from ggufswap.runtime.kernels import ggml_describe, ggml_library
from ggufswap.runtime.models import Numerics
from ggufswap.shards import (
    GGMLType,
    Layout,
    ModelSpec,
    Role,
    read_header,
    tiny_dense,
    tiny_moe,
    write_model,
)
from ggufswap.shards.resplit import split_per_tensor
from ggufswap.shards.writer import F32_ROLES
from ggufswap.sweep import (
    Recipe,
    RecipeError,
    ShardDir,
    SweepError,
    SweepOptions,
    ik_quantize,
    parse_qtype,
    qtype_name,
    run_sweep,
)
from ggufswap.sweep import sweep as sweep_module
from ggufswap.sweep.results import natural_key
from ggufswap.sweep.suite import map_lines

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

CTX, CHUNKS = 64, 2
SUITE_ENV = "GGUF_TOOL_SUITE"
IK = "iq4_ks"


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("Q4_K", "q4_K"), ("q4_k", "q4_K"), ("IQ4_KS", "iq4_ks"), ("iq4_k", "iq4_k"),
     ("Q6_0", "q6_0"), ("iq2_KT", "iq2_kt"), ("IQ4_K_R4", "iq4_k_r4"), ("q8_k_r8", "q8_k_r8"),
     ("BF16", "bf16"), ("iq4_xs", "iq4_xs"), ("q2_k_r4", "q2_k_r4")],
)  # fmt: skip
def test_every_type_is_named_in_any_case_and_printed_canonically(
    given: str, canonical: str
) -> None:
    """A type name is read in any case; every output spells it as llama.cpp / ik_llama.cpp and
    the Suite's file names do (q*_K capital, everything else lower case)."""
    assert qtype_name(parse_qtype(given)) == canonical


def test_recipe_names_ik_types_and_refuses_unknown_ones() -> None:
    """A recipe takes ik types beside mainline ones; an unknown name is refused with the near
    spellings, a non-weight type with why."""
    recipe = Recipe.from_document({"quants": ["q8_0", "q4_K", "IQ4_KS", "q6_0"],
                                   "tensors": [{"match": "x"}]})  # fmt: skip
    assert [qtype_name(q) for q in recipe.rules[0].quants] == ["q8_0", "q4_K", "iq4_ks", "q6_0"]
    with pytest.raises(RecipeError, match=r"unknown GGML type 'iq4_kz' \(did you mean .*iq4_ks"):
        Recipe.from_document({"quants": ["iq4_kz"], "tensors": [{"match": "x"}]})
    with pytest.raises(RecipeError, match="i32 is not a weight type"):
        Recipe.from_document({"quants": ["i32"], "tensors": [{"match": "x"}]})


def exact(**overrides: Any) -> SweepOptions:
    fields: dict[str, Any] = {"n_ctx": CTX, "max_chunks": CHUNKS, **overrides}
    return SweepOptions(numerics=Numerics.EXACT, storage=Storage.DEQUANTIZED, **fields)


def test_type_without_a_source_is_refused_before_the_first_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ik_llama.cpp's quantizer and without a --source, an ik type is refused before
    anything runs (no baseline, no round), in one line naming how to produce it."""
    monkeypatch.setattr(ik_quantize, "find_binary", lambda: None)
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    recipe = Recipe.from_document({"quants": ["q4_0", "iq4_ks"], "tensors": [{"match": "attn_q"}]})
    out = tmp_path / "out"
    with pytest.raises(
        SweepError, match=r"iq4_ks: .*pip install 'ggufswap\[ik\]'.*--source iq4_ks="
    ):
        run_sweep(model.first, text=english(), recipe=recipe, out_dir=out, options=exact())
    assert not (out / "baseline.json").exists(), "nothing ran"


def test_ggml_numerics_refuse_ik_types_no_libggml_multiplies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a libggml that multiplies them (no ik_llama.cpp's: the ggml extra not installed),
    the default numerics know no ik type's activation rounding: a recipe naming one is refused up
    front, naming the extra and --numerics exact."""
    monkeypatch.setattr(sweep_module, "ggml_library", lambda: None)
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    recipe = Recipe.from_document({"quants": [IK], "tensors": [{"match": "attn_q"}]})
    source = {int(GGMLType.IQ4_KS): ShardDir(tmp_path, GGMLType.IQ4_KS)}
    with pytest.raises(
        SweepError, match=r"knows no activation rounding for iq4_ks.*ggml\].*--numerics exact"
    ):
        run_sweep(
            model.first, text=english(), recipe=recipe, out_dir=tmp_path / "out", models=source,
            options=SweepOptions(n_ctx=CTX, max_chunks=CHUNKS),
        )  # fmt: skip


@pytest.mark.process  # ik's llama-quantize
def test_ggml_numerics_sweep_ik_types_through_ik_llama_cpps_libggml(tmp_path: Path) -> None:
    """With ik_llama.cpp's libggml loaded, an ik type's round runs under the default numerics:
    its tensor made by ik's llama-quantize, its products ik's own (recorded, restored)."""
    library = ggml_library()
    if library is None or int(GGMLType.Q6_0) not in library.types:
        pytest.skip(f"no libggml multiplies q6_0 here ({ggml_describe()})")
    if ik_quantize.find_binary() is None:
        pytest.skip("ik_llama.cpp's llama-quantize is not installed (the ik extra)")
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    recipe = Recipe.from_document({"quants": ["q6_0"], "tensors": [{"match": r"^blk\.0\.attn_q"}]})
    report = run_sweep(
        model.first, text=english(), recipe=recipe, out_dir=tmp_path / "out",
        options=SweepOptions(n_ctx=CTX, max_chunks=1),
    )  # fmt: skip
    assert report.refused == [], report.refused
    assert list(report.journal) == ["blk.0.attn_q.weight@q6_0"]


def moe_spec(**types: str) -> ModelSpec:
    """The tiny MoE model (2 blocks) at rows of 256 (ik's super-block)."""
    return tiny_moe(n_embd=256, n_ff=256, n_ff_expert=256, n_layers=2).with_types(**types)


def suite_download_dir(tmp_path: Path, qtype: str) -> Path:
    """The model in ``qtype`` as ``quant_downloader.sh`` leaves it: one tensor a shard named
    ``<model>-THIREUS-<QTYPE>-SPECIAL_TENSOR-NNNNN-of-MMMMM.gguf``, and ``tensors.<qtype>.map``."""
    every = {r.name: qtype for r in Role if r not in F32_ROLES}
    (first,) = write_model(moe_spec(**every), tmp_path / f"{qtype}-single", layout=Layout.SINGLE)
    shards = split_per_tensor(first, tmp_path / f"{qtype}-split")
    dest = tmp_path / "downloads"
    dest.mkdir()
    n = len(shards)
    lines = []
    for i, shard in enumerate(shards, start=1):
        name = f"Tiny-THIREUS-{qtype.upper()}-SPECIAL_TENSOR-{i:05d}-of-{n:05d}.gguf"
        shutil.move(shard, dest / name)
        for rec in read_header(dest / name).tensors:
            lines.append(
                f"{name}:{'1' * 64}:{rec.name}:shape=({', '.join(map(str, rec.ne))}):"
                f"dtype={qtype_name(rec.ggml_type)}:elements={rec.n_elements}:bytes={rec.nbytes}"
            )
    (dest / f"tensors.{qtype}.map").write_text("\n".join(lines) + "\n")
    return dest


MOE_RECIPE = {
    "quants": ["q4_0", IK],
    "tensors": [{"match": r"^blk\.1\.ffn_up_exps\.weight$"}],
    "groups": [{"name": "gates", "match": [r"^blk\.\d+\.ffn_gate_exps\.weight$"]}],
}
UNITS = ("blk.1.ffn_up_exps.weight", "gates")
MOE_CTX = 32  # the MoE sweep's rounds: 4 of them, 3 forwards of 32 tokens each
KEYS = {f"{u}@{q}" for u in UNITS for q in ("q4_0", IK)}


@pytest.fixture(scope="module")
def moe_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A sweep of the project-written MoE model: q4_0 by requantization, iq4_ks from a per-tensor
    shard directory in the Suite's download layout."""
    root = tmp_path_factory.mktemp("moe-sweep")
    model = ModelDir.write(root / "model", moe_spec())
    downloads = suite_download_dir(root, IK)
    out = root / "out"
    report = run_sweep(
        model.first, text=english(), recipe=Recipe.from_document(MOE_RECIPE), out_dir=out,
        options=exact(n_ctx=MOE_CTX),
        models={int(GGMLType.IQ4_KS): ShardDir(downloads, GGMLType.IQ4_KS)},
    )  # fmt: skip
    return out, report


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_sweep_records_every_round_with_the_ik_type_from_the_shard_dir(
    moe_sweep: tuple[Path, Any],
) -> None:
    """Every round is recorded; the iq4_ks rounds load their tensors from the downloaded shards
    (nothing requantized), the q4_0 ones from scratch files removed after each round."""
    out, report = moe_sweep
    assert set(report.journal) == KEYS, report.refused
    ik_round = report.journal[f"blk.1.ffn_up_exps.weight@{IK}"]
    assert all("SPECIAL_TENSOR" in s for s in ik_round["sources"])
    assert all(r["metrics"]["kld_mean"] > 0 for r in report.journal.values())
    assert not (out / "scratch").exists()


SUITE_PPL = re.compile(r"Mean PPL\(Q\)\s*:\s*([0-9]+(\.[0-9]+)?)")  # collect_ppl_results.sh's
SUITE_KLD = re.compile(r"Mean\s*KLD\s*:\s*([0-9]+(\.[0-9]+)?)")
SUITE_FINAL = re.compile(r"PPL\s*=\s*([0-9]+(\.[0-9]+)?)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_outputs_follow_the_suites_format_contract(moe_sweep: tuple[Path, Any]) -> None:
    """The directory holds what the Suite's collectors read: a map per target type, a
    llama-perplexity log per round whose PPL and KLD lines their regexes extract (the recorded
    figures), the baseline's log, the CSVs with the groups in group0/ under groupN names and
    their mapping file."""
    out, report = moe_sweep
    n_tensors = len(report_originals(out))
    for q in ("q4_0", IK):
        lines = (out / f"tensors.{q}.map").read_text().splitlines()
        assert len(lines) == n_tensors
        fields = lines[0].split(":")
        assert fields[3].startswith("shape=(")
        assert fields[4].startswith("dtype=")
    for key, record in report.journal.items():
        unit, q = key.split("@")
        folder, name = (out / "group0", "group0") if unit == "gates" else (out, unit)
        text = (folder / f"bench_ppl_kld_result.{name}.{q}.{CHUNKS}.txt").read_text()
        ppl, kld = SUITE_PPL.search(text), SUITE_KLD.search(text)
        assert ppl is not None, text
        assert kld is not None, text
        assert float(ppl.group(1)) == pytest.approx(record["metrics"]["ppl"], rel=1e-6)
        assert float(kld.group(1)) == pytest.approx(record["metrics"]["kld_mean"], abs=1e-9)
        for line in ("Median  KLD:", "90.0%   KLD:", "Mean    Δp:", "Median  Δp:", "Same top p:"):
            assert line in text, line
    (base_log,) = out.glob(f"bench_ppl_kld_result.baseline.*.{CHUNKS}.txt")
    final = SUITE_FINAL.search(base_log.read_text())
    assert final is not None
    assert float(final.group(1)) == pytest.approx(report.ppl_base, abs=1e-4)
    (mapping_file,) = (out / "group0").glob(f"bench_ppl_kld_group_mapping.*.{CHUNKS}.txt")
    mapping = mapping_file.read_text()
    assert mapping.startswith(r"group0:^blk\.0\.ffn_gate_exps\.weight$,")
    with (out / "group0" / "kld_results.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["QTYPE", "group0"]
    assert [r[0] for r in rows[1:]] == [IK, "q4_0"]
    with (out / "kld_results.csv").open() as f:
        header = next(csv.reader(f))
    assert "gates" not in header
    assert "group0" not in header
    protocol = json.loads((out / "protocol.json").read_text())
    assert protocol["numerics"] == "exact"
    assert (protocol["n_ctx"], protocol["n_chunk"]) == (MOE_CTX, CHUNKS)


def test_missing_and_equivalent_cells(tmp_path: Path) -> None:
    """A cell with no recorded round is 404 (the Suite's unmeasured marker); a tensor the model
    never computes with and a target equal to a tensor's type are baseline-equivalent (KLD 0,
    the baseline's PPL), the unused one with the Suite's .txt.unused note; the percent form
    writes PPL as deltas."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    recipe = Recipe.from_document({
        "quants": ["q8_0", "q4_0"],
        "tensors": [{"match": r"^blk\.0\.(attn_q|ffn_down)\.weight$"}],
    })  # fmt: skip
    out = tmp_path / "out"
    report = run_sweep(
        model.first, text=english(), recipe=recipe, out_dir=out, options=exact(ppl_percent=True)
    )
    assert "blk.0.ffn_down.weight@q8_0" not in report.journal, "already q8_0"
    with (out / "kld_results.csv").open() as f:
        kld = {row[0]: row[1:] for row in csv.reader(f)}
    assert kld["QTYPE"] == ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"]
    assert kld["q8_0"][1] == "0"
    with (out / "ppl_results.csv").open() as f:
        ppl = {row[0]: row[1:] for row in csv.reader(f)}
    assert ppl["q8_0"][1] == "+0.00%"
    assert re.fullmatch(r"[+-]\d+\.\d\d%", ppl["q4_0"][0])
    same = (out / f"bench_ppl_kld_result.blk.0.ffn_down.weight.q8_0.{CHUNKS}.txt").read_text()
    assert SUITE_KLD.search(same).group(1) == "0.000000000"  # type: ignore[union-attr]


@pytest.mark.slow  # 20 rounds: about 20 s on a loaded CPU
def test_scratch_disk_stays_at_one_round_over_twenty_rounds(tmp_path: Path) -> None:
    """Over 20 rounds the scratch directory never holds more than one round's tensors (the
    high-water mark in report.json), and nothing is left at the end."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    recipe = Recipe.from_document({
        "quants": ["q4_0", "q5_0", "q5_1", "q4_1"],
        "tensors": [{"match": r"^blk\.\d+\.(attn_[qkv]|attn_output)\.weight$"}],
        "groups": [{"match": [r"^blk\.\d+\.ffn_(up|gate)\.weight$"]}],
    })  # fmt: skip
    out = tmp_path / "out"
    report = run_sweep(
        model.first, text=english(), recipe=recipe, out_dir=out, options=exact(max_chunks=1)
    )  # the chunk count matters not: the files do
    assert len(report.journal) >= 20, report.refused
    high = json.loads((out / "report.json").read_text())["disk"]["high_water_bytes"]
    biggest_round = max(r["bytes"] for r in report.journal.values())
    header_room = 4096 * max(len(r["tensors"]) for r in report.journal.values())
    assert 0 < high <= biggest_round + header_room
    assert not (out / "scratch").exists()


# --- the Suite's own scripts, when a checkout is given -----------------------------------------


def _suite() -> Path:
    checkout = os.environ.get(SUITE_ENV)
    if not checkout:
        pytest.skip(f"set {SUITE_ENV}=/path/to/GGUF-Tool-Suite to run the Suite's own scripts")
    path = Path(checkout)
    if not (path / "collect_ppl_results.sh").is_file():
        pytest.skip(f"{SUITE_ENV}={path} holds no collect_ppl_results.sh")
    return path


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_suites_collect_and_assign_read_the_output(
    moe_sweep: tuple[Path, Any], tmp_path: Path
) -> None:
    """collect_ppl_results.sh (its USER_REGEX set to every tensor, as its header says to adjust
    it) collects the sweep's logs into the CSVs the sweep wrote; quant_assign.py reads the
    kld_results.csv and the maps (copied through tensor_downloader.sh's local COPY source)."""
    suite = _suite()
    out, _ = moe_sweep
    work = tmp_path / "collect"
    shutil.copytree(out, work)
    script = (suite / "collect_ppl_results.sh").read_text()
    script = re.sub(
        r"USER_REGEX=\(\n.*?\n\)", "USER_REGEX=(\n  '.*'\n)", script, count=1, flags=re.S
    )
    (work / "collect.sh").write_text(script)
    run = subprocess.run(
        ["bash", "collect.sh", "--chunks", str(CHUNKS), "--output-ppl-csv", "suite_ppl.csv",
         "--output-kld-csv", "suite_kld.csv", "--no-percentage"],
        cwd=work, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    sys.stderr.write(run.stdout[-6000:])
    assert run.returncode == 0, run.stderr[-4000:]
    with (work / "suite_kld.csv").open() as f:
        suite_rows = {row[0]: row[1:] for row in csv.reader(f)}
    with (out / "kld_results.csv").open() as f:
        ours = list(csv.reader(f))
    for row in ours[1:]:
        for unit, cell in zip(ours[0][1:], row[1:], strict=True):
            theirs = suite_rows[row[0]][suite_rows["QTYPE"].index(unit)]
            assert float(theirs) == pytest.approx(float(cell), rel=1e-5, abs=1e-9), (unit, row[0])
    pytest.importorskip("pandas", reason="quant_assign.py needs pandas")
    assign_dir = tmp_path / "assign"
    assign_dir.mkdir()
    for name in ("quant_assign.py", "tensor_downloader.sh"):
        shutil.copy2(suite / name, assign_dir / name)
    # the maps as the Suite's download server holds them: a tensor a shard, from shard 2 on
    maps = tmp_path / "maps"
    originals = report_originals(out)
    names = sorted(originals, key=natural_key)
    total = len(names) + 1
    for q in ("bf16", "q4_0", IK):
        repo = maps / f"Tiny-THIREUS-{q.upper()}-SPECIAL_SPLIT"
        repo.mkdir(parents=True)
        files = {
            n: f"Tiny-THIREUS-{q.upper()}-SPECIAL_TENSOR-{i:05d}-of-{total:05d}.gguf"
            for i, n in enumerate(names, start=2)
        }
        lines = map_lines(originals, q, files=files)
        (repo / "tensors.map").write_text("\n".join(lines) + "\n")
    (assign_dir / "download.conf").write_text(
        f'MODEL_NAME="Tiny"\nMAINTAINER="THIREUS"\nCHUNK_FIRST=2\nCHUNKS_TOTAL={total}\n'
        f'DOWNLOAD_ORDER=(COPY)\nCOPY_FOLDERS=("{maps}")\n'
    )
    run = subprocess.run(
        [sys.executable, "quant_assign.py", str(out / "kld_results.csv"), "--skip-gpg",
         "--cpu-tensors", ".*", "--cpu-quants", IK, "q4_0", "--cpu-tensors-max-size", "90%",
         "--tolerance", "0.5", "--harmonization-technique", "0"],
        cwd=assign_dir, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    sys.stderr.write(run.stderr[-4000:] + run.stdout[-4000:])
    assert run.returncode == 0, run.stderr[-4000:]
    assigned = [line for line in run.stdout.splitlines() if re.match(r"^\^.*\$=\w+$", line)]
    assert assigned, run.stdout


def report_originals(out: Path) -> dict[str, Any]:
    """The swept model's tensor table, from the map the sweep wrote (name -> a record-like)."""
    from ggufswap.shards import open_shard_set

    protocol = json.loads((out / "protocol.json").read_text())
    return dict(open_shard_set(protocol["model"]).tensors)


@pytest.mark.process
@pytest.mark.timeout(600)
def test_ik_types_made_by_ik_llama_cpps_quantizer(tmp_path: Path) -> None:
    """With ik_llama.cpp's llama-quantize installed (the ik extra, or GGUFSWAP_IK_QUANTIZE), ik
    types need no files: each round's tensor is quantized by the tool from a model of one
    tensor (its name as block 0's, the block count 1), recorded, and its scratch file removed."""
    if ik_quantize.find_binary() is None:
        pytest.skip("ik_llama.cpp's llama-quantize: pip install 'ggufswap[ik]' or set "
                    f"{ik_quantize.ENV_BINARY}")  # fmt: skip
    model = ModelDir.write(tmp_path / "model", moe_spec())
    recipe = Recipe.from_document(
        {"quants": ["iq4_ks", "q6_0"], "tensors": [{"match": r"^blk\.1\.attn_v\.weight$"}]}
    )
    out = tmp_path / "out"
    report = run_sweep(
        model.first, text=english(), recipe=recipe, out_dir=out,
        options=exact(n_ctx=MOE_CTX, max_chunks=1),
    )  # fmt: skip
    assert set(report.journal) == {"blk.1.attn_v.weight@iq4_ks", "blk.1.attn_v.weight@q6_0"}
    for record in report.journal.values():
        assert record["sources"] == [
            str(out / "scratch" / f"blk.1.attn_v.weight.{record['qtype']}.gguf")
        ]
        assert record["metrics"]["kld_mean"] > 0
    assert not (out / "scratch").exists()


def test_kld_against_a_baseline_model(tmp_path: Path) -> None:
    """--baseline MODEL: the KLD is measured against that model's logits (its PPL is the
    baseline's, the unswapped swept model's own distance to it is recorded), while every restore
    is still checked against the swept model's own logits."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    every = {r.name: "f16" for r in Role if r not in F32_ROLES}
    (reference,) = write_model(
        tiny_dense().with_types(**every), tmp_path / "ref", layout=Layout.SINGLE
    )
    recipe = Recipe.from_document({"quants": ["q4_0"], "tensors": [{"match": r"^blk\.0\.attn_q"}]})
    own = run_sweep(model.first, text=english(), recipe=recipe, out_dir=tmp_path / "own",
                    options=exact())  # fmt: skip
    out = tmp_path / "out"
    report = run_sweep(
        model.first, text=english(), recipe=recipe, out_dir=out, options=exact(),
        baseline_model=str(reference),
    )  # fmt: skip
    baseline = json.loads((out / "baseline.json").read_text())
    assert baseline["protocol"]["baseline_model"] == str(reference)
    assert baseline["model_vs_baseline"]["kld_mean"] > 0, "the swept model is not the reference"
    assert report.ppl_base != own.ppl_base
    assert (
        baseline["digests"]
        == json.loads((tmp_path / "own" / "baseline.json").read_text())["digests"]
    ), "the restore check compares the swept model's own logits"
    (record,) = report.journal.values()
    assert record["metrics"]["ppl_base"] == pytest.approx(report.ppl_base, rel=1e-3)
    assert record["metrics"]["kld_mean"] != own.journal[record["key"]]["metrics"]["kld_mean"]
