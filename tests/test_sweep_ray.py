"""``ggufswap sweep --ray``: the sweep's rounds spread over Ray workers (a local cluster of a few
one-CPU workers on this machine) give the single-host sweep's files: the same rounds in the same
order with the same figures, byte-identical CSVs, also when a worker is killed mid-round."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import GGUFSWAP, wait_for
from runtime_helpers import ModelDir
from test_sweep import english

from ggufswap.shards import tiny_dense
from ggufswap.sweep import SweepError, SweepOptions, SweepReport, run_sweep
from ggufswap.sweep.recipe import Recipe, Round
from ggufswap.sweep.results import JOURNAL, KLD_CSV, PPL_CSV, write_text

ray = pytest.importorskip("ray", reason="the ray extra (ggufswap[ray]) is not installed")

from ggufswap.sweep.ray_driver import (  # noqa: E402 (after the importorskip)
    RayOptions,
    SweepWorker,
    WorkerInfo,
    run_ray_sweep,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]
# Ray's driver keeps sockets to the module's cluster open until ray.shutdown() at the module's end
ray_driver = pytest.mark.leaks_ok("the Ray driver's connections to the module's cluster")

CTX = 64
CHUNKS = 3
WAIT_S = 120.0
RECIPE = {  # 5 rounds, and all_ffn_up@q8_0 baseline-equivalent (the tensors are Q8_0 already)
    "quants": ["q4_0", "q5_1"],
    "tensors": [{"match": r"^blk\.\d+\.attn_q\.weight$"}],
    "groups": [
        {"name": "all_ffn_up", "match": [r"^blk\.\d+\.ffn_up\.weight$"], "quants": ["q4_0", "q8_0"]}
    ],
}
HOLDING = "holding"  # HoldingWorker's marker: the round it holds, swapped and not yet measured
SAME_FILES = (PPL_CSV, KLD_CSV, "baseline.logits", "protocol.json")


def options() -> SweepOptions:
    return SweepOptions(n_ctx=CTX, max_chunks=CHUNKS)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ModelDir.write(tmp_path_factory.mktemp("model"), tiny_dense()).first


@pytest.fixture(scope="module")
def single_host(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SweepReport]:
    out = tmp_path_factory.mktemp("single")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs
    try:
        report = run_sweep(
            model, text=english(), recipe=Recipe.from_document(RECIPE), out_dir=out,
            options=options(),
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert len(report.journal) == 5
    assert report.refused == []
    assert ("all_ffn_up", "q8_0") in {(s.unit, s.target) for s in report.skipped}
    return out, report


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A private local Ray cluster of 3 CPUs (one per worker); its address."""
    context = ray.init(
        address="local",  # never a cluster a previous run left in /tmp/ray/ray_current_cluster
        num_cpus=3,
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=False,
    )
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        ray.shutdown()


class HoldingWorker(SweepWorker):
    """Worker w2 holds its first round mid-way, after the swap committed and before measuring,
    until it is killed (at most WAIT_S); the others run rounds as usual."""

    def run_round(self, r: Round) -> tuple[str, Any]:
        if self.name == "w2" and not getattr(self, "held", False):
            self.held = True
            measure = self.target.measure

            def held(version: int, base: Any) -> dict[str, Any]:
                write_text(self.work_dir / HOLDING, r.key)
                time.sleep(WAIT_S)
                return measure(version, base)

            self.target.measure = held  # type: ignore[method-assign]
        return super().run_round(r)


# The workers cannot import this test module: they get HoldingWorker by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def journal_lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / JOURNAL).read_text().splitlines()]


