"""A storm of ``SIGIO`` from the same user against a runtime serving mapped shards (issue 28,
break 8): the handler that keeps a lease break from terminating the process must do no Python
work that a signal arriving inside it could re-enter.

The runtime is a child process (a signal storm aimed at the test process would hit pytest too);
it computes logits in a loop, pausing between batches as a serve loop does (the signals interrupt
that Python code), while the test sends ``SIGIO`` as fast as ``os.kill`` goes; then a writer
opens a served shard, which the watcher's poll must still move out in time. Before the fix, the
handler's Python code (``Event.set``) was re-entered until ``RecursionError`` killed the process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from runtime_helpers import WAIT_S, ModelDir

# slow: a child imports torch and loads a model (45 s measured under the suite on 2 busy cores)
pytestmark = [pytest.mark.process, pytest.mark.slow]

TESTS = Path(__file__).parent
STORM_S = 3.0

_CHILD = """
import select, subprocess, sys, threading
import torch
from runtime_helpers import logits, open_runtime
from ggufswap.config import MapShards
from ggufswap.runtime import Storage
torch.set_num_threads(1)
runtime, model = open_runtime(sys.argv[1], storage=Storage.NATIVE, map_shards=MapShards.ON)
before = logits(model)
print("ready", flush=True)
batches = 0
idle = threading.Event()
while not select.select([sys.stdin], [], [], 0)[0]:  # batches until the storm is over
    assert torch.equal(logits(model), before), "the served weights changed"
    batches += 1
    idle.wait(0.01)  # a serve loop's pause between batches: Python code the signals interrupt
assert sys.stdin.readline().strip() == "writer"
path = runtime.store.slots["blk.0.attn_q.weight"].record.path
subprocess.run([sys.executable, "-c", f"open({path!r}, 'r+b').close()"], check=True, timeout=20)
assert torch.equal(logits(model), before), "the served weights changed"
assert runtime.store.maps.moved == 1, runtime.store.maps.snapshot()
runtime.close()
print("OK", batches, flush=True)
"""


@pytest.mark.reliability(
    "faults",
    "SIGIO storm: os.kill(SIGIO) in a loop for 3 s against a runtime serving mapped shards",
    tries=1,
    outcome="no RecursionError, the runtime lives; a writer then opening a shard is let in "
    "by the watcher's poll after its move; the served logits are unchanged",
)
def test_a_sigio_storm_neither_kills_the_runtime_nor_stops_its_moves(tmp_path: Path) -> None:
    """Hundreds of thousands of ``SIGIO`` leave the mapped runtime alive, its logits equal, and a
    writer that comes afterwards is still let in after the file moved."""
    model = ModelDir.write(tmp_path / "model")
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CHILD), str(model.first)],
        cwd=TESTS,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        assert child.stdout.readline().strip() == "ready", child.stderr and child.stderr.read()
        sent = 0
        deadline = time.monotonic() + STORM_S
        while time.monotonic() < deadline:
            for _ in range(1000):
                try:
                    os.kill(child.pid, signal.SIGIO)
                except ProcessLookupError:
                    break
                sent += 1
            if child.poll() is not None:
                break
        with contextlib.suppress(BrokenPipeError):  # a child the storm killed reads nothing
            child.stdin.write("writer\n")
            child.stdin.flush()
        out, err = child.communicate(timeout=WAIT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=WAIT_S)
    assert child.returncode == 0, f"the runtime died after {sent} SIGIO:\n{err[-3000:]}"
    assert "OK" in out
    assert "RecursionError" not in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert sent > 10_000, f"only {sent} signals were sent"
