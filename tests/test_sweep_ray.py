"""``ggufswap sweep --ray``: on a local multi-node Ray cluster (a 0-CPU head and two one-CPU
nodes, one per module), the sweep's rounds spread over one worker per node give the single-host
sweep's files whatever evaluation options it is given; the baseline never passes through the
driver (its peak memory does not grow with the baseline); workers that cannot be placed end the
sweep in the configured time with one line; a killed worker is replaced by Ray and its round
retried, nothing lost or repeated."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import GGUFSWAP, run_ggufswap, wait_for
from runtime_helpers import ModelDir
from test_sweep import english

from ggufswap.runtime.models import Numerics
from ggufswap.shards import Layout, Role, tiny_dense, write_model
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.writer import F32_ROLES
from ggufswap.sweep import GgufSet, SweepError, SweepOptions, run_sweep
from ggufswap.sweep.recipe import Recipe, Round
from ggufswap.sweep.results import JOURNAL, KLD_CSV, PPL_CSV, write_text

ray = pytest.importorskip("ray", reason="the ray extra (ggufswap[ray]) is not installed")

from ray.cluster_utils import Cluster  # noqa: E402 (after the importorskip)

from ggufswap.sweep.ray_driver import (  # noqa: E402
    RayOptions,
    SweepWorker,
    WorkerInfo,
    run_ray_sweep,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]
# Ray's driver keeps sockets to the module's cluster open until ray.shutdown() at the module's end
ray_driver = pytest.mark.leaks_ok("the Ray driver's connections to the module's cluster")

WAIT_S = 120.0
RECIPE = {"quants": ["q4_0"], "tensors": [{"match": r"^blk\.\d+\.attn_q\.weight$"}]}  # 2 rounds
COMMON = ("--ctx", "64", "--chunks", "3", "--no-progress", "--no-plot", "--threads", "1")
SAME_FILES = (PPL_CSV, KLD_CSV, "baseline.logits", "protocol.json")
SAME_BASELINE = ("identity", "numerics", "protocol", "ppl", "digests", "model_vs_baseline")
HELD = "held"  # HoldingWorker's marker in its work dir: the round it held (once per work dir)


@dataclass(frozen=True)
class Files:
    root: Path
    model: Path
    q4: Path  # the model with attn_q in Q4_0 (a --source)
    reference: Path  # the model in F16 (a --baseline)
    text: Path
    recipe: Path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("ray-files")
    every = {r.name: "f16" for r in Role if r not in F32_ROLES}
    (reference,) = write_model(tiny_dense().with_types(**every), root / "ref", layout=Layout.SINGLE)
    text, recipe = root / "english.txt", root / "recipe.yaml"
    text.write_text(english(), encoding="utf-8")
    recipe.write_text(json.dumps(RECIPE), encoding="utf-8")  # JSON is YAML
    return Files(
        root=root,
        model=ModelDir.write(root / "model", tiny_dense()).first,
        q4=ModelDir.write(root / "q4", tiny_dense().with_types(attn_q="q4_0")).first,
        reference=Path(reference),
        text=text,
        recipe=recipe,
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A private multi-node Ray cluster: a head with no CPUs (as a large cluster's) and two
    nodes of one CPU; this process is its driver; the cluster's address."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            c.add_node(num_cpus=1)
        c.wait_for_nodes()
        ray.init(
            address=c.address, include_dashboard=False, logging_level="warning",
            log_to_driver=False,
        )  # fmt: skip
        yield str(c.address)
    finally:
        ray.shutdown()
        c.shutdown()


def sweep_cli(
    files: Files, out: Path, *args: str, ray_address: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``ggufswap sweep`` (over the cluster with ``ray_address``), which must succeed."""
    cmd = [
        "sweep", "--model", str(files.model), "--text", str(files.text),
        "--recipe", str(files.recipe), "--out", str(out), *COMMON, *args,
    ]  # fmt: skip
    if ray_address is not None:
        cmd += ["--ray", ray_address]
    done = run_ggufswap(*cmd, timeout=WAIT_S * 2)
    assert done.returncode == 0, done.stderr
    return done


def journal_lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / JOURNAL).read_text().splitlines()]


