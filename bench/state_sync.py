"""How long the agent takes to learn the runtime's state after a commit: a full ``state`` against a
delta (``since`` the version it holds), same runtime, same run, over real ZeroMQ sockets.

    python bench/state_sync.py [--quick]

The runtime is a real one (``HotSwapRuntime`` and its ``ControlServer`` on an ``ipc://`` socket)
over a model of 1,500 small F32 tensors (and 15,000 without ``--quick``) with realistic names.
Each repeat commits a plan that changes 4 tensors (alternately to and from a variant file), then
times one sync from the agent's side, as ``RuntimeLink`` does it: send ``state`` on a DEALER,
receive the reply, read it (``state_from_wire``) and bring the held state up to date
(``ActualState.take``). The baseline asks for the full state; ours asks ``since`` the held
version and applies the delta, whose result is checked against the runtime's full state after
every repeat. Target: a delta sync within 10 ms at 1,500 tensors; the row's ``target`` is the
ratio that means it (full-sync time / 10 ms), so ``run_all`` reports it met exactly when ours is
at most 10 ms. ``run(quick)`` returns the rows for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Final

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType

from ggufswap.agent._actual import ActualState
from ggufswap.ipc import DealerClient, Fields, MessageType, message_from, state_from_wire
from ggufswap.ipc.bodies import state_request_to_wire
from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.control import ControlServer
from ggufswap.shards import read_header
from ggufswap.shards.writer import RawTensor, write_gguf

TARGET_S: Final = 0.010
CHANGED: Final = 4  # tensors each commit changes
NE: Final = (32,)
PER_BLOCK: Final = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "post_ffw_norm.weight",
)
WAIT_S: Final = 30.0
MODEL: Final = "bench"


def _names(count: int) -> list[str]:
    return [f"blk.{i // len(PER_BLOCK)}.{PER_BLOCK[i % len(PER_BLOCK)]}" for i in range(count)]


def _write(path: Path, names: list[str], seed: int) -> Path:
    rng = np.random.default_rng(seed)
    f32 = GGMLQuantizationType.F32
    tensors = [RawTensor(n, f32, NE, rng.standard_normal(NE, dtype=np.float32)) for n in names]
    return write_gguf(path, n_kv=0, kv_bytes=b"", tensors=tensors)


class _Agent:
    """The agent's side of a sync: a DEALER, the reader and the held state, as the link has."""

    def __init__(self, endpoint: str) -> None:
        self.client = DealerClient(endpoint, heartbeat_interval_s=60.0)
        self.held = ActualState()

    def sync(self, *, delta: bool) -> tuple[float, int]:
        """One sync: the seconds from sending the request to holding the updated state, and how
        many tensors the reply carried."""
        asked = self.held.request(model=MODEL, delta=delta)
        msg = message_from(MessageType.STATE, state_request_to_wire(asked))
        start = time.perf_counter()
        self.client.send(msg)
        deadline = start + WAIT_S
        while True:
            reply = self.client.poll(max(0.0, deadline - time.perf_counter()))
            if reply is None:
                raise TimeoutError(f"no state_reply within {WAIT_S}s")
            if reply.get(Fields.IN_REPLY_TO) == msg[Fields.ID]:
                break
        state = state_from_wire(reply)
        refused = self.held.take(state, asked)
        elapsed = time.perf_counter() - start
        if refused is not None:
            raise RuntimeError(f"the delta did not apply: {refused}")
        if (state.since is not None) != delta:
            raise RuntimeError(f"asked delta={delta}, the runtime answered since={state.since}")
        return elapsed, len(state.tensors)


def _measure(root: Path, count: int, repeats: int) -> tuple[list[float], list[float], int]:
    """(full syncs, delta syncs, tensors per delta) for a model of ``count`` tensors."""
    names = _names(count)
    model = _write(root / f"model-{count}.gguf", names, seed=1)
    variant = _write(root / f"variant-{count}.gguf", names[:CHANGED], seed=2)
    sources = [read_header(variant).tensor_map(), read_header(model).tensor_map()]
    runtime = HotSwapRuntime.open(model, model_name=MODEL)
    control = ControlServer(runtime, control_endpoint=f"ipc://{root}/control-{count}.sock")
    control.start()
    agent = _Agent(control.control.endpoint)
    full: list[float] = []
    deltas: list[float] = []
    delta_size = 0
    try:
        agent.sync(delta=False)
        for i in range(2 * repeats + 2):  # two warm-up rounds, then alternate delta and full
            source = sources[i % 2]
            jobs = tuple(Job(source[name]) for name in names[:CHANGED])
            runtime.apply(Plan(f"p{count}-{i}", MODEL, jobs))
            delta = i % 2 == 0
            elapsed, carried = agent.sync(delta=delta)
            if delta:
                expected = control.state()
                if agent.held.by_name != expected.by_name() or agent.held.state != expected:
                    raise RuntimeError("the state after the delta differs from the full state")
                delta_size = carried
            if i >= 2:
                (deltas if delta else full).append(elapsed)
    finally:
        agent.client.close()
        control.close()
        runtime.close()
    return full, deltas, delta_size


def run(quick: bool) -> list[dict[str, object]]:
    """One row per model size: median full sync vs median delta sync."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings+
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sizes = (1500,) if quick else (1500, 15000)
    repeats = 5 if quick else 15
    rows: list[dict[str, object]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ggufswap-bench-") as tmp:
            for count in sizes:
                full, deltas, changed = _measure(Path(tmp), count, repeats)
                base_s, ours_s = statistics.median(full), statistics.median(deltas)
                rows.append(
                    {
                        "name": f"state_sync.{count}",
                        "baseline_s": base_s,
                        "ours_s": ours_s,
                        "ratio": base_s / ours_s,
                        "target": base_s / TARGET_S,
                        "target_ms": TARGET_S * 1e3,
                        "tensors": count,
                        "changed": changed,
                        "baseline_best_s": min(full),
                        "ours_best_s": min(deltas),
                        "repeats": repeats,
                    }
                )
    finally:
        torch.set_num_threads(threads)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,500 tensors only, fewer repeats")
    args = parser.parse_args()
    rows = run(args.quick)
    print(f"{'tensors':>8} {'full ms':>9} {'delta ms':>9} {'ratio':>8}  delta vs the 10 ms target")
    for row in rows:
        ours_ms = float(row["ours_s"]) * 1e3  # type: ignore[arg-type]
        met = "met" if ours_ms <= TARGET_S * 1e3 else "MISSED"
        print(
            f"{row['tensors']:>8} {float(row['baseline_s']) * 1e3:>9.2f} "  # type: ignore[arg-type]
            f"{ours_ms:>9.3f} {float(row['ratio']):>7.1f}x  {ours_ms:.3f} ms <= 10 ms: {met}"  # type: ignore[arg-type]
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
