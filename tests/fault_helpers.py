"""Helpers for the fault tests: real agent and runtime processes that can be SIGKILLed cheaply,
and the checks that prove nothing was lost, mixed or applied twice.

A runtime restart normally pays ~2 s of ``import torch``; a 50-iteration kill loop cannot. The
runtimes are forked by the worker's zygote (tests/zygote.py): each runs the very same
``ggufswap`` entry point without the interpreter start, so killing it is a real SIGKILL of a real
runtime process. The agent (no torch, ~0.5 s to start) runs as an ordinary ``ggufswap agent``
subprocess, or forked too for kill loops.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from processes import GGUFSWAP, PROBE_INTERVAL_S, Proc, status_of, wait_for
from runtime_helpers import ModelDir, fresh_digest, loaded_bytes
from zygote import Child, Zygote

from ggufswap.config import Numerics
from ggufswap.ipc import MessageType, PeerTimeout, Subscriber, Topic, make_message, request
from ggufswap.runtime import Storage
from ggufswap.shards import Fingerprinter, open_shard_set, tiny_moe

MODEL = "tiny-moe"
WAIT_S = 60.0  # bound of every wait on the processes (a broken build fails, never hangs)


def disk_fingerprints(first: Path, fingerprinter: Fingerprinter) -> dict[str, str]:
    """Content fingerprint of every tensor as the files on disk hold it now."""
    return {n: fingerprinter(r) for n, r in open_shard_set(first).tensors.items()}


@dataclass
class Rig:
    """A model directory, a config, a runtime (forked by a zygote) and an agent (subprocess)."""

    tmp: Path
    model: ModelDir
    config: Path
    control: str
    events: str
    agent_status: str
    zygote: Zygote
    storage: Storage
    batch_interval_s: float
    runtime: Child | None = None
    agent: Proc | Child | None = None
    fingerprinter: Fingerprinter = field(default_factory=Fingerprinter)
    _logs: int = 0

    @classmethod
    def create(
        cls,
        tmp: Path,
        zygote: Zygote,
        *,
        model_dir: Path | None = None,
        storage: Storage = Storage.NATIVE,
        dev_headroom: int | None = None,
        settle_ms: int = 30,
        batch_interval_s: float = PROBE_INTERVAL_S,
        allowed_roots: list[Path] | None = None,
        map_shards: bool = False,
    ) -> Rig:
        model = ModelDir.write(model_dir or tmp / "model", tiny_moe())
        run = tmp / "run"
        run.mkdir()
        roots = allowed_roots or [model.root]
        budget = (
            ""
            if dev_headroom is None
            else f", budget: {loaded_bytes(model.first, storage) + dev_headroom}"
        )
        config = tmp / "config.yaml"
        config.write_text(
            f"""
agent:
  status_endpoint: ipc://{run}/agent.sock
  rescan_interval_s: 300
models:
  - name: {MODEL}
    runtime: ipc://{run}/rt.sock
    watch:
      - path: {model.root}
    settle_ms: {settle_ms}
    verify: checksum
    request_timeout_s: 2.0
runtime:
  name: {MODEL}
  model: {model.first}
  control_endpoint: ipc://{run}/rt.sock
  events_endpoint: ipc://{run}/events.sock
  allowed_roots: [{", ".join(str(r) for r in roots)}]
  storage: {storage.value}
  map_shards: {"true" if map_shards else "false"}
  pools:
    - {{name: dev, device: cpu{budget}}}
    - {{name: host, device: cpu}}
