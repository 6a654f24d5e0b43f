"""The separate-process path of ``ggufswap sweep --config``: the same :class:`~.sweep.Sweep`,
driving a runtime process (``ggufswap sweep-runtime``, :mod:`.runtime_proc`) and an agent that
watches the model's directory.

A swap is what an operator would do: each of the round's shards is saved
(``OUT/originals/``), rewritten with the round's tensor (from the sweep's sources: requantized,
ik's quantizer, or the user's ``--source`` files, :mod:`.sources`) into a hidden temp file beside
it, and renamed over it; the agent notices, plans, and the runtime commits. The
``plan.committed`` events (the runtime's PUB socket) must name exactly the round's tensors. The
runtime process evaluates every swapped weight version and reports the figures and logit
digests in its ``status``; after a restore (every tensor back at its original fingerprint) it
evaluates only the chunks the restore check compares. A restore copies the saved originals back
(atomically) and drops them, so between rounds nothing is kept. The model must be laid out one
tensor per shard (``ggufswap split --per-tensor``): a round then rewrites only its tensors'
shards. Before the
children start, and when the sweep ends or fails, every shard with a saved original is put
back.

The agent runs with ``OUT/agent.yaml``: the config with the ``settle_ms`` of the sweep's model
lowered to :data:`SWEEP_SETTLE_MS`. Every write the sweep makes is a rename of a complete file
(one inotify event, nothing left to settle), so the window the config keeps for other writers
(files copied in slow chunks) only delays each swap and restore. Where the copy would not load
as the same config (relative paths resolve against the config's directory), the agent gets the
config itself.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import yaml

from ggufswap.config import Config, ConfigError, Storage, load_config
from ggufswap.shards import (
    ShardError,
    TensorRecord,
    atomic_copy,
    atomic_replace,
    open_shard_set,
    read_header,
    read_tensor_bytes,
    rewrite_tensor,
)
from ggufswap.shards.atomic import temp_path_for
from ggufswap.sweep.basefile import BaseLogProbs
from ggufswap.sweep.children import Child, CommitEvents, poll_until, status_of
from ggufswap.sweep.errors import ChildFailed, RoundRefused, SourceError, SweepError
from ggufswap.sweep.evaluate import BASELINE_JSON
from ggufswap.sweep.inprocess import open_sources
from ggufswap.sweep.libggml import choose
from ggufswap.sweep.results import write_text
from ggufswap.sweep.sources import TensorSet, TensorSources
from ggufswap.sweep.suite import ORIGINALS
from ggufswap.sweep.sweep import COMMIT_TIMEOUT_S, Swapped, check_changed

STARTUP_TIMEOUT_S: Final = 600.0
EVAL_TIMEOUT_S: Final = 3600.0
CHILDREN: Final = "children.json"
LEFTOVER_STOP_S: Final = 15.0
AGENT_CONFIG: Final = "agent.yaml"
# The agent's settle window for the sweep's own model: long enough for the renames of a group's
# shards (a loop of rename calls) to arrive as one change, far below the config default (250 ms).
SWEEP_SETTLE_MS: Final = 20


class ProcessTarget:
    """A runtime process and an agent over the config's model (a per-tensor shard set)."""

    def __init__(
        self,
        *,
        config_path: Path,
        config: Config,
        text: Path,
        out_dir: Path,
        n_ctx: int,
        max_chunks: int | None,
        threads: int | None = None,
        numerics: str = "ggml",
        ggml: str = "auto",
        targets: Iterable[int] = (),
        verify_chunks: int = 1,
        models: Mapping[int, TensorSet] | None = None,
        baseline_model: str | None = None,
        imatrix: Path | None = None,
        commit_timeout_s: float = COMMIT_TIMEOUT_S,
    ) -> None:
        rc = config.require_runtime()
        if not rc.events_endpoint or not rc.status_endpoint:
            raise SweepError(
                f"{config_path}: runtime.events_endpoint and runtime.status_endpoint are needed "
                "(the sweep reads commits and results there)"
            )
        if numerics == "ggml" and rc.storage is not Storage.NATIVE:
            raise SweepError(
                f"{config_path}: numerics ggml (the default: figures comparable with llama.cpp) "
                f"needs runtime.storage: native, found {rc.storage.value}; set it, or give "
                "--numerics exact"
            )
        self.config_path = config_path
        self.config = config
        self.agent_config_path = config_path  # OUT/agent.yaml once start() has written it
        self.rc = rc
        self.agent_status = config.agent.status_endpoint
        self.text = text
        self.out_dir = out_dir
        self.n_ctx = n_ctx
        self.max_chunks = max_chunks
        self.threads = threads
        self.numerics = numerics
        self.ggml = ggml  # --ggml, resolved for the model's and the targets' types at start
        self.targets = frozenset(int(t) for t in targets)
        self.verify_chunks = verify_chunks
        self.models = models
        self.baseline_model = baseline_model
        self.imatrix = imatrix
        self.sources: TensorSources | None = None
        self.commit_timeout_s = commit_timeout_s
        self.saved_dir = out_dir / ORIGINALS
        self.children: list[Child] = []
        self.events: CommitEvents | None = None
        self._originals: dict[str, TensorRecord] = {}
        self._required: frozenset[str] = frozenset()
        self._version = 0
        self._pause = threading.Event()  # never set: waits with a timeout

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ProcessTarget:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.saved_dir.mkdir(exist_ok=True)
        self.stop_leftovers()  # a killed sweep leaves its runtime and agent running
        self.put_back_originals()  # ... and maybe a swapped shard
        shard_set = open_shard_set(self.rc.model)
        crowded = [h.path for h in shard_set.shards if len(h.tensors) > 1]
        if crowded:
            raise SweepError(
                f"{self.rc.model}: {len(crowded)} shards hold more than one tensor (e.g. "
                f"{crowded[0]}); make one tensor per shard first: ggufswap split --per-tensor"
            )
        self._originals = dict(shard_set.tensors)
        self.sources = open_sources(
            str(self.rc.model),
            out_dir=self.out_dir,
            originals=self._originals,
            models=self.models,
            imatrix=self.imatrix,
        )
        self.events = CommitEvents(self.rc.events_endpoint or "").start()
        logs = self.out_dir / "logs"
        logs.mkdir(exist_ok=True)
        args = ["sweep-runtime", "--config", str(self.config_path), "--text", str(self.text)]
        args += ["--out", str(self.out_dir), "--ctx", str(self.n_ctx)]
        if self.max_chunks is not None:
            args += ["--chunks", str(self.max_chunks)]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        args += ["--numerics", self.numerics, "--verify-chunks", str(self.verify_chunks)]
        types = {int(r.ggml_type) for r in self._originals.values()} | self.targets
        args += ["--ggml", choose(self.ggml, types)]
        if self.baseline_model is not None:
            args += ["--baseline", self.baseline_model]
        runtime = Child("runtime", args, log_path=logs / "runtime.log")
        self.children.append(runtime)
        self._record_children()
        sweep = self._wait(
            lambda: self._sweep_status(runtime),
            what="the runtime's baseline",
            timeout_s=STARTUP_TIMEOUT_S,
        )
        self._required = frozenset(sweep.get("required") or ())
        self._version = max(int(v) for v in sweep["results"])
        self.agent_config_path = self.write_agent_config()
        agent = Child(
            "agent",
            ["agent", "--config", str(self.agent_config_path)],
            log_path=logs / "agent.log",
        )
        self.children.append(agent)
        self._record_children()
        self._wait(lambda: status_of(self.agent_status), what="the agent", timeout_s=60.0)
        return self

    def write_agent_config(self) -> Path:
        """``OUT/agent.yaml``: the config with the sweep's model settling for
        :data:`SWEEP_SETTLE_MS` (a lower ``settle_ms`` is kept); the config itself where the copy
        would not load as the same config but for that."""
        ours = [m.runtime == self.rc.control_endpoint for m in self.config.models]
        try:
            doc = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return self.config_path
        entries = doc.get("models") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or len(entries) != len(ours):
            return self.config_path
        if not all(isinstance(e, dict) for e in entries):
            return self.config_path
        for entry, model, mine in zip(entries, self.config.models, ours, strict=True):
            if mine:
                entry["settle_ms"] = min(model.settle_ms, SWEEP_SETTLE_MS)
        path = self.out_dir / AGENT_CONFIG
        write_text(path, yaml.safe_dump(doc, sort_keys=False))
        expected = dataclasses.replace(
            self.config,
            source=path,
            models=tuple(
                dataclasses.replace(m, settle_ms=min(m.settle_ms, SWEEP_SETTLE_MS)) if mine else m
                for m, mine in zip(self.config.models, ours, strict=True)
            ),
        )
        try:
            same = load_config(path) == expected
        except ConfigError:
            same = False
        if not same:
            path.unlink()
            return self.config_path
        return path

    def _record_children(self) -> None:
        """Note the children's pids in ``OUT/children.json`` for :meth:`stop_leftovers`."""
        doc = [{"name": c.name, "pid": c.popen.pid} for c in self.children]
        write_text(self.out_dir / CHILDREN, json.dumps(doc) + "\n")

    def stop_leftovers(self) -> None:
        """Stop the runtime and agent an earlier, killed run of this sweep started: the pids in
        ``OUT/children.json`` whose command line is still ``ggufswap`` with this config."""
        path = self.out_dir / CHILDREN
        if not path.exists():
            return
        for child in json.loads(path.read_text()):
            pid = int(child["pid"])
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone
            configs = {str(self.config_path).encode(), str(self.out_dir / AGENT_CONFIG).encode()}
            if b"ggufswap" not in b" ".join(cmdline) or not configs & set(cmdline):
                continue  # the pid was reused by another program
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + LEFTOVER_STOP_S
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                self._pause.wait(0.05)
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
        path.unlink()

    def close(self) -> list[str]:
        stopped = [child.stop() for child in reversed(self.children)]  # the agent first
        if self.events is not None:
            self.events.close()
        self.put_back_originals()
        return stopped

    def put_back_originals(self) -> None:
        """Copy every saved original shard back where its content differs (a killed round's),
        then drop the saved copies."""
        if not self.saved_dir.exists():
            return
        for saved in sorted(self.saved_dir.glob("*.gguf")):
            shard = Path(self.rc.model).parent / saved.name
            if not shard.exists() or not filecmp.cmp(saved, shard, shallow=False):
                atomic_copy(saved, shard)
            saved.unlink()

    def _sweep_status(self, runtime: Child) -> dict[str, Any] | None:
        runtime.check_alive()
        status = status_of(self.rc.status_endpoint or "")
        sweep = (status or {}).get("sweep")
        return sweep if isinstance(sweep, dict) and sweep.get("ready") else None

    def _wait(self, probe: Any, *, what: str, timeout_s: float) -> Any:
        try:
            return poll_until(probe, timeout_s=timeout_s, what=what)
        except ChildFailed as exc:
            raise SweepError(str(exc)) from None

    # -- the target ------------------------------------------------------------------------

    @property
    def originals(self) -> Mapping[str, TensorRecord]:
        return self._originals

    @property
    def computed(self) -> frozenset[str]:
        return self._required

    def baseline(self) -> dict[str, Any]:
        return dict(json.loads((self.out_dir / BASELINE_JSON).read_text()))

    def _saved(self, name: str) -> tuple[Path, Path]:
        shard = Path(self._originals[name].path)
        saved = self.saved_dir / shard.name
        if not saved.exists():
            atomic_copy(shard, saved)
        return shard, saved

    def source_problems(self, targets: set[int], example: str) -> list[str]:
        assert self.sources is not None, "started"
        return self.sources.problems(targets, example)

    def swap(self, names: tuple[str, ...], target: int, what: str) -> Swapped:
        assert self.sources is not None, "started"
        started = time.monotonic()
        shards: list[tuple[Path, Path]] = []
        sources: list[str] = []
        for name in names:
            shard, saved = self._saved(name)
            tmp = temp_path_for(shard)  # hidden: the agent ignores it
            try:
                original = read_header(saved).tensor_map()[name]  # the bytes as they are now
                record = self.sources.record(name, target, original=original)
                rewrite_tensor(saved, name, _replace_with(target, record), out=tmp)
            except (SourceError, ShardError) as exc:
                tmp.unlink(missing_ok=True)
                for t, _ in shards:
                    t.unlink(missing_ok=True)
                self.put_back_originals()
                raise RoundRefused(str(exc)) from None
            shards.append((tmp, shard))
            sources.append(record.path)
        for tmp, shard in shards:
            atomic_replace(tmp, shard)
        nbytes = sum(self._originals[n].nbytes for n in names)
        return self._await(frozenset(names), started, what, sources, nbytes)

    def restore(self, names: tuple[str, ...], expect: frozenset[str], what: str) -> Swapped:
        started = time.monotonic()
        paths = []
        for name in names:
            shard = Path(self._originals[name].path)
            saved = self.saved_dir / shard.name
            if saved.exists():  # copied back and dropped: nothing is kept between rounds
                atomic_copy(saved, shard)
                saved.unlink()
            paths.append(str(shard))
        try:
            return self._await(expect, started, what, paths, 0)
        except RoundRefused as exc:
            raise SweepError(f"{exc}; the model is no longer at its baseline, stopping") from None

    def release(self, names: tuple[str, ...], target: int) -> None:
        if self.sources is not None:
            self.sources.release(names, target)

    def _await(
        self, expect: frozenset[str], after: float, what: str, paths: list[str], nbytes: int
    ) -> Swapped:
        """Commits received since ``after`` until they changed exactly ``expect``."""
        assert self.events is not None, "started"
        if not expect:
            return Swapped(self._version, "", tuple(paths), nbytes)
        deadline = time.monotonic() + self.commit_timeout_s
        changed: set[str] = set()
        while True:
            for child in self.children:
                child.check_alive()
            event = self.events.wait(
                lambda e: e.weight_version > self._version,
                after=after,
                timeout_s=max(0.0, min(1.0, deadline - time.monotonic())),
            )
            if event is None:
                if time.monotonic() > deadline:
                    raise SweepError(
                        f"{what}: no commit of {sorted(expect - changed)} within "
                        f"{self.commit_timeout_s:.0f} s (see the logs in {self.out_dir / 'logs'})"
                    )
                continue
            self._version = event.weight_version
            changed.update(event.changed)
            if not changed <= expect:
                check_changed(frozenset(changed), expect, what)
            if changed == expect:
                return Swapped(event.weight_version, event.plan_id, tuple(paths), nbytes)

    def _result(self, version: int) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            sweep = self._sweep_status(self.children[0])
            result = (sweep or {}).get("results", {}).get(str(version))
            return result if isinstance(result, dict) else None

        result: dict[str, Any] = self._wait(
            probe, what=f"the results of weight_version {version}", timeout_s=EVAL_TIMEOUT_S
        )
        return result

    def measure(self, version: int, base: BaseLogProbs) -> dict[str, Any]:
        metrics = self._result(version)["metrics"]
        assert isinstance(metrics, dict), "a swapped version is measured"
        return metrics

    def digests(self, version: int, n: int) -> list[str]:
        digests = list(self._result(version)["digests"])
        return digests[:n] if n else digests


def _replace_with(
    target: int, record: TensorRecord
) -> Callable[[TensorRecord, bytes], tuple[int, memoryview]]:
    """``rewrite_tensor``'s maker: the tensor becomes ``record``'s bytes, in ``target``."""

    def make(_old: TensorRecord, _data: bytes) -> tuple[int, memoryview]:
        return int(target), read_tensor_bytes(record)

    return make
