"""The runtime's CPU thread policy: the count comes from --threads, runtime.threads,
OMP_NUM_THREADS or the CPU affinity, in that order, and the runtime applies it at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from processes import PROBE, Proc, run_ggufswap, wait_for
from runtime_helpers import ModelDir

from ggufswap.config import MAX_THREADS
from ggufswap.runtime.threads import ThreadPolicy, ThreadSource, resolve_threads
from ggufswap.shards import tiny_dense

NO_ENV: dict[str, str] = {}  # an environment without OMP_NUM_THREADS
WAIT_S = 60.0


def python(code: str, *, env: dict[str, str] | None = None) -> str:
    """Run ``code`` in a fresh interpreter (torch's thread pools untouched); the last line it
    prints (library log lines go to stderr while structlog is unconfigured)."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | (env or {}),
        check=False,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()[-1]


def thread_events(log: str) -> list[dict[str, Any]]:
    """The ``runtime.threads`` events among a process's JSON log lines."""
    events = []
    for line in log.splitlines():
        if line.startswith("{") and '"runtime.threads"' in line:
            events.append(json.loads(line))
    return events


# --- deciding the count -----------------------------------------------------------------------


def test_auto_counts_the_cpus_of_the_affinity_mask() -> None:
    """Without an explicit count, the policy runs one thread per CPU the process may use."""
    policy = resolve_threads(environ=NO_ENV)
    assert policy == ThreadPolicy(
        threads=len(os.sched_getaffinity(0)),
        source=ThreadSource.AFFINITY,
        cpus=len(os.sched_getaffinity(0)),
    )
    assert "affinity" in policy.reason


@pytest.mark.process
def test_auto_follows_a_narrowed_affinity_mask() -> None:
    """A process confined to one CPU (taskset, CPUAffinity=) gets one thread, not the machine's."""
    cpu = min(os.sched_getaffinity(0))
    out = python(
        f"""
        import os
        os.sched_setaffinity(0, {{{cpu}}})
        from ggufswap.runtime.threads import resolve_threads
        policy = resolve_threads()
        print(policy.threads, policy.source.name, policy.cpus)
        """
    )
    assert out.split() == ["1", "AFFINITY", "1"]


def test_flag_beats_config_beats_environment_beats_affinity() -> None:
    """--threads wins over runtime.threads, which wins over OMP_NUM_THREADS, then the affinity."""
    env = {"OMP_NUM_THREADS": "3"}
    assert resolve_threads(flag=5, config=4, environ=env).source is ThreadSource.FLAG
    assert resolve_threads(flag=5, config=4, environ=env).threads == 5
    assert resolve_threads(config=4, environ=env).source is ThreadSource.CONFIG
    assert resolve_threads(config=4, environ=env).threads == 4
    assert resolve_threads(environ=env).source is ThreadSource.ENVIRONMENT
    assert resolve_threads(environ=env).threads == 3
    assert resolve_threads(environ={"OMP_NUM_THREADS": "2,1"}).threads == 2  # nested: outer level


@pytest.mark.parametrize("value", ["", "0", "-1", "two", "１", "9" * 5000, str(MAX_THREADS + 1)])
def test_an_environment_value_that_is_no_count_is_passed_over(value: str) -> None:
    """An OMP_NUM_THREADS that is not a count in range leaves the decision to the affinity."""
    policy = resolve_threads(environ={"OMP_NUM_THREADS": value})
    assert policy.source is ThreadSource.AFFINITY


def test_an_explicit_count_above_the_cpus_is_kept_and_flagged() -> None:
    """An explicit count larger than the CPUs is honoured, and its reason says it is too many."""
    cpus = len(os.sched_getaffinity(0))
    policy = resolve_threads(config=cpus + 1, environ=NO_ENV)
    assert (policy.threads, policy.oversubscribed) == (cpus + 1, True)
    assert f"more than the {cpus} CPU(s)" in policy.reason
    assert not resolve_threads(config=1, environ=NO_ENV).oversubscribed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"flag": 0}, "--threads: expected an integer between 1 and 1024"),
        ({"config": -2}, "runtime.threads: expected an integer between 1 and 1024"),
        ({"config": MAX_THREADS + 1}, "found 1025"),
        ({"flag": True}, "found True"),
        ({"config": 2.0}, "found 2.0"),
    ],
    ids=["zero", "negative", "too-many", "bool", "float"],
)
def test_invalid_explicit_counts_are_refused(kwargs: dict[str, Any], message: str) -> None:
    """A count outside 1..MAX_THREADS, or not an integer, raises ValueError naming its source."""
    with pytest.raises(ValueError, match="expected an integer") as info:
        resolve_threads(**kwargs)
    assert message in str(info.value)