"""
        )
        return cls(
            tmp=tmp,
            model=model,
            config=config,
            control=f"ipc://{run}/rt.sock",
            events=f"ipc://{run}/events.sock",
            agent_status=f"ipc://{run}/agent.sock",
            zygote=zygote,
            storage=storage,
            batch_interval_s=batch_interval_s,
        )

    def _log(self, name: str) -> Path:
        self._logs += 1
        return self.tmp / f"{name}-{self._logs}.log"

    # -- processes -------------------------------------------------------------------------

    def start_runtime(self, *, env: dict[str, str] | None = None) -> Child:
        interval = str(self.batch_interval_s)
        args = [
            "runtime",
            "--config",
            str(self.config),
            "--mode",
            "probe",
            "--batch-interval",
            interval,
        ]
        self.runtime = self.zygote.spawn(args, log=self._log("runtime"), env=env)
        wait_for(
            lambda: self.runtime_status_or_none() is not None or not self.runtime_alive(),
            timeout=WAIT_S,
            what="the runtime to answer",
            interval=0.01,
        )
        assert self.runtime_alive(), f"runtime died on start:\n{self.runtime.log()}"
        return self.runtime

    def runtime_alive(self) -> bool:
        return self.runtime is not None and self.runtime.alive()

    def start_agent(
        self, *, synced: bool = True, forked: bool = True, env: dict[str, str] | None = None
    ) -> Proc | Child:
        """Start ``ggufswap agent``: forked by the zygote (~50 ms, for kill loops), or as a
        fresh interpreter (``forked=False``: what measures the agent's own resources)."""
        args = ["agent", "--config", str(self.config)]
        log = self._log("agent")
        self.agent = (
            self.zygote.spawn(args, log=log, env=env) if forked else Proc(args, log=log, env=env)
        )
        if synced:
            wait_for(self.agent_synced, timeout=WAIT_S, what="the agent to sync", interval=0.01)
        return self.agent

    def agent_pid(self) -> int:
        assert self.agent is not None, "no agent"
        return self.agent.pid if isinstance(self.agent, Child) else self.agent.popen.pid

    def kill_agent(self) -> None:
        assert self.agent is not None, "no agent"
        self.agent.kill()

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        if self.runtime is not None and self.runtime.alive():
            self.runtime.stop()

    # -- observations ----------------------------------------------------------------------

    def runtime_status_or_none(self) -> dict[str, Any] | None:
        return status_of(self.control, timeout=2)

    def runtime_status(self) -> dict[str, Any]:
        status = self.runtime_status_or_none()
        assert status is not None, "the runtime does not answer status"
        return status

    def agent_status_body(self) -> dict[str, Any] | None:
        return status_of(self.agent_status, timeout=2)

    def agent_model(self) -> dict[str, Any] | None:
        status = status_of(self.agent_status, timeout=2)
        if status is None:
            return None
        body = status["models"].get(MODEL)
        if body is not None:
            body["pending_paths"] = status["pending_paths"]
        return body

    def agent_synced(self) -> bool:
        model = self.agent_model()
        if model is None:
            return False
        link = model.get("link") or {}
        return (
            link.get("state") == "idle"
            and bool(link.get("connected"))
            and not link.get("pending_plan")
            and not model.get("pending_paths")
        )

    def loaded(self) -> dict[str, str]:
        """What the runtime reports loaded: tensor -> content fingerprint."""
        reply = request(self.control, make_message(MessageType.STATE), timeout_s=5)
        return {name: str(entry["fingerprint"]) for name, entry in reply["tensors"].items()}

    def on_disk(self) -> dict[str, str]:
        return disk_fingerprints(self.model.first, self.fingerprinter)

    def converged(self) -> bool:
        """The runtime holds exactly what is on disk and the agent has nothing in flight."""
        try:
            return self.agent_synced() and self.loaded() == self.on_disk()
        except PeerTimeout:
            return False

    def wait_converged(self, what: str = "convergence") -> None:
        wait_for(self.converged, timeout=WAIT_S, what=what, interval=0.02)

    def wait_version_above(self, version: int) -> int:
        return int(
            wait_for(
                lambda: (v := self.runtime_status()["weight_version"]) > version and v,
                timeout=WAIT_S,
                what=f"weight_version above {version}",
                interval=0.003,
            )
        )

    def probe_digest(self, version: int) -> str:
        """The digest of the batches the runtime served on ``version`` (waits for one); every
        batch on one version must have given the same digest (never a mix of weights)."""

        def at() -> dict[str, Any] | None:
            result = self.runtime_status()["serve"]["results"].get(str(version))
            return result if result and "digest" in result else None

        result = wait_for(at, timeout=WAIT_S, what=f"a batch on version {version}")
        assert result["distinct_digests"] == 1, f"version {version} gave several outputs"
        return str(result["digest"])

    def fresh_digest(self) -> str:
        """A fresh load's probe digest, in the numerics the rig's runtime serves (``auto``
        resolves at its load; a swap to a type ggml's kernels do not take never changes it)."""
        served = Numerics(self.runtime_status()["numerics"])
        return fresh_digest(self.model.first, storage=self.storage, served=served)


class CommitLog:
    """Every ``plan.committed`` event of the runtime, from a SUB socket (reconnects by itself)."""

    def __init__(self, endpoint: str) -> None:
        self.sub = Subscriber(endpoint, topics=[Topic.PLAN_COMMITTED])
        self.events: list[dict[str, Any]] = []

    def drain(self, timeout_s: float = 0.0) -> list[dict[str, Any]]:
        """Collect events that arrived (waiting up to ``timeout_s`` for the first one)."""
        got = self.sub.recv(timeout_s)
        while got is not None:
            self.events.append(got[1])
            got = self.sub.recv(0)
        return self.events

    def changed(self, tensor: str) -> list[dict[str, Any]]:
        return [e for e in self.events if tensor in e.get("changed", [])]

    def close(self) -> None:
        self.sub.close()


def proc_counts(pid: int | None = None) -> dict[str, int]:
    """Resident bytes, open file descriptors, threads and inotify watches of a process."""
    base = Path("/proc") / (str(pid) if pid else "self")
    rss = 0
    threads = 0
    for line in (base / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    fds = list(iter_fds(base))
    watches = 0
    for fd in fds:
        try:
            if os.readlink(base / "fd" / fd) == "anon_inode:inotify":
                info = (base / "fdinfo" / fd).read_text()
                watches += sum(1 for ln in info.splitlines() if ln.startswith("inotify wd:"))
        except OSError:
            continue  # closed meanwhile
    return {"rss": rss, "fds": len(fds), "threads": threads, "inotify_watches": watches}


def iter_fds(base: Path) -> Iterator[str]:
    try:
        yield from os.listdir(base / "fd")
    except FileNotFoundError:
        return


__all__ = ["GGUFSWAP", "CommitLog", "Rig", "proc_counts"]
