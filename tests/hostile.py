"""Helpers for the hostile-input tests: a live agent and runtime, raw frames, matrix rows.

Shared by ``test_fuzz_live.py`` and ``test_security.py``: the processes are the real
``ggufswap agent`` and ``ggufswap runtime`` over a tiny MoE model in ``tmp_path``; frames are sent
on plain DEALER sockets so that nothing in the project's client code filters them first.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from processes import PROBE, Proc, status_of, wait_for, write_config

from ggufswap.ipc import (
    DealerClient,
    Fields,
    Job,
    MessageType,
    Plan,
    decode,
    make_message,
    plan_to_wire,
)
from ggufswap.shards import Layout, open_shard_set, tiny_moe, write_model

MODEL = "tiny-moe"
TENSOR = "blk.1.ffn_down_exps.weight"
REPLY_TIMEOUT_S = 5.0  # every reply the tests wait for arrives well within this, or it is a bug
STARTUP_TIMEOUT_S = 60.0


def note(
    request: pytest.FixtureRequest, area: str, fault: str, *, tries: int, outcome: str
) -> None:
    """Record a row of the reliability matrix for the running test (after its checks passed)."""
    import reliability

    reliability.record(area, fault, tries=tries, outcome=outcome, test=request.node.nodeid)


@dataclass
class Live:
    """A runtime process and an agent process serving the same tiny model."""

    tmp: Path
    first: Path
    control: str  # the runtime's control endpoint (plan, state, status)
    runtime_status: str  # the runtime's status-only endpoint
    agent_status: str
    runtime: Proc
    agent: Proc

    def status(self, endpoint: str, *, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        found = status_of(endpoint, timeout=timeout)
        assert found is not None, f"{endpoint} does not answer status"
        return found

    def weight_version(self) -> int:
        return int(self.status(self.control)["weight_version"])

    def digest(self) -> str:
        """The probe digest of the current weight_version (waits for a batch on it)."""
        version = str(self.weight_version())

        def at() -> str | None:
            result = self.status(self.control)["serve"]["results"].get(version)
            return result.get("digest") if result else None

        return str(wait_for(at, timeout=30, what=f"a probe batch on version {version}"))

    def tensor_entry(self, name: str = TENSOR, *, timeout: float = 60.0) -> dict[str, Any]:
        """The runtime's state entry of tensor ``name`` (asked on its control endpoint)."""
        with DealerClient(self.control) as client:
            client.send(make_message(MessageType.STATE))
            state = wait_for(lambda: client.poll(0.2), timeout=timeout, what="the runtime's state")
        return dict(state[Fields.TENSORS][name])

    def alive(self) -> None:
        for name, proc in (("runtime", self.runtime), ("agent", self.agent)):
            assert proc.popen.poll() is None, f"the {name} exited:\n{proc.log()[-4000:]}"


@contextmanager
def live_processes(
    tmp: Path,
    *,
    prepare: Callable[[Path, Path], None] | None = None,
    agent_wrapper: tuple[str, ...] = (),
    agent_ready: Callable[[Live], bool] | None = None,
    stop_agent: Callable[[Proc], None] | None = None,
    stop_timeout_s: float = 60.0,
) -> Iterator[Live]:
    """Start a runtime and an agent on a fresh tiny model; stop both (bounded) afterwards.

    ``prepare(model_dir, config)`` runs before either starts; ``agent_wrapper`` is the command
    the agent runs under; ``agent_ready`` (default: the agent answers) is awaited before the
    rig is handed out; ``stop_agent`` (default: ``Proc.stop``) stops the agent.
    """
    model_dir = tmp / "model"
    model_dir.mkdir()
    first = Path(write_model(tiny_moe(), model_dir, layout=Layout.PER_TENSOR)[0])
    run_dir = tmp / "run"
    config = write_config(tmp, model_dir=model_dir, first=first, run_dir=run_dir, model=MODEL)
    if prepare is not None:
        prepare(model_dir, config)
    control = f"ipc://{run_dir}/rt.sock"
    runtime = Proc(["runtime", "--config", str(config), *PROBE], log=tmp / "runtime.log")
    agent: Proc | None = None
    try:
        wait_for(lambda: status_of(control), timeout=STARTUP_TIMEOUT_S, what="the runtime")
        agent = Proc(
            ["agent", "--config", str(config)], log=tmp / "agent.log", wrapper=agent_wrapper
        )
        live = Live(
            tmp=tmp,
            first=first,
            control=control,
            runtime_status=f"ipc://{run_dir}/rt.status.sock",
            agent_status=f"ipc://{run_dir}/agent.sock",
            runtime=runtime,
            agent=agent,
        )
        ready = agent_ready or (lambda rig: bool(status_of(rig.agent_status)))
        wait_for(lambda: ready(live), timeout=STARTUP_TIMEOUT_S, what="the agent ready")
        yield live
    finally:
        try:
            if agent is not None:
                (stop_agent or (lambda proc: proc.stop(timeout=stop_timeout_s)))(agent)
        finally:
            runtime.stop(timeout=stop_timeout_s)


class RawPeer:
    """A plain DEALER socket: sends any frames, collects whatever comes back."""

    def __init__(self, endpoint: str, *, context: zmq.Context[zmq.Socket[bytes]] | None = None):
        ctx = context if context is not None else zmq.Context.instance()
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def send(self, frames: Sequence[bytes]) -> None:
        self.sock.send_multipart(list(frames))

    def replies(self, *, timeout: float = REPLY_TIMEOUT_S, want: int = 1) -> list[dict[str, Any]]:
        """Up to ``want`` decoded replies (fewer only when ``timeout`` passes first)."""
        got: list[dict[str, Any]] = []
        while len(got) < want and self.sock.poll(int(timeout * 1000)):
            *envelope, body = self.sock.recv_multipart()
            assert envelope in ([], [b""]), envelope  # a reply keeps a REQ-style delimiter
            got.append(decode(body, max_size=1 << 26))
        return got

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status_frame() -> bytes:
    from ggufswap.ipc import encode

    return encode(make_message(MessageType.STATUS))


def plan_message(jobs: Sequence[Job], *, model: str = MODEL) -> dict[str, Any]:
    plan = Plan(plan_id=uuid.uuid4().hex, model=model, jobs=tuple(jobs))
    return make_message(MessageType.PLAN, **plan_to_wire(plan))


def current_jobs(first: Path, names: Sequence[str]) -> list[Job]:
    """Jobs loading ``names`` from the files as they are now (no fingerprints)."""
    tensors = open_shard_set(first).tensors
    return [Job(tensors[name]) for name in names]


def plan_outcome(endpoint: str, msg: dict[str, Any], *, timeout: float = 30.0) -> dict[str, Any]:
    """Send a plan and return its final reply (``committed``, ``rejected`` or ``error``)."""
    final = {MessageType.COMMITTED.value, MessageType.REJECTED.value, MessageType.ERROR.value}
    with DealerClient(endpoint) as client:
        client.send(msg)

        def reply() -> dict[str, Any] | None:
            got = client.poll(0.2)
            return got if got is not None and got[Fields.TYPE] in final else None

        return dict(wait_for(reply, timeout=timeout, what="the plan's final reply"))


def free_tcp_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now on 127.0.0.1 (the kernel picks them)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
