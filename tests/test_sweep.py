"""``ggufswap sweep`` and its library core: every recorded round swapped exactly its tensors, was
measured against the baseline, restored and verified; refusals and unused tensors are reported,
never recorded; a kill loses no verified round and a restart repeats none."""

from __future__ import annotations

import csv
import json
import math
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from processes import Proc, run_ggufswap, wait_for
from runtime_helpers import ModelDir, Q, one_thread

from ggufswap.config import Storage
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models import HParams, Numerics, build_model
from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.perplexity import eval_batch, first_scored, text_chunks, text_tokens
from ggufswap.shards import Layout, open_shard_set, requantize, tiny_dense, write_model
from ggufswap.shards.resplit import kv_entries
from ggufswap.shards.writer import RawTensor, write_gguf
from ggufswap.sweep import (
    GgufSet,
    InProcessTarget,
    Recipe,
    Sweep,
    SweepError,
    SweepOptions,
    run_sweep,
)
from ggufswap.sweep.evaluate import ChunkEvaluator, products
from ggufswap.sweep.results import JOURNAL, KLD_CSV, PPL_CSV
from ggufswap.sweep.sources import TensorSources

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

CTX = 64
CHUNKS = 6
WAIT_S = 120.0
RECIPE = {
    "quants": ["q4_0", "q5_1"],
    "tensors": [
        {"match": r"^blk\.\d+\.attn_q\.weight$"},
        {"match": r"^blk\.0\.ffn_down\.weight$", "quants": ["q4_0", "q8_0"]},
    ],
    "groups": [{"name": "all_ffn_up", "match": [r"^blk\.\d+\.ffn_up\.weight$"]}],
    "locked": [r"^blk\.1\.attn_q"],
}


def english() -> str:
    path = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    if not path.exists():
        pytest.skip(f"no English text to evaluate on: {path} is missing")
    return path.read_text(encoding="utf-8")[:4000]


def options(**overrides: Any) -> SweepOptions:
    return SweepOptions(n_ctx=CTX, max_chunks=CHUNKS, **overrides)


def exact(**overrides: Any) -> SweepOptions:
    """Float products (figures comparable with a direct float64 computation)."""
    return options(numerics=Numerics.EXACT, storage=Storage.DEQUANTIZED, **overrides)