def test_every_invalid_count_is_reported_at_once() -> None:
    """A bad flag and a bad config value are both named in one error."""
    with pytest.raises(ValueError, match=r"--threads: .*; runtime\.threads: "):
        resolve_threads(flag=0, config=0)


# --- applying it ------------------------------------------------------------------------------


@pytest.mark.process
def test_apply_sets_intra_and_inter_op_threads_in_a_fresh_process() -> None:
    """Applied before any torch work, the policy sets both of torch's thread counts."""
    out = python(
        """
        import torch
        from ggufswap.runtime.threads import apply_thread_policy, resolve_threads
        applied = apply_thread_policy(resolve_threads(flag=1))
        print(torch.get_num_threads(), torch.get_num_interop_threads(), applied.inter_op_set)
        """
    )
    assert out.split() == ["1", "1", "True"]


@pytest.mark.process
def test_apply_after_the_inter_op_pool_started_keeps_it_and_says_so() -> None:
    """Once torch's inter-op pool runs it cannot be resized: the intra-op count is still set."""
    out = python(
        """
        import torch
        torch.set_num_interop_threads(3)  # torch allows this once
        from ggufswap.runtime.threads import apply_thread_policy, resolve_threads
        applied = apply_thread_policy(resolve_threads(flag=1))
        print(torch.get_num_threads(), torch.get_num_interop_threads(), applied.inter_op_set)
        """
    )
    assert out.split() == ["1", "3", "False"]


@pytest.mark.process
def test_perplexity_command_applies_and_logs_the_flag(tmp_path: Path) -> None:
    """`ggufswap perplexity --threads 1` runs on one thread and logs the count and its source."""
    models = ModelDir.write(tmp_path / "model", tiny_dense())
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    run = run_ggufswap(
        "perplexity", "--model", models.first, "--text", text, "--ctx", "16", "--threads", "1",
        timeout=WAIT_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (event,) = thread_events(run.stderr)
    assert (event["threads"], event["source"]) == (1, "--threads")
    assert event["cpus"] == len(os.sched_getaffinity(0))


@pytest.mark.process
def test_runtime_applies_the_config_key_before_loading(tmp_path: Path) -> None:
    """`ggufswap runtime` with runtime.threads: 1 logs the policy before it is ready."""
    models = ModelDir.write(tmp_path / "model", tiny_dense())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"runtime:\n  model: {models.first}\n  control_endpoint: ipc://{run_dir}/rt.sock\n"
        "  threads: 1\n"
    )
    proc = Proc(
        ["runtime", "--config", str(config), *PROBE],
        log=tmp_path / "runtime.log",
        env=NO_ENV,
    )
    try:
        wait_for(lambda: "runtime.ready" in proc.log(), timeout=WAIT_S, what="runtime ready")
    finally:
        assert proc.stop() == 0, proc.log()
    log = proc.log()
    (event,) = thread_events(log)
    assert (event["threads"], event["source"]) == (1, "runtime.threads")
    assert log.index('"runtime.threads"') < log.index('"runtime.ready"')


@pytest.mark.process
@pytest.mark.parametrize("value", ["0", "auto", "x"])
def test_the_flag_refuses_what_is_not_a_count(tmp_path: Path, value: str) -> None:
    """`--threads` takes a positive integer; anything else exits 2 naming the flag."""
    run = run_ggufswap("runtime", "--config", tmp_path / "none.yaml", "--threads", value)
    assert run.returncode == 2
    assert "argument --threads: expected an integer between 1 and 1024" in run.stderr
