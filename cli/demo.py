"""``ggufswap demo``: a per-expert quantization sweep against a live runtime, end to end.

What the system exists for, in one run: a small MoE model is written as one shard per tensor; a
real runtime process serves it in perplexity mode and a real agent watches its directory. For
each layer, the sweep atomically renames a lower-quant ``ffn_down_exps`` shard over the original,
waits for the agent to plan and the runtime to commit, reads the perplexity of a full pass made
entirely on the new weight version, then restores the original bytes the same way. A "sanity
slot" re-writes a shard with byte-identical content (a new inode): the system must notice that
nothing changed. Every restore and the sanity slot must give the baseline perplexity exactly.

When the agent command is not installed, the demo sends each plan itself over the runtime's
control socket and says so loudly: those runs show the runtime side only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml
from gguf import GGMLQuantizationType

from ggufswap._demo_report import (
    SWEPT_TENSOR,
    DemoOptions,
    DemoReport,
    Planner,
    Step,
    StepKind,
    SwapResult,
    exactness_failures,
    progress_line,
    render_table,
)
from ggufswap.errors import DemoError
from ggufswap.ipc import Fields, Job, MessageType, Plan, make_message, plan_to_wire, request
from ggufswap.shards import (
    Layout,
    ModelSpec,
    atomic_copy,
    atomic_replace,
    demo_moe,
    fingerprint,
    open_shard_set,
    read_header,
    requantize,
    tiny_moe,
    write_model,
)
from ggufswap.shards.atomic import temp_path_for
from ggufswap.sweep.children import Child, CommitEvents, Committed, poll_until, status_of
from ggufswap.sweep.errors import ChildFailed

AGENT_COMMAND_MODULE: Final = "ggufswap._cmd_agent"
EXPERT_PATTERN: Final = r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$"
IPC_PATH_MAX: Final = 107
SETTLE_MS: Final = 100
STARTUP_TIMEOUT_S: Final = 180.0
QUIET_WINDOW_S: Final = 3.0  # how long the sanity slot waits for a plan that should not come

Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class Workspace:
    root: Path
    model_dir: Path
    saved_dir: Path
    run_dir: Path
    log_dir: Path
    config_path: Path
    first_shard: Path
    model_name: str
    shards: dict[str, Path]  # swept tensor -> its shard
    temporary: bool  # created by the demo: removed at the end unless --keep
    run_dir_outside: bool  # the socket directory had to live outside root (path length)

    @property
    def runtime_control(self) -> str:
        return f"ipc://{self.run_dir}/runtime.sock"

    @property
    def runtime_status(self) -> str:
        return f"ipc://{self.run_dir}/runtime.status.sock"

    @property
    def runtime_events(self) -> str:
        return f"ipc://{self.run_dir}/runtime.events.sock"

    @property
    def agent_status(self) -> str:
        return f"ipc://{self.run_dir}/agent.sock"


# --- setup ------------------------------------------------------------------------------------


def model_spec(options: DemoOptions) -> ModelSpec:
    """demo_moe (or tiny_moe with --quick), with ``options.layers`` blocks when given."""
    preset = tiny_moe if options.quick else demo_moe
    return preset() if options.layers is None else preset(n_layers=options.layers)


def default_planner() -> Planner:
    from ggufswap.main import COMMAND_MODULES  # lazy: main imports the command modules

    return Planner.AGENT if AGENT_COMMAND_MODULE in COMMAND_MODULES else Planner.DIRECT


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
    return path


def _socket_dir(root: Path) -> tuple[Path, bool]:
    """``root/run``, or a private temp dir when socket paths under root would be too long."""
    run_dir = root / "run"
    longest = f"{run_dir}/runtime.events.sock"
    if len(longest.encode()) <= IPC_PATH_MAX:
        return _private_dir(run_dir), False
    return Path(tempfile.mkdtemp(prefix="ggufswap-demo-run-")), True


def config_document(ws: Workspace) -> dict[str, Any]:
    """The YAML both processes read (see docs/configuration.md)."""
    return {
        "version": 1,
        "agent": {"status_endpoint": ws.agent_status, "rescan_interval_s": 300},
        "models": [
            {
                "name": ws.model_name,
                "runtime": ws.runtime_control,
                "watch": [{"path": str(ws.model_dir), "glob": "*.gguf", "backend": "watchdog"}],
                "settle_ms": SETTLE_MS,
                "tensors": {"include": [EXPERT_PATTERN]},
                "verify": "checksum",
            }
        ],
        "runtime": {
            "name": ws.model_name,
            "model": str(ws.first_shard),
            "control_endpoint": ws.runtime_control,
            "status_endpoint": ws.runtime_status,
            "events_endpoint": ws.runtime_events,
            "allowed_roots": [str(ws.model_dir)],
            "storage": "dequantized",
            "compute_dtype": "float32",
            "pools": [{"name": "host", "device": "cpu"}],
        },
    }


def prepare_workspace(options: DemoOptions, spec: ModelSpec) -> Workspace:
    """Write the model (one tensor per shard), save the swept shards, write the config."""
    if options.workdir is None:
        root, temporary = Path(tempfile.mkdtemp(prefix="ggufswap-demo-")), True
    else:
        root, temporary = options.workdir.resolve(), False
        if root.exists() and any(root.iterdir()):
            raise DemoError(f"--workdir {root} is not empty; give a new or empty directory")
        root.mkdir(parents=True, exist_ok=True)
    model_dir, saved_dir, log_dir = root / "model", root / "originals", root / "logs"
    for d in (model_dir, saved_dir, log_dir):
        d.mkdir()
    run_dir, outside = _socket_dir(root)
    paths = write_model(spec, model_dir, layout=Layout.PER_TENSOR)
    tables = open_shard_set(paths[0]).tensors
    shards = {}
    for layer in range(spec.n_layers):
        tensor = SWEPT_TENSOR.format(layer)
        shards[tensor] = Path(tables[tensor].path)
        atomic_copy(shards[tensor], saved_dir / shards[tensor].name)
    ws = Workspace(
        root=root,
        model_dir=model_dir,
        saved_dir=saved_dir,
        run_dir=run_dir,
        log_dir=log_dir,
        config_path=root / "ggufswap.yaml",
        first_shard=paths[0],
        model_name=spec.name,
        shards=shards,
        temporary=temporary,
        run_dir_outside=outside,
    )
    ws.config_path.write_text(yaml.safe_dump(config_document(ws), sort_keys=False))
    return ws


def sweep_steps(n_layers: int) -> list[Step]:
    """Quantize then restore each layer; the sanity slot follows the first restore."""
    steps: list[Step] = []
    for layer in range(n_layers):
        steps += [Step(StepKind.QUANT, layer), Step(StepKind.RESTORE, layer)]
        if layer == 0:
            steps.append(Step(StepKind.SANITY, layer))
    return steps


# --- one step ---------------------------------------------------------------------------------


def replace_shard(ws: Workspace, step: Step, low_type: GGMLQuantizationType) -> tuple[float, float]:
    """Write the step's content into a hidden temp file, rename it over the shard.

    Returns ``(time.monotonic(), time.time())`` taken just before the rename. Quant: the saved
    original re-encoded to ``low_type``; restore and sanity: a copy of the saved original's bytes.
    """
    shard = ws.shards[step.tensor]
    saved = ws.saved_dir / shard.name
    tmp = temp_path_for(shard)  # ".NAME.tmp-XXXX" beside the shard: ignored by the agent
    try:
        if step.kind is StepKind.QUANT:
            requantize(saved, step.tensor, low_type, out=tmp)
        else:
            atomic_copy(saved, tmp)
        renamed_at, renamed_wall = time.monotonic(), time.time()
        atomic_replace(tmp, shard)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return renamed_at, renamed_wall


def send_direct_plan(ws: Workspace, step: Step) -> None:
    """Stand-in for the agent: plan the swept tensor from the shard's header, as it is now."""
    record = read_header(ws.shards[step.tensor]).tensor_map()[step.tensor]
    plan = Plan(
        plan_id=uuid.uuid4().hex,
        model=ws.model_name,
        jobs=(Job(record, fingerprint=fingerprint(record)),),
    )
    reply = request(
        ws.runtime_control, make_message(MessageType.PLAN, **plan_to_wire(plan)), timeout_s=10.0
    )
    kind = reply.get(Fields.TYPE)
    if kind not in (MessageType.ACCEPTED.value, MessageType.COMMITTED.value):
        raise DemoError(f"{step.tensor}: the runtime answered the plan with {kind}: {reply}")