def test_sweep_records_verified_rounds_as_tool_suite_csvs(tmp_path: Path) -> None:
    """Each round swaps exactly its tensors (a group's together), is restored to the baseline,
    and lands in the journal and in ppl/kld_results.csv (one row per quant type, one column per
    tensor; the groups in group0/); a locked tensor is left out, a target equal to the tensor's
    type is recorded as baseline-equivalent, a cell without a round is 404."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    before = {p: Path(p).read_bytes() for p in open_shard_set(model.first).paths}
    out = tmp_path / "out"
    report = run_sweep(
        model.first, text=english(), recipe=Recipe.from_document(RECIPE), out_dir=out,
        options=options(),
    )  # fmt: skip
    keys = {
        "all_ffn_up@q4_0", "all_ffn_up@q5_1", "blk.0.attn_q.weight@q4_0",
        "blk.0.attn_q.weight@q5_1", "blk.0.ffn_down.weight@q4_0",
    }  # fmt: skip
    assert set(report.journal) == keys
    assert report.rounds_planned == len(keys)
    assert report.refused == []
    assert {(s.unit, s.target) for s in report.skipped} == {
        ("blk.1.attn_q.weight", "*"),
        ("blk.0.ffn_down.weight", "q8_0"),
    }
    versions = sorted(r["weight_version"] for r in report.journal.values())
    assert versions == list(range(1, 2 * len(keys), 2)), "one swap and one restore per round"
    for r in report.journal.values():
        assert r["restored_version"] == r["weight_version"] + 1
        assert r["metrics"]["kld_mean"] > 0
        assert r["metrics"]["count"] == CHUNKS * (CTX - 1 - CTX // 2)
        assert r["metrics"]["ppl"] != report.ppl_base
    assert report.journal["all_ffn_up@q4_0"]["tensors"] == [
        "blk.0.ffn_up.weight",
        "blk.1.ffn_up.weight",
    ]
    # q5_1 keeps more bits than q4_0: less damage, for every unit swept to both
    for unit in ("all_ffn_up", "blk.0.attn_q.weight"):
        q4, q5 = (report.journal[f"{unit}@{q}"]["metrics"]["kld_mean"] for q in ("q4_0", "q5_1"))
        assert q5 < q4, unit
    with (out / PPL_CSV).open() as f:
        ppl = list(csv.reader(f))
    assert ppl[0] == ["QTYPE", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"]
    assert [row[0] for row in ppl[1:]] == ["q4_0", "q5_1", "q8_0"]
    assert ppl[2][2] == "404", "no q5_1 round for ffn_down"
    assert ppl[3][1] == "404", "no q8_0 round for attn_q"
    assert float(ppl[3][2]) == pytest.approx(report.ppl_base, rel=1e-6), "already q8_0"
    assert float(ppl[1][1]) == pytest.approx(
        report.journal["blk.0.attn_q.weight@q4_0"]["metrics"]["ppl"], rel=1e-6
    )
    with (out / "group0" / KLD_CSV).open() as f:
        kld = list(csv.reader(f))
    assert kld[0] == ["QTYPE", "group0"]
    assert float(kld[1][1]) == pytest.approx(
        report.journal["all_ffn_up@q4_0"]["metrics"]["kld_mean"], rel=1e-6
    )
    assert not (out / "scratch").exists(), "scratch removed at the end"
    after = {p: Path(p).read_bytes() for p in open_shard_set(model.first).paths}
    assert after == before, "the sweep never writes the user's model"


def test_round_figures_match_a_fresh_load_of_the_swapped_model(tmp_path: Path) -> None:
    """A round's PPL and KLD equal those computed directly in float64 from the logits of a fresh
    load of the model with that tensor requantized, against a fresh load of the original."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    name = "blk.0.attn_q.weight"
    recipe = Recipe.from_document({"quants": ["q4_0"], "tensors": [{"match": f"^{name}$"}]})
    report = run_sweep(
        model.first, text=english(), recipe=recipe, out_dir=tmp_path / "out", options=exact()
    )
    got = report.journal[f"{name}@q4_0"]["metrics"]
    swapped = model.clone(tmp_path / "swapped")
    requantize(swapped.shard_of(name), name, "q4_0")

    def logits_of(first: Path) -> tuple[torch.Tensor, torch.Tensor]:
        with HotSwapRuntime.open(first) as runtime:
            assert runtime.shards is not None, "open() keeps the shard set"
            decoder = build_model(HParams.from_metadata(runtime.shards.metadata), runtime.store)
            tokens, bos = text_tokens(GgufTokenizer.from_file(first), english())
            chunks = text_chunks(tokens, n_ctx=CTX, max_chunks=CHUNKS)
            with torch.inference_mode():
                out = decoder(eval_batch(chunks, bos))[:, first_scored(CTX) : CTX - 1]
            targets = torch.from_numpy(chunks[:, first_scored(CTX) + 1 :].astype(np.int64))
            return out.double().flatten(0, 1), targets.flatten()

    base, targets = logits_of(model.first)
    current, _ = logits_of(swapped.first)
    lp, lq = torch.log_softmax(base, dim=1), torch.log_softmax(current, dim=1)
    kld = (lp.exp() * (lp - lq)).sum(dim=1)
    nll = -lq.gather(1, targets[:, None])[:, 0]
    assert got["ppl"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)
    assert got["kld_mean"] == pytest.approx(float(kld.mean()), rel=1e-2)
    assert got["kld_max"] == pytest.approx(float(kld.max()), rel=1e-2)


def test_tensor_the_model_never_reads_is_skipped(tmp_path: Path) -> None:
    """A loaded tensor that is not among the model's required tensors is reported as skipped
    and gets no round."""
    (first,) = write_model(tiny_dense(), tmp_path / "plain", layout=Layout.SINGLE)
    header = open_shard_set(first).first
    kv = kv_entries(header.path, header.data_offset)
    raws = [
        RawTensor(t.name, t.ggml_type, t.ne, Path(first).read_bytes()[t.offset : t.end])
        for t in header.tensors
    ]
    unused = np.arange(64 * 32, dtype=np.float32).reshape(32, 64) / 1000
    raws.append(RawTensor("blk.0.unused.weight", Q.F32, (64, 32), unused))
    (tmp_path / "model").mkdir()
    path = write_gguf(
        tmp_path / "model" / "extra.gguf",
        n_kv=len(kv),
        kv_bytes=b"".join(raw for _, raw in kv),
        tensors=raws,
    )
    recipe = Recipe.from_document({"quants": ["q4_0"], "tensors": [{"match": r"^blk\.0\."}]})
    report = run_sweep(
        path, text=english(), recipe=recipe, out_dir=tmp_path / "out", options=options()
    )
    assert ("blk.0.unused.weight", "*", "the model never computes with it") in {
        (s.unit, s.target, s.reason) for s in report.skipped
    }
    assert not any("unused" in key for key in report.journal)
    assert "blk.0.attn_q.weight@q4_0" in report.journal