def assert_same_sweep(out: Path, single: Path) -> None:
    """The same files as the single-host sweep: CSVs and report byte for byte, the journal's
    rounds in the same order with the same tensors and figures (bit for bit)."""
    for name in SAME_FILES:
        assert (out / name).read_bytes() == (single / name).read_bytes(), name
    # the report too, but for the disk high-water mark: the workers' scratch is on their nodes
    ray_report, single_report = (json.loads((d / "report.json").read_text()) for d in (out, single))
    assert ray_report.pop("disk") == {"high_water_bytes": 0}
    single_report.pop("disk")
    assert ray_report == single_report
    ours, theirs = journal_lines(out), journal_lines(single)
    assert [r["key"] for r in ours] == [r["key"] for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert (a["tensors"], a["metrics"], a["ppl_base"]) == (
            b["tensors"],
            b["metrics"],
            b["ppl_base"],
        ), a["key"]


@ray_driver
@pytest.mark.parametrize("death", ["sigkill", "round_timeout"])
def test_a_worker_lost_mid_round_loses_nothing_and_repeats_nothing(
    model: Path, single_host: tuple[Path, SweepReport], cluster: str, tmp_path: Path, death: str
) -> None:
    """w2 holds its first round swapped in (HoldingWorker) and is killed there: by the test
    (SIGKILL of its process) or by the driver (the round outlived ``round_timeout_s``). The round
    runs again on another worker and is recorded once; the files are the single-host sweep's."""
    single, _ = single_host
    out = tmp_path / "out"
    held: list[tuple[WorkerInfo, str]] = []

    def kill_w2_mid_round(worker: WorkerInfo, r: Round) -> None:
        if worker.name != "w2" or held:
            return
        marker = Path(worker.work_dir) / HOLDING
        wait_for(
            lambda: marker.exists() and marker.read_text() == r.key,
            timeout=WAIT_S,
            what=f"w2 to swap {r.key} in",
        )
        held.append((worker, r.key))
        if death == "sigkill":
            os.kill(worker.pid, signal.SIGKILL)

    # a round takes well under a second here; held, it would take WAIT_S
    round_timeout_s = 15.0 if death == "round_timeout" else WAIT_S * 2
    report = run_ray_sweep(
        model, text=english(), recipe=Recipe.from_document(RECIPE), out_dir=out,
        options=options(),
        ray_options=RayOptions(
            address=None, workers=3, threads=1, round_timeout_s=round_timeout_s
        ),
        on_dispatch=kill_w2_mid_round, worker_class=HoldingWorker,
    )  # fmt: skip
    assert len(held) == 1
    (dead, key) = held[0]
    # w2's first round: the third (rounds go out in recipe order; all_ffn_up@q8_0 is not one)
    assert key == "blk.0.attn_q.weight@q5_1"
    assert [(r["key"], r["worker"]) for r in report.retried] == [(key, "w2")]
    lines = journal_lines(out)
    assert len(lines) == len({r["key"] for r in lines}) == 5, "no lost and no duplicate round"
    assert_same_sweep(out, single)
    by_key = {r["key"]: r for r in lines}
    assert by_key[key]["worker"]["name"] != "w2", "retried on another worker"
    assert all(r["worker"]["pid"] != dead.pid for r in lines)
    wait_for(lambda: not alive(dead.pid), timeout=WAIT_S, what="w2's process to end")


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended


def test_sweep_command_over_three_workers_gives_the_single_host_files(
    model: Path, single_host: tuple[Path, SweepReport], cluster: str, tmp_path: Path
) -> None:
    """``ggufswap sweep --ray ADDRESS --ray-workers 3`` (joining the module's cluster as a second
    driver): every worker runs rounds, and the files are the single-host sweep's."""
    single, _ = single_host
    text = tmp_path / "english.txt"
    text.write_text(english(), encoding="utf-8")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps(RECIPE), encoding="utf-8")  # JSON is YAML
    out = tmp_path / "out"
    cmd = [
        GGUFSWAP, "sweep", "--model", str(model), "--text", str(text), "--recipe", str(recipe),
        "--out", str(out), "--ctx", str(CTX), "--chunks", str(CHUNKS), "--no-progress",
        "--threads", "1", "--ray", cluster, "--ray-workers", "3",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S * 2, check=False)
    assert done.returncode == 0, done.stderr
    assert "3 Ray workers" in done.stderr
    assert_same_sweep(out, single)
    ran = {r["worker"]["name"] for r in journal_lines(out)}
    assert ran == {"w0", "w1", "w2"}, "every worker took a round"
    summary = json.loads((out / "ray.json").read_text())
    assert [w["name"] for w in summary["workers"]] == ["w0", "w1", "w2"]
    assert summary["retried"] == []
    assert "5 of 5 rounds recorded" in done.stdout


def test_the_single_host_sweep_never_imports_ray() -> None:
    code = (
        "import sys\n"
        "import ggufswap.sweep.sweep, ggufswap._cmd_sweep, ggufswap.sweep.procs\n"
        "from ggufswap.main import build_parser\n"
        "build_parser()\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S, check=False
    )
    assert done.returncode == 0, done.stderr


@ray_driver
def test_a_worker_without_the_model_stops_the_sweep_naming_it(cluster: str, tmp_path: Path) -> None:
    """Every node needs the model at the same path: a worker that cannot open it is named."""
    missing = tmp_path / "elsewhere" / "model.gguf"
    with pytest.raises(
        SweepError,
        match=r"sweep worker w0 did not start on .*: ShardError: .*model\.gguf: no such file",
    ):
        run_ray_sweep(
            missing, text=english(), recipe=Recipe.from_document(RECIPE), out_dir=tmp_path / "o",
            options=options(), ray_options=RayOptions(address=None, workers=1, threads=1),
        )  # fmt: skip
    assert not (tmp_path / "o" / JOURNAL).exists()


def test_ray_usage_errors_are_named(tmp_path: Path) -> None:
    cmd = [
        GGUFSWAP, "sweep", "--config", str(tmp_path / "c.yaml"), "--text", str(tmp_path / "t"),
        "--recipe", str(tmp_path / "r"), "--out", str(tmp_path / "o"), "--ray", "auto",
        "--ray-workers", "0",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S, check=False)
    assert done.returncode == 2
    assert "--ray runs in-process workers (--model)" in done.stderr
    assert "--ray-workers must be >= 1" in done.stderr