def perplexity_of(ws: Workspace, version: int, *, timeout_s: float) -> float:
    """The perplexity of a full evaluation pass made entirely on ``version``."""

    def probe() -> float | None:
        status = status_of(ws.runtime_status)
        if status is None:
            return None
        result = status.get("serve", {}).get("results", {}).get(str(version)) or {}
        value = result.get("perplexity")
        return float(value) if isinstance(value, (int, float)) else None

    return poll_until(
        probe, timeout_s=timeout_s, what=f"the perplexity of weight_version {version}"
    )


@dataclass
class _Sweep:
    ws: Workspace
    options: DemoOptions
    planner: Planner
    events: CommitEvents
    children: list[Child]
    progress: Progress
    version: int = 0
    baseline: float = 0.0
    agent_notes: list[str] = field(default_factory=list)

    def _sanity_note(self, event: Committed | None, before: int) -> str:
        if event is None:
            what = "no plan committed: nothing changed"
        elif event.weight_version == before and not event.changed:
            what = f"no-op plan committed (changed nothing, still v{before})"
        else:
            what = f"plan committed v{event.weight_version}, changed {list(event.changed)}"
        return "; ".join([what, *self.agent_notes[-1:]])

    def check_children(self) -> None:
        for child in self.children:
            child.check_alive()

    def run_step(self, index: int, step: Step) -> SwapResult:
        self.check_children()
        before = self.version
        agent_before = None
        if step.kind is StepKind.SANITY and self.planner is Planner.AGENT:
            agent_before = poll_until(
                self._agent_model, timeout_s=self.options.step_timeout_s, what="the agent's status"
            )
        renamed_at, renamed_wall = replace_shard(self.ws, step, self.options.low_type)
        if self.planner is Planner.DIRECT:
            send_direct_plan(self.ws, step)
        if step.kind is StepKind.SANITY:
            event = self._await_sanity(step, renamed_at, renamed_wall, agent_before)
        else:
            event = self._await_commit(step, before, renamed_at)
        self.version = event.weight_version if event is not None else before
        ppl = perplexity_of(self.ws, self.version, timeout_s=self.options.step_timeout_s)
        ggml_type = read_header(self.ws.shards[step.tensor]).tensor_map()[step.tensor].ggml_type
        return SwapResult(
            index=index,
            step=step,
            ggml_type=ggml_type.name,
            weight_version=self.version,
            perplexity=ppl,
            delta=ppl - self.baseline,
            latency_ms=None if event is None else (event.received_at - renamed_at) * 1e3,
            stall_ms=None if event is None else event.stall_ms,
            note=self._sanity_note(event, before) if step.kind is StepKind.SANITY else "",
        )

    def _agent_model(self) -> dict[str, Any] | None:
        status = status_of(self.ws.agent_status)
        if status is None or status.get("pending_paths"):
            return None
        model = (status.get("models") or {}).get(self.ws.model_name)
        return model if isinstance(model, dict) else None

    def _agent_view(self, renamed_wall: float) -> str:
        """Wait for the agent's first scan after the rename; say what it made of the file."""

        def scanned() -> dict[str, Any] | None:
            model = self._agent_model()
            if model is None or (model.get("last_scan_at") or 0.0) < renamed_wall:
                return None
            return model

        model = poll_until(
            scanned, timeout_s=self.options.step_timeout_s, what="the agent to scan the new shard"
        )
        return f"agent scanned it (generation {model.get('generation')})"

    def _await_sanity(
        self,
        step: Step,
        renamed_at: float,
        renamed_wall: float,
        before: dict[str, Any] | None,
    ) -> Committed | None:
        """Nothing should change: wait for the agent's scan, then watch a quiet window."""
        seen = self._agent_view(renamed_wall) if self.planner is Planner.AGENT else ""
        event = self.events.wait(
            lambda e: step.tensor in e.changed or not e.changed,
            after=renamed_at,
            timeout_s=QUIET_WINDOW_S,
        )
        after = self._agent_model() if self.planner is Planner.AGENT else None
        if before is not None and after is not None:
            sent = (after.get("link") or {}).get("plans_sent", 0) - (before.get("link") or {}).get(
                "plans_sent", 0
            )
            self.agent_notes.append(f"{seen}; plans sent by the agent: {sent}")
        return event

    def _await_commit(self, step: Step, before: int, renamed_at: float) -> Committed:
        event = self.events.wait(
            lambda e: e.weight_version > before,
            after=renamed_at,
            timeout_s=self.options.step_timeout_s,
        )
        if event is None:
            self.check_children()
            raise DemoError(
                f"{step.kind.value} of {step.tensor}: no commit of a version after v{before} "
                f"within {self.options.step_timeout_s:.0f} s of the rename"
            )
        return event


