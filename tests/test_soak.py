"""Soak: tensors oscillating between types (detach, fallback, reattach) a thousand times; pool
bytes, resident memory, file descriptors, threads and inotify watches return to their baseline.

Tolerances, stated: pool bytes exactly; threads and inotify watches exactly (after a warm-up);
descriptors exactly in process, within ``FD_TOLERANCE`` for the agent and runtime processes (the
test's own status requests are short-lived connections that the peer closes asynchronously; a
leak per swap would be hundreds); resident memory within ``RSS_TOLERANCE`` (a leaked buffer per
swap would exceed it many times over: the oscillating tensors are 1.2-32 KiB each).

``make test`` runs the in-process runtime soak in full (1,000 swaps) and the agent + runtime
process soak over ``AGENT_SWAPS`` swaps; ``make soak`` (the ``slow`` tier) runs the process soak
over 1,000 swaps.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch
from fault_helpers import Rig, proc_counts
from reliability import record
from runtime_helpers import ModelDir, Q, cpu_pools, loaded_bytes, logits, one_thread, open_runtime
from zygote import Zygote

from ggufswap.runtime import SlotState, Storage

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

SWAPS = 1000
WARMUP = 40
AGENT_SWAPS = 120
RSS_TOLERANCE = 8 << 20
FD_TOLERANCE = 2
HEADROOM = 12288  # dev bytes free after the load: an F16 expert tensor falls back with its family
DOWN1 = "blk.1.ffn_down_exps.weight"  # Q8_0 -> F16: family to FALLBACK_CPU
ATTN_K0 = "blk.0.attn_k.weight"  # Q4_1 -> F16: DETACHED in its pool
ATTN_Q3 = "blk.3.attn_q.weight"  # F16 -> Q4_0: stays in its original buffer
OUTPUT = "output.weight"  # F16 -> Q8_0
OSCILLATE = {DOWN1: Q.F16, ATTN_K0: Q.F16, ATTN_Q3: Q.Q4_0, OUTPUT: Q.Q8_0}


def test_thousand_in_process_swaps_return_memory_fds_and_threads_to_baseline(
    tmp_path: Path,
) -> None:
    """1,000 plans oscillating four tensors between types (family fallback, detach, in place):
    at every return to the original files the pools are exactly at baseline and the output equals
    the original; at the end RSS, descriptors and threads are back at their baseline."""
    model_dir = ModelDir.write(tmp_path / "model")
    storage = Storage.NATIVE
    pools = cpu_pools(loaded_bytes(model_dir.first, storage) + HEADROOM)
    saved = {n: model_dir.save(n, tmp_path / "saved") for n in OSCILLATE}
    changed = {n: model_dir.variant(n, t, tmp_path / "variants") for n, t in OSCILLATE.items()}
    runtime, model = open_runtime(model_dir.first, storage=storage, pools=pools)
    names = list(OSCILLATE)
    states: dict[str, bool] = dict.fromkeys(names, False)  # True: the changed file is in place
    seen: set[SlotState] = set()

    def swap(i: int) -> None:
        name = names[i % len(names)]
        states[name] = not states[name]
        model_dir.put(name, changed[name] if states[name] else saved[name])
        runtime.apply(model_dir.plan(f"soak-{i}", [name]))
        seen.add(runtime.store.slots[name].state)

    try:
        original = logits(model)
        usage = runtime.store.pools.usage()
        for i in range(WARMUP):
            swap(i)
        assert not any(states.values()), "the warm-up ends on the original files"
        gc.collect()
        before = proc_counts()
        before_threads = threading.active_count()
        returns = 0
        for i in range(WARMUP, WARMUP + SWAPS):
            swap(i)
            if not any(states.values()):
                returns += 1
                assert runtime.store.pools.usage() == usage, f"after swap {i}"
        assert torch.equal(logits(model), original)
        gc.collect()
        after = proc_counts()
        after_threads = threading.active_count()
        assert runtime.weight_version == WARMUP + SWAPS
        assert runtime.status()["plans"] == {"committed": WARMUP + SWAPS}
        assert {s.state for s in runtime.store.slots.values()} == {SlotState.ON_ORIGINAL}
    finally:
        runtime.close()
    assert seen >= {SlotState.FALLBACK_CPU, SlotState.DETACHED, SlotState.ON_ORIGINAL}, seen
    assert returns == SWAPS // (2 * len(names))  # all four changed, then all four back
    assert after["fds"] == before["fds"], (before, after)
    assert after["threads"] == before["threads"], (before, after)
    assert after_threads == before_threads
    assert after["rss"] - before["rss"] < RSS_TOLERANCE, (before, after)
    record(
        "soak",
        f"{SWAPS} in-process swaps oscillating 4 tensors (fallback, detach, reattach, in place)",
        tries=SWAPS,
        outcome=f"pools exactly at baseline at all {returns} returns; fds, threads equal; "
        f"RSS {(after['rss'] - before['rss']) / 2**20:+.1f} MiB (tolerance 8 MiB)",
        test="test_soak::test_thousand_in_process_swaps_return_to_baseline",
    )


def process_soak(tmp_path: Path, zygote: Zygote, swaps: int) -> None:
    """Swaps through a real agent (a fresh interpreter, measured) and runtime (forked)."""
    # Commits wait out the probe's pause between batches: the suite's 0.1 s would make 1,000 swaps
    # outlast the test's time limit; 0.01 s keeps the soak about the swaps.
    rig = Rig.create(tmp_path, zygote, dev_headroom=HEADROOM, settle_ms=20, batch_interval_s=0.01)
    saved = {n: rig.model.save(n, tmp_path / "saved") for n in (DOWN1, ATTN_K0)}
    changed = {n: rig.model.variant(n, OSCILLATE[n], tmp_path / "variants") for n in saved}
    names = list(saved)
    states = dict.fromkeys(names, False)
    version = 0

    def swap(i: int) -> None:
        nonlocal version
        name = names[i % len(names)]
        states[name] = not states[name]
        rig.model.put(name, changed[name] if states[name] else saved[name])
        version = rig.wait_version_above(version)

    try:
        rig.start_runtime()
        rig.start_agent(forked=False)
        assert rig.runtime is not None
        agent_pid, runtime_pid = rig.agent_pid(), rig.runtime.pid
        for i in range(WARMUP):
            swap(i)
        rig.wait_converged("the warm-up")
        before = {"agent": proc_counts(agent_pid), "runtime": proc_counts(runtime_pid)}
        for i in range(WARMUP, WARMUP + swaps):
            swap(i)
        rig.wait_converged("the soak")
        after = {"agent": proc_counts(agent_pid), "runtime": proc_counts(runtime_pid)}
        status = rig.runtime_status()
        assert status["weight_version"] == WARMUP + swaps, "each swap committed exactly once"
        assert status["serve"]["failed_batches"] == 0
        assert status["pools"]["host"]["used"] == 0, "everything reattached"
        assert rig.probe_digest(version) == rig.fresh_digest()
    finally:
        rig.stop()
    for proc in ("agent", "runtime"):
        b, a = before[proc], after[proc]
        assert abs(a["fds"] - b["fds"]) <= FD_TOLERANCE, (proc, b, a)
        assert a["threads"] == b["threads"], (proc, b, a)
        assert a["inotify_watches"] == b["inotify_watches"], (proc, b, a)
        assert a["rss"] - b["rss"] < RSS_TOLERANCE, (proc, b, a)
    assert before["agent"]["inotify_watches"] >= 1, before
    growth = ", ".join(
        f"{p} RSS {(after[p]['rss'] - before[p]['rss']) / 2**20:+.1f} MiB" for p in after
    )
    record(
        "soak",
        "swaps through the agent and runtime processes (fallback, detach, reattach)",
        tries=swaps,
        outcome="each committed once; threads, inotify watches equal; fds "
        + ", ".join(f"{p} {after[p]['fds'] - before[p]['fds']:+d}" for p in after)
        + f" (tolerance {FD_TOLERANCE}); "
        f"{growth} (tolerance 8 MiB)",
        test="test_soak::test_process_soak",
    )


@pytest.mark.process
def test_process_soak_returns_fds_threads_and_watches_to_baseline(
    tmp_path: Path, zygote: Zygote
) -> None:
    """120 swaps through the real agent and runtime: descriptors, threads, inotify watches and
    resident memory of both processes return to their baseline."""
    process_soak(tmp_path, zygote, AGENT_SWAPS)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(600)  # ~100 s on an idle host
def test_thousand_process_swaps_return_to_baseline(tmp_path: Path, zygote: Zygote) -> None:
    """1,000 swaps through the real agent and runtime: every resource back at its baseline."""
    process_soak(tmp_path, zygote, SWAPS)
