"""``ggufswap perplexity``: perplexity of a GGUF model on English text already on the machine
(Python's LICENSE), once, or again after every committed hot-swap plan."""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from processes import Proc, run_ggufswap, status_of, wait_for
from runtime_helpers import ModelDir, Q, one_thread

from ggufswap.config import Storage
from ggufswap.ipc import DealerClient, Fields, MessageType, make_message, plan_to_wire
from ggufswap.ipc.plan import Plan
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models import HParams, build_model
from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.perplexity import (
    NllStats,
    batch_nll,
    eval_batch,
    scored_per_chunk,
    text_chunks,
    text_tokens,
)
from ggufswap.shards import tiny_dense

pytestmark = [pytest.mark.process, pytest.mark.usefixtures(one_thread.__name__)]

WAIT_S = 60.0
CTX = 64
BATCH = 4
SWAPPED = "blk.1.ffn_down.weight"
ENV = {"OMP_NUM_THREADS": "1"}  # the same thread count as the in-process reference


def license_text() -> str:
    """Python's LICENSE: its history section is plain English prose."""
    path = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    if not path.exists():
        pytest.skip(f"no English text to evaluate on: {path} is missing")
    return path.read_text(encoding="utf-8")


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    """The LICENSE's first 3000 characters (a few thousand tiny-vocabulary tokens)."""
    path = tmp_path / "english.txt"
    path.write_text(license_text()[:3000], encoding="utf-8")
    return path


def reference(
    first: Path, text: Path, *, ctx: int = CTX, batch: int = BATCH, numerics: str = "ggml"
) -> float:
    """The perplexity of a fresh in-process load of the files as they are now (llama-perplexity's
    chunks, BOS first, the second half of each scored)."""
    storage = Storage.NATIVE if numerics == "ggml" else Storage.DEQUANTIZED
    runtime = HotSwapRuntime.open(first, storage=storage)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(
            HParams.from_metadata(runtime.shards.metadata),
            runtime.store,
            store=runtime.store,
            numerics=numerics,
        )
        tokens, bos = text_tokens(GgufTokenizer.from_file(first), text.read_text())
        total = NllStats()
        for batch_tokens in eval_batch(text_chunks(tokens, n_ctx=ctx), bos).split(batch):
            total = total + batch_nll(model, batch_tokens)
        return total.perplexity
    finally:
        runtime.close()


def ggufswap(*args: str) -> subprocess.CompletedProcess[str]:
    return run_ggufswap(*args, timeout=WAIT_S, env=ENV)