# --- the run ----------------------------------------------------------------------------------


def _start_processes(sweep: _Sweep) -> None:
    ws = sweep.ws
    config = str(ws.config_path)
    runtime = Child(
        "runtime",
        ["runtime", "--config", config, "--mode", "perplexity"],
        log_path=ws.log_dir / "runtime.log",
    )
    sweep.children.append(runtime)
    sweep.progress(f"runtime starting (log {runtime.log_path})")

    def runtime_ready() -> float | None:
        runtime.check_alive()
        status = status_of(ws.runtime_status)
        result = (status or {}).get("serve", {}).get("results", {}).get("0") or {}
        value = result.get("perplexity")
        return float(value) if isinstance(value, (int, float)) else None

    sweep.baseline = poll_until(
        runtime_ready, timeout_s=STARTUP_TIMEOUT_S, what="the runtime's baseline perplexity"
    )
    sweep.progress(f"runtime ready: baseline perplexity {sweep.baseline:.6f} (weight_version 0)")
    if sweep.planner is Planner.DIRECT:
        sweep.progress(
            "TODO: `ggufswap agent` is not installed; the demo sends each plan itself "
            "(runtime path only, no inotify, no agent diff)"
        )
        return
    agent = Child("agent", ["agent", "--config", config], log_path=ws.log_dir / "agent.log")
    sweep.children.append(agent)

    def agent_ready() -> dict[str, Any] | None:
        agent.check_alive()
        return status_of(ws.agent_status)

    poll_until(agent_ready, timeout_s=STARTUP_TIMEOUT_S, what="the agent to answer status")
    sweep.progress(f"agent ready (log {agent.log_path})")