def test_refused_round_is_reported_and_never_recorded(tmp_path: Path) -> None:
    """A plan the runtime refuses (here: the scratch files lie outside its allowed roots) is
    reported with the runtime's reason; nothing is recorded and the model stays at the baseline."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    out = tmp_path / "out"
    runtime = HotSwapRuntime.open(model.first, allowed_roots=[str(model.root)])
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        decoder = build_model(HParams.from_metadata(runtime.shards.metadata), runtime.store)
        tokens, bos = text_tokens(GgufTokenizer.from_file(model.first), english())
        target = InProcessTarget(
            runtime=runtime,
            evaluator=ChunkEvaluator(
                decoder, text_chunks(tokens, n_ctx=CTX, max_chunks=CHUNKS), bos
            ),
            sources=TensorSources(scratch=out / "scratch", originals=runtime.shards.tensors),
            out_dir=out,
        )
        sweep = Sweep(
            target=target,
            recipe=Recipe.from_document(
                {"quants": ["q4_0"], "tensors": [{"match": r"^blk\.0\.attn_k\.weight$"}]}
            ),
            out_dir=out,
            options=options(),
        )
        report = sweep.run()
        assert runtime.weight_version == 0
    finally:
        runtime.close()
    assert report.journal == {}
    (refused,) = report.refused
    assert refused["key"] == "blk.0.attn_k.weight@q4_0"
    assert "outside the allowed roots" in refused["why"]
    assert json.loads((out / "report.json").read_text())["refused"][0]["key"] == refused["key"]
    assert (out / PPL_CSV).read_text() == "QTYPE,blk.0.attn_k.weight\nq4_0,404\n"


def sweep_command(model: Path, text: Path, recipe: Path, out: Path) -> list[str]:
    return [
        "sweep", "--model", str(model), "--text", str(text), "--recipe", str(recipe),
        "--out", str(out), "--ctx", str(CTX), "--chunks", str(CHUNKS), "--no-progress",
    ]  # fmt: skip


@pytest.mark.process
def test_kill_and_restart_loses_no_verified_round_and_repeats_none(tmp_path: Path) -> None:
    """SIGKILL mid-sweep, a torn journal line, then the same command again: every round the first
    run verified is kept as it was, none is measured twice, and the sweep completes."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    text = tmp_path / "english.txt"
    text.write_text(english(), encoding="utf-8")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "quants": ["q4_0", "q4_1", "q5_0", "q5_1"],
                "tensors": [{"match": r"^blk\.\d+\.(attn_[qkv]|ffn_up)\.weight$"}],
            }
        )
    )
    out = tmp_path / "out"
    journal = out / JOURNAL
    env = {"OMP_NUM_THREADS": "1"}
    cmd = sweep_command(model.first, text, recipe, out)
    first = Proc(cmd, log=tmp_path / "first.log", env=env)
    try:
        wait_for(
            lambda: journal.exists() and journal.read_bytes().count(b"\n") >= 2,
            timeout=WAIT_S,
            what="two verified rounds in the journal",
            interval=0.01,
        )
    finally:
        first.kill()
    kept = journal.read_bytes().splitlines(keepends=True)
    assert len(kept) < 32, "the kill came after the last round: nothing to resume"
    with journal.open("ab") as f:
        f.write(b'{"key": "torn')  # a write cut by the kill
    rerun = run_ggufswap(*cmd, timeout=WAIT_S, env=env)
    assert rerun.returncode == 0, rerun.stderr
    lines = journal.read_bytes().splitlines(keepends=True)
    assert lines[: len(kept)] == kept, "verified rounds are kept byte for byte"
    keys = [json.loads(line)["key"] for line in lines]
    assert len(keys) == len(set(keys)) == 32
    assert f"32 of 32 rounds recorded ({32 - len(kept)} now, {len(kept)} from the journal)" in (
        rerun.stdout
    )