def assert_same_sweep(out: Path, single: Path) -> None:
    """The same files as the single-host sweep: CSVs, base file and report byte for byte, the
    baseline's record, the journal's rounds in the same order with the same figures."""
    for name in SAME_FILES:
        assert (out / name).read_bytes() == (single / name).read_bytes(), name
    # the report too, but for the disk high-water mark: the workers' scratch is on their nodes
    ray_report, single_report = (json.loads((d / "report.json").read_text()) for d in (out, single))
    assert ray_report.pop("disk") == {"high_water_bytes": 0}
    single_report.pop("disk")
    assert ray_report == single_report
    ours, theirs = (json.loads((d / "baseline.json").read_text()) for d in (out, single))
    assert {k: ours.get(k) for k in SAME_BASELINE} == {k: theirs.get(k) for k in SAME_BASELINE}
    ours, theirs = journal_lines(out), journal_lines(single)
    assert [r["key"] for r in ours] == [r["key"] for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert (a["tensors"], a["metrics"]) == (b["tensors"], b["metrics"]), a["key"]


@dataclass(frozen=True)
class Case:
    """Evaluation options, as flags of ``ggufswap sweep --ray`` and as the single-host sweep's
    arguments, and what ``baseline.json`` must then say."""

    flags: tuple[str, ...]
    options: dict[str, Any]
    baseline: bool  # --baseline REF and --source q4_0=Q4
    expect: dict[str, Any]
    resume: bool = False  # then resume the single-host sweep's output with --ray


CASES = {
    "ggml numerics, ctx 32 x 2 chunks, all verified, a baseline model and a source": Case(
        flags=("--ctx", "32", "--chunks", "2", "--verify-chunks", "0"),
        options={"n_ctx": 32, "max_chunks": 2, "verify_chunks": 0},
        baseline=True,
        expect={"numerics": "ggml"},
    ),
    "exact numerics, resumed": Case(
        flags=("--numerics", "exact"),
        options={"numerics": Numerics.EXACT},
        baseline=False,
        expect={"numerics": "exact"},
        resume=True,
    ),
}


@ray_driver
@pytest.mark.parametrize(
    "case", [next(iter(CASES)), pytest.param(list(CASES)[1], marks=pytest.mark.slow)]
)
def test_ray_sweep_honours_the_single_host_options(
    files: Files, cluster: str, tmp_path: Path, case: str
) -> None:
    """``ggufswap sweep --ray`` over one worker per CPU node gives the single-host sweep's files
    for each evaluation option (numerics, ctx, chunks, verify chunks, threads, baseline model,
    sources)."""
    c = CASES[case]
    flags = list(c.flags)
    if c.baseline:
        flags += ["--baseline", str(files.reference), "--source", f"q4_0={files.q4}"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs (--threads 1)
    try:
        run_sweep(
            files.model, text=english(), recipe=Recipe.from_document(RECIPE),
            out_dir=tmp_path / "single",
            options=SweepOptions(**{"n_ctx": 64, "max_chunks": 3, **c.options}),
            models={int(GGMLType.Q4_0): GgufSet(files.q4)} if c.baseline else None,
            baseline_model=str(files.reference) if c.baseline else None,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    done = sweep_cli(files, tmp_path / "ray", *flags, ray_address=cluster)
    assert "2 Ray workers on 2 node(s)" in done.stderr
    assert_same_sweep(tmp_path / "ray", tmp_path / "single")
    baseline = json.loads((tmp_path / "ray" / "baseline.json").read_text())
    assert {k: baseline[k] for k in c.expect} == c.expect
    if c.baseline:
        assert baseline["protocol"]["baseline_model"] == str(files.reference)
        sources = [Path(r["sources"][0]).parent for r in journal_lines(tmp_path / "ray")]
        assert sources == [files.q4.parent] * 2, "the rounds' tensors come from the source"
    summary = json.loads((tmp_path / "ray" / "ray.json").read_text())
    nodes = {w["node_id"] for w in summary["workers"]}
    assert len(nodes) == 2, "one worker on each node with CPUs, none on the 0-CPU head"
    assert summary["retried"] == summary["restarts"] == []
    if c.resume:  # the single-host sweep, its last round lost, resumed with --ray
        resumed = tmp_path / "resumed"
        shutil.copytree(tmp_path / "single", resumed)
        first, _ = (resumed / JOURNAL).read_text().splitlines(keepends=True)
        (resumed / JOURNAL).write_text(first)
        again = sweep_cli(files, resumed, *flags, ray_address=cluster)
        assert "2 of 2 rounds recorded (1 now, 1 from the journal)" in again.stdout
        for name in SAME_FILES:
            assert (resumed / name).read_bytes() == (tmp_path / "single" / name).read_bytes()


def peak_rss_kib(cmd: list[str]) -> int:
    """The peak RSS (``ru_maxrss``, KiB) of ``cmd``'s process, which must succeed."""
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        assert proc.stderr is not None
        deadline = time.monotonic() + WAIT_S * 2
        while (done := os.wait4(proc.pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the sweep did not end in time"
            time.sleep(0.2)
        _, status, usage = done
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.returncode == 0, proc.stderr.read().decode()
    return int(usage.ru_maxrss)


@ray_driver
@pytest.mark.slow  # two sweeps of a 100k-vocabulary model: about a minute here
def test_the_driver_memory_does_not_grow_with_the_baseline(
    cluster: str, tmp_path: Path, files: Files
) -> None:
    """The workers compute the baseline on their nodes and the driver copies it piece by piece:
    its peak RSS grows by well under a byte per baseline byte (the old driver: ~2.7)."""
    model = ModelDir.write(tmp_path / "big", tiny_dense(extra_vocab_strings=100_000)).first
    recipe = tmp_path / "one-round.yaml"
    recipe.write_text(json.dumps({"quants": ["q4_0"], "tensors": [{"match": "blk.0.attn_q"}]}))
    peaks, sizes = {}, {}
    for chunks in (2, 8):
        out = tmp_path / f"out{chunks}"
        cmd = [
            GGUFSWAP, "sweep", "--model", str(model), "--text", str(files.text), "--recipe",
            str(recipe), "--out", str(out), "--ctx", "64", "--chunks", str(chunks),
            "--numerics", "exact", "--no-progress", "--no-plot", "--threads", "1",
            "--ray", cluster,
        ]  # fmt: skip
        peaks[chunks] = peak_rss_kib(cmd) * 1024
        sizes[chunks] = (out / "baseline.logits").stat().st_size
    grown = (peaks[8] - peaks[2]) / (sizes[8] - sizes[2])
    print(
        f"driver peak RSS {peaks[2] / 1e6:.0f} MB with a {sizes[2] / 1e6:.1f} MB baseline, "
        f"{peaks[8] / 1e6:.0f} MB with {sizes[8] / 1e6:.1f} MB: {grown:.3f} bytes per byte"
    )
    assert sizes[8] > 3 * sizes[2]
    assert grown < 0.25, f"the driver's peak grew {grown:.2f} bytes per baseline byte"


def test_unplaceable_workers_end_the_sweep_with_one_line(
    cluster: str, files: Files, tmp_path: Path
) -> None:
    """Three one-CPU workers on a cluster of two free CPUs (a 0-CPU head): the sweep ends after
    the placement timeout with one line naming what was asked and what is free."""
    done = run_ggufswap(
        "sweep", "--model", str(files.model), "--text", str(files.text), "--recipe",
        str(files.recipe), "--out", str(tmp_path / "o"), *COMMON, "--ray", cluster,
        "--ray-workers", "3", "--ray-placement-timeout", "2", timeout=WAIT_S,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "cannot place 3 sweep worker(s) of CPU 1 each" in lines[0]
    assert "not placed within 2 s" in lines[0]
    assert "the cluster has free CPU 2" in lines[0]
    assert ": CPU 0, memory" in lines[0] or ": memory" in lines[0], "the 0-CPU head is listed"
    assert not (tmp_path / "o" / JOURNAL).exists()


class HoldingWorker(SweepWorker):
    """Worker w1 holds its first round mid-way, after the swap committed and before measuring,
    until it is killed (at most WAIT_S), once per work directory: its replacement does not."""

    def run_round(self, r: Round, expect: Any) -> tuple[str, Any, dict[str, Any]]:
        marker = self.work_dir / HELD
        if self.name == "w1" and self.error is None and not marker.exists():
            measure = self.target.measure

            def held(version: int, base: Any) -> dict[str, Any]:
                write_text(marker, r.key)
                time.sleep(WAIT_S)
                return measure(version, base)

            self.target.measure = held  # type: ignore[method-assign]
        return super().run_round(r, expect)


# The workers cannot import this test module: they get HoldingWorker by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray_driver
@pytest.mark.parametrize("death", ["sigkill", pytest.param("timeout", marks=pytest.mark.slow)])
def test_a_killed_worker_is_replaced_and_its_round_retried_once(
    files: Files, cluster: str, tmp_path: Path, death: str
) -> None:
    """w1 holds its first round swapped in and is killed there: by the test (SIGKILL of its
    process) or by the driver (the round outlived ``round_timeout_s``). Ray restarts w1 and runs
    the round again on the replacement; it is recorded once and the files are the single-host
    sweep's (4 rounds over 2 workers)."""
    single = tmp_path / "single"
    sweep_cli(files, single, "--numerics", "exact")
    out = tmp_path / "out"
    held: list[tuple[WorkerInfo, str]] = []

    def kill_w1_mid_round(worker: WorkerInfo, r: Round) -> None:
        if worker.name != "w1" or held:
            return
        marker = Path(worker.work_dir) / HELD
        wait_for(marker.exists, timeout=WAIT_S, what=f"w1 to swap {r.key} in")
        held.append((worker, marker.read_text()))
        if death == "sigkill":
            os.kill(worker.pid, signal.SIGKILL)

    lines: list[str] = []
    report = run_ray_sweep(
        files.model, text=english(), recipe=Recipe.from_document(RECIPE), out_dir=out,
        options=SweepOptions(n_ctx=64, max_chunks=3, numerics=Numerics.EXACT),
        ray_options=RayOptions(
            address=None, threads=1, round_timeout_s=20.0 if death == "timeout" else WAIT_S
        ),
        on_dispatch=kill_w1_mid_round, worker_class=HoldingWorker, announce=lines.append,
    )  # fmt: skip
    print("\n".join(lines))
    assert len(held) == 1
    dead, key = held[0]
    assert key == "blk.1.attn_q.weight@q4_0", "w1's first round: the second"
    assert report.retried == [{"key": key, "worker": "w1", "attempt": 2}]
    (restart,) = report.restarts
    assert restart["worker"] == "w1"
    assert restart["pid_before"] == dead.pid != restart["pid"]
    assert report.dead == []
    records = journal_lines(out)
    assert len(records) == len({r["key"] for r in records}) == 2, "no lost and no duplicate round"
    by_key = {r["key"]: r for r in records}
    assert by_key[key]["worker"]["name"] == "w1"
    assert by_key[key]["worker"]["pid"] == restart["pid"], "run by w1's replacement"
    assert by_key[key]["worker"]["restarted"] is True
    assert_same_sweep(out, single)
    assert any("restarted by Ray" in line and "1 restarted" in line for line in lines), lines
    assert any(f"round {key} retried by Ray" in line for line in lines), lines
    summary = json.loads((out / "ray.json").read_text())
    assert summary["retried"] == report.retried


class DyingWorker(SweepWorker):
    """Worker w0's process exits in the middle of every attempt at round blk.0's q4_0."""

    def run_round(self, r: Round, expect: Any) -> tuple[str, Any, dict[str, Any]]:
        if self.name == "w0" and r.key == "blk.0.attn_q.weight@q4_0":
            os._exit(1)
        return super().run_round(r, expect)


@ray_driver
@pytest.mark.slow  # two restarts of w0: about 20 s here
def test_a_round_that_takes_its_worker_down_every_time_is_refused(
    files: Files, cluster: str, tmp_path: Path
) -> None:
    """A round whose process dies on every attempt Ray makes (``max_round_failures``: 2) is
    reported as refused with the reason; the worker, restarted, goes on; the other round is
    recorded."""
    report = run_ray_sweep(
        files.model, text=english(), recipe=Recipe.from_document(RECIPE),
        out_dir=tmp_path / "out", options=SweepOptions(n_ctx=64, max_chunks=3),
        ray_options=RayOptions(address=None, threads=1, max_round_failures=2),
        worker_class=DyingWorker,
    )  # fmt: skip
    assert report.refused == [
        {
            "key": "blk.0.attn_q.weight@q4_0",
            "tensors": ["blk.0.attn_q.weight"],
            "why": "blk.0.attn_q.weight@q4_0: its worker died in each of 2 attempts",
        }
    ]
    assert list(report.journal) == ["blk.1.attn_q.weight@q4_0"]
    assert report.dead == []
    assert [r["worker"] for r in report.restarts] == ["w0"]


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
            options=SweepOptions(n_ctx=64, max_chunks=3),
            ray_options=RayOptions(address=None, workers=1, threads=1),
        )  # fmt: skip
    assert not (tmp_path / "o" / JOURNAL).exists()


def test_ray_usage_errors_are_named(tmp_path: Path) -> None:
    done = run_ggufswap(
        "sweep", "--config", str(tmp_path / "c.yaml"), "--text", str(tmp_path / "t"),
        "--recipe", str(tmp_path / "r"), "--out", str(tmp_path / "o"), "--ray", "auto",
        "--ray-workers", "0", "--ray-placement-timeout", "0", timeout=WAIT_S,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--ray runs in-process workers (--model)" in done.stderr
    assert "--ray-workers must be >= 1" in done.stderr
    assert "--ray-placement-timeout must be > 0" in done.stderr