def test_perplexity_of_a_model_on_english_text(tmp_path: Path, text_file: Path) -> None:
    """The command prints the perplexity of the model on the text, equal to an in-process
    evaluation of the same chunks; every chunk scores its second half (llama-perplexity's)."""
    models = ModelDir.write(tmp_path / "model", tiny_dense())
    run = ggufswap(
        "perplexity", "--model", str(models.first), "--text", str(text_file),
        "--ctx", str(CTX), "--batch", str(BATCH), "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    result = json.loads(line)
    assert result["weight_version"] == 0
    assert result["ctx"] == CTX
    assert result["chunks"] > 10
    assert result["numerics"] == "ggml", "llama.cpp's rounding by default"
    assert result["tokens"] == result["chunks"] * scored_per_chunk(CTX)
    assert result["perplexity"] == pytest.approx(reference(models.first, text_file), rel=1e-9)
    plain = ggufswap("perplexity", "--model", str(models.first), "--text", str(text_file))
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.startswith("weight_version 0: perplexity ")


def test_perplexity_with_exact_numerics(tmp_path: Path, text_file: Path) -> None:
    """--numerics exact evaluates with float products: the in-process figure of a decoder with
    those numerics, close to the default (llama.cpp's rounding) but not equal to it."""
    models = ModelDir.write(tmp_path / "model", tiny_dense())
    run = ggufswap(
        "perplexity", "--model", str(models.first), "--text", str(text_file),
        "--ctx", str(CTX), "--batch", str(BATCH), "--json", "--numerics", "exact",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    ppl = json.loads(run.stdout)["perplexity"]
    assert ppl == pytest.approx(reference(models.first, text_file, numerics="exact"), rel=1e-9)
    ggml = reference(models.first, text_file)
    assert ppl != ggml
    assert ppl == pytest.approx(ggml, rel=1e-2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--text", "{text}"], "--model"),
        (["--model", "{model}", "--text", "{text}", "--hot-swap"], "--hot-swap needs --config"),
        (["--model", "{model}", "--text", "{missing}"], "missing.txt"),
        (["--model", "{model}", "--text", "{text}", "--ctx", "1"], "--ctx"),
    ],
    ids=["no-model", "hot-swap-without-config", "missing-text", "tiny-ctx"],
)
def test_usage_errors_exit_2_and_say_why(
    tmp_path: Path, text_file: Path, args: list[str], message: str
) -> None:
    """A missing model, a hot-swap without a config, an unreadable text or a ctx below 4 exits 2
    with a message naming the problem."""
    model = tmp_path / "model.gguf"
    values = {"model": str(model), "text": str(text_file), "missing": str(tmp_path / "missing.txt")}
    run = ggufswap("perplexity", *(a.format(**values) for a in args))
    assert run.returncode == 2, run.stderr
    assert message in run.stderr


def send_plan(control: str, plan: Plan) -> dict[str, Any]:
    """Send ``plan`` over the control socket and return its final reply."""
    with DealerClient(control) as client:
        client.send(make_message(MessageType.PLAN, **plan_to_wire(plan)))
        final = {MessageType.COMMITTED.value, MessageType.REJECTED.value}
        reply: dict[str, Any] = wait_for(
            lambda: (r := client.poll(0.2)) is not None and r[Fields.TYPE] in final and r,
            timeout=WAIT_S,
            what=f"the final reply to plan {plan.plan_id}",
        )
        return reply


def results(control: str) -> dict[str, Any]:
    status = status_of(control)
    return {} if status is None else dict(status["perplexity"]["results"])


def test_hot_swap_mode_evaluates_again_after_every_committed_plan(
    tmp_path: Path, text_file: Path
) -> None:
    """In hot-swap mode the command evaluates once, then again after each committed plan: a
    re-quantized tensor gives the perplexity of a fresh load of the new files, and swapping it
    back gives the first figure again."""
    models = ModelDir.write(tmp_path / "model", tiny_dense())
    saved = models.save(SWAPPED, tmp_path / "saved")
    control = f"ipc://{tmp_path}/run/rt.sock"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"runtime:\n  name: tiny\n  model: {models.first}\n  control_endpoint: {control}\n"
    )
    proc = Proc(
        ["perplexity", "--config", str(config), "--text", str(text_file), "--ctx", str(CTX),
         "--batch", str(BATCH), "--json", "--hot-swap", "--numerics", "exact"],
        log=tmp_path / "perplexity.log",
        env=ENV,
    )  # fmt: skip
    try:
        wait_for(lambda: "0" in results(control), timeout=WAIT_S, what="the first evaluation")
        models.put(SWAPPED, models.variant(SWAPPED, Q.Q4_0, tmp_path / "variants"))
        expected_swapped = reference(models.first, text_file, numerics="exact")
        reply = send_plan(control, models.plan("to-q4_0", [SWAPPED]))
        assert reply[Fields.TYPE] == MessageType.COMMITTED.value, reply
        wait_for(lambda: "1" in results(control), timeout=WAIT_S, what="the second evaluation")
        models.put(SWAPPED, saved)
        assert send_plan(control, models.plan("back", [SWAPPED]))[Fields.WEIGHT_VERSION] == 2
        wait_for(lambda: "2" in results(control), timeout=WAIT_S, what="the third evaluation")
        found = results(control)
    finally:
        code = proc.stop()
    assert code == 0, proc.log()
    ppl = {int(v): r["perplexity"] for v, r in found.items()}
    assert ppl[1] != ppl[0], "the swap changed nothing"
    assert ppl[1] == pytest.approx(expected_swapped, rel=1e-9)
    assert ppl[2] == ppl[0]
    assert [found[v]["plans"] for v in ("0", "1", "2")] == [[], ["to-q4_0"], ["back"]]
    printed = [json.loads(line) for line in proc.log().splitlines() if '"perplexity"' in line]
    assert [p["weight_version"] for p in printed] == [0, 1, 2]


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_perplexity_on_english_text(tmp_path: Path, real_gemma: Path) -> None:
    """Gemma 3 270M scores Python's LICENSE in the range of a small model (3 to 30), one chunk of
    128 tokens, its second half scored, llama.cpp's rounding."""
    text = tmp_path / "license.txt"
    text.write_text(license_text(), encoding="utf-8")
    run = run_ggufswap(
        "perplexity", "--model", str(real_gemma), "--text", str(text), "--ctx", "128",
        "--chunks", "1", "--json", timeout=800, env=ENV,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    result = json.loads(line)
    assert (result["chunks"], result["tokens"]) == (1, scored_per_chunk(128))
    assert 3.0 < result["perplexity"] < 30.0, result


def test_progress_lines_when_not_on_a_terminal(tmp_path: Path, text_file: Path) -> None:
    """Off a terminal, the load and the evaluation log structured progress lines (done, total,
    rate, time left) at the configured interval."""
    models = ModelDir.write(tmp_path / "model", tiny_dense())
    run = run_ggufswap(
        "perplexity", "--model", str(models.first), "--text", str(text_file),
        "--ctx", str(CTX), "--batch", "1", "--json", timeout=WAIT_S,
        env={**ENV, "GGUFSWAP_PROGRESS_INTERVAL_S": "1e-9"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    for event, unit in (("load.progress", "B"), ("perplexity.progress", "chunks")):
        seen = [line for line in lines if line.get("event") == event]
        assert seen, f"no {event} line in:\n{run.stderr}"
        assert {"done", "total", "percent", "rate", "eta_s"} <= set(seen[-1])
        assert seen[-1]["unit"] == unit
        assert 0 < seen[-1]["done"] <= seen[-1]["total"]


def test_perplexity_equals_the_sweep_baseline(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ggufswap perplexity`` and a sweep's baseline give the same PPL, bit for bit, for the same
    model, text, context and chunks (one protocol, one NLL, one default numerics)."""
    from ggufswap.main import build_parser
    from ggufswap.sweep import Recipe, SweepOptions, run_sweep

    models = ModelDir.write(tmp_path / "model", tiny_dense())
    args = build_parser().parse_args(
        ["perplexity", "--model", str(models.first), "--text", str(text_file),
         "--ctx", str(CTX), "--chunks", "3", "--json"]
    )  # fmt: skip
    assert args.func(args) == 0  # the command, in this process (its logging left as it is)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = run_sweep(
        models.first,
        text=text_file.read_text(encoding="utf-8"),
        recipe=Recipe.from_document({"quants": ["q4_0"], "tensors": [{"match": "^x$"}]}),
        out_dir=tmp_path / "sweep",
        options=SweepOptions(n_ctx=CTX, max_chunks=3),
    )
    assert printed["numerics"] == report.protocol["numerics"] == "ggml"
    assert printed["chunks"] == report.protocol["n_chunk"] == 3
    assert printed["perplexity"] == report.ppl_base