@pytest.mark.process
def test_sweep_command_usage_errors_name_the_problem(tmp_path: Path) -> None:
    """A bad recipe or a text too short for two contexts is refused with the reason."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    text = tmp_path / "short.txt"
    text.write_text("Monday, Tuesday.", encoding="utf-8")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tensors:\n  - match: '('\n    quants: [q9_9]\n")
    run = run_ggufswap(*sweep_command(model.first, text, bad, tmp_path / "out"), timeout=WAIT_S)
    assert run.returncode == 2
    assert "bad regex '('" in run.stderr
    assert "unknown GGML type 'q9_9'" in run.stderr
    good = tmp_path / "good.yaml"
    good.write_text("quants: [q4_0]\ntensors: [{match: attn_q}]\n")
    run = run_ggufswap(*sweep_command(model.first, text, good, tmp_path / "out"), timeout=WAIT_S)
    assert run.returncode == 1
    assert "needs at least 128" in run.stderr


def test_tensors_from_a_model_in_the_target_type(tmp_path: Path) -> None:
    """With a source model for a type, the round loads that model's tensor as it is (nothing is
    requantized); a source that holds the tensor in another type makes the round refused."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    q4 = ModelDir.write(tmp_path / "q4", tiny_dense().with_types(attn_q="q4_0"))
    recipe = Recipe.from_document(
        {"quants": ["q4_0", "q5_1"], "tensors": [{"match": r"^blk\.0\.attn_q\.weight$"}]}
    )
    sources = {int(Q.Q4_0): GgufSet(q4.first), int(Q.Q5_1): GgufSet(q4.first)}
    out = tmp_path / "out"
    report = run_sweep(
        model.first, text=english(), recipe=recipe, out_dir=out, options=options(), models=sources
    )
    record = report.journal["blk.0.attn_q.weight@q4_0"]
    assert record["sources"] == [str(q4.shard_of("blk.0.attn_q.weight"))]
    assert record["metrics"]["kld_mean"] > 0
    assert not list((out / "scratch").glob("*.q4_0.gguf")), "nothing requantized"
    (refused,) = report.refused
    assert refused["key"] == "blk.0.attn_q.weight@q5_1"
    assert "holds it as q4_0, not q5_1" in refused["why"]


def test_ggml_numerics_are_recorded_and_a_resume_must_match(tmp_path: Path) -> None:
    """A sweep with numerics "ggml" records them and whose products with its baseline; resuming
    its journal with other numerics or another library's products is refused, as is "ggml" over
    dequantized storage."""
    model = ModelDir.write(tmp_path / "model", tiny_dense())
    recipe = Recipe.from_document({"quants": ["q4_0"], "tensors": [{"match": r"^blk\.0\.attn_q"}]})
    out = tmp_path / "out"
    ggml = SweepOptions(n_ctx=CTX, max_chunks=2, storage=Storage.NATIVE, numerics=Numerics.GGML)
    report = run_sweep(model.first, text=english(), recipe=recipe, out_dir=out, options=ggml)
    assert len(report.journal) == 1
    assert json.loads((out / "baseline.json").read_text())["numerics"] == "ggml"
    float_products = SweepOptions(
        n_ctx=CTX, max_chunks=2, storage=Storage.NATIVE, numerics=Numerics.EXACT
    )
    with pytest.raises(SweepError, match="computed with numerics 'ggml'"):
        run_sweep(model.first, text=english(), recipe=recipe, out_dir=out, options=float_products)
    assert json.loads((out / "protocol.json").read_text())["products"] == products(Numerics.GGML)
    stored = json.loads((out / "baseline.json").read_text())
    stored["protocol"]["products"] = "another libggml"
    (out / "baseline.json").write_text(json.dumps(stored))
    with pytest.raises(SweepError, match=r"products of another libggml.*--ggml"):
        run_sweep(model.first, text=english(), recipe=recipe, out_dir=out, options=ggml)
    dequantized = SweepOptions(
        n_ctx=CTX, max_chunks=2, numerics=Numerics.GGML, storage=Storage.DEQUANTIZED
    )
    with pytest.raises(SweepError, match="storage is dequantized, it needs native"):
        run_sweep(
            model.first, text=english(), recipe=recipe, out_dir=tmp_path / "o2", options=dequantized
        )