def run_demo(options: DemoOptions, *, progress: Progress) -> DemoReport:
    """Run the whole demo; processes are always stopped and a temp workdir removed (not --keep,
    and only when the demo succeeded: a failure keeps the logs it names)."""
    started = time.monotonic()
    spec = model_spec(options)
    planner = options.planner or default_planner()
    report = DemoReport(model=spec.name, planner=planner)
    ws = prepare_workspace(options, spec)
    report.workdir = ws.root
    progress(f"model {spec.name}: {spec.n_layers} layers, {spec.n_expert} experts, in {ws.root}")
    events = CommitEvents(ws.runtime_events).start()
    sweep = _Sweep(ws, options, planner, events, [], progress)
    try:
        _start_processes(sweep)
        report.baseline = sweep.baseline
        steps = sweep_steps(spec.n_layers)
        for index, step in enumerate(steps, start=1):
            result = sweep.run_step(index, step)
            report.swaps.append(result)
            progress(f"[{index}/{len(steps)}] {progress_line(result)}")
        report.failures = exactness_failures(report)
    except (DemoError, ChildFailed) as exc:
        report.failures.append(str(exc))
    finally:
        for child in reversed(sweep.children):  # the agent first: it must not plan into a void
            report.shutdown.append(child.stop())
        events.close()
        if ws.run_dir_outside:
            shutil.rmtree(ws.run_dir, ignore_errors=True)
        # A failed run keeps its workdir: its errors point at the logs there.
        if ws.temporary and not options.keep and not report.failures:
            shutil.rmtree(ws.root, ignore_errors=True)
            report.workdir = None
        report.elapsed_s = time.monotonic() - started
    return report


__all__ = [
    "DemoError",
    "DemoOptions",
    "DemoReport",
    "Planner",
    "Step",
    "StepKind",
    "SwapResult",
    "exactness_failures",
    "render_table",
    "run_demo",
    "sweep_steps",
]
