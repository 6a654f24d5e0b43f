"""``ggufswap runtime``: the reference inference process.

Loads the configured model onto its pools, serves batches (probe or perplexity mode) or
completions over HTTP (http mode), answers
``plan``/``state``/``status`` on its control endpoint and publishes events. Tells systemd it is
ready after the model is loaded and the sockets are bound, and pings the watchdog from the
inference loop, so a stuck loop gets the process restarted.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ggufswap.config import Config
from ggufswap.ipc import PlanCommittedEvent, supervisor
from ggufswap.ipc.sdnotify import Notifier, WatchdogPinger
from ggufswap.logs import get_logger
from ggufswap.runtime.control import ControlServer
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.models.registry import Decoder, build_model, unused_tensors
from ggufswap.runtime.pools import Pool
from ggufswap.runtime.serving.serve import Mode, ServeLoop, ServeOptions
from ggufswap.runtime.store import Placement
from ggufswap.runtime.threads import apply_thread_policy, resolve_threads

log = get_logger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


def open_runtime(config: Config) -> HotSwapRuntime:
    """Load the configured model onto the configured pools."""
    rc = config.require_runtime()
    pools = [Pool(name=p.name, device=torch.device(p.device), budget=p.budget) for p in rc.pools]
    return HotSwapRuntime.open(
        rc.model,
        pools=pools,
        storage=rc.storage,
        compute_dtype=getattr(torch, rc.compute_dtype.value),
        decoded_cache=rc.decoded_cache,
        map_shards=rc.map_shards,
        strict=rc.strict_types,
        placement=Placement(
            gpu_layers=rc.placement.gpu_layers,
            experts_pool=rc.placement.experts_pool,
            split_experts=rc.placement.split_experts,
        ),
        allowed_roots=[str(r) for r in rc.allowed_roots],
        model_name=rc.name,
        progress=sys.stderr.isatty(),
    )


def report_unused(runtime: HotSwapRuntime, model: Decoder) -> frozenset[str]:
    """Log the loaded tensors ``model`` never computes with (glm4moe's NextN/MTP blocks), and from
    now on every committed plan that changed only such tensors: its swap cannot change the
    logits, so a sweep measuring it learns nothing. Returns those tensors."""
    unused = frozenset(unused_tensors(model, runtime.store.slots))
    if not unused:
        return unused
    log.info("model.unused_tensors", model=runtime.model_name, count=len(unused))

    def on_event(event: object) -> None:
        if not isinstance(event, PlanCommittedEvent):
            return
        if event.changed and unused.issuperset(event.changed):
            log.warning(
                "plan.unused_only",
                plan_id=event.plan_id,
                weight_version=event.weight_version,
                tensors=list(event.changed),
                reason="the model computes with none of these tensors",
            )

    runtime.on_event(on_event)
    return unused


class Service(Protocol):
    """What the daemon serves: the probe/perplexity loop or completions over HTTP."""

    @property
    def batches(self) -> int: ...

    def run(
        self, stop: threading.Event, *, on_iteration: Callable[[], None] | None = None
    ) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def build_service(runtime: HotSwapRuntime, model: Decoder, options: ServeOptions) -> Service:
    """The serving loop of ``options.mode``; an HTTP service is already listening."""
    if options.mode is not Mode.HTTP:
        return ServeLoop(runtime, model, options=options)
    from ggufswap.runtime.serving.generate import BatcherOptions
    from ggufswap.runtime.serving.http import HttpOptions, HttpService
    from ggufswap.runtime.serving.tokenizer import GgufTokenizer

    assert runtime.shards is not None, "open() always records the shard set"
    tokenizer = GgufTokenizer.from_file(runtime.shards.first.path)
    return HttpService(
        runtime,
        model,
        tokenizer,
        batcher=BatcherOptions(
            max_batch=options.max_batch,
            max_queue=options.max_queue,
            request_timeout_s=options.request_timeout_s,
        ),
        http=HttpOptions(host=options.http_host, port=options.http_port),
    ).start()


def run(
    config: Config, *, options: ServeOptions, stop: threading.Event, threads: int | None = None
) -> int:
    """Serve until ``stop`` is set; return the process exit code.

    ``threads`` (``--threads``) overrides ``runtime.threads``; ``None`` leaves it to the config.
    """
    rc = config.require_runtime()
    notifier = Notifier.from_env()
    started = time.monotonic()
    # Once, before any torch work: the thread policy (runtime/threads.py), logged with its reason.
    apply_thread_policy(resolve_threads(flag=threads, config=rc.threads))
    runtime = open_runtime(config)
    loop: Service | None = None
    try:
        assert runtime.shards is not None, "open() always records the shard set"
        hparams = HParams.from_metadata(runtime.shards.metadata)
        model = build_model(hparams, runtime.store, store=runtime.store)
        report_unused(runtime, model)
        loop = build_service(runtime, model, options)
        control = ControlServer.from_config(runtime, config, extra_status=loop.status).start()
    except BaseException:
        if loop is not None:
            loop.close()
        runtime.close()
        raise
    if rc.metrics_port is not None:
        from ggufswap.runtime.serving.metrics import RuntimeMetrics

        RuntimeMetrics(runtime).serve(rc.metrics_port)
    log.info(
        "runtime.ready",
        model=runtime.model_name,
        control=rc.control_endpoint,
        mode=options.mode.value,
        load_s=round(time.monotonic() - started, 3),
    )
    notifier.ready(status=f"serving {runtime.model_name} (weight_version 0)")
    pinger = WatchdogPinger(notifier)  # withholds pings while an essential thread is down
    last_version = -1
    given_up: list[str] = []

    def on_thread_dead(name: str) -> None:  # an essential thread failed repeatedly: exit 1
        given_up.append(name)
        log.error("runtime.thread_given_up", thread=name, exit="non-zero, for a restart")
        stop.set()

    forget_dead_hook = supervisor.on_dead(on_thread_dead)

    def on_iteration() -> None:
        nonlocal last_version
        pinger.progress()
        pinger.maybe_ping()
        if runtime.weight_version != last_version:
            last_version = runtime.weight_version
            notifier.status(f"serving {runtime.model_name} (weight_version {last_version})")

    try:
        loop.run(stop, on_iteration=on_iteration)
    finally:
        # Shutdown, bounded: take no more plans (those waiting are answered rejected), reject
        # the runtime's queued and staged plans (their clients told while the sockets run),
        # then stop answering.
        notifier.stopping()
        loop.close()
        control.stop_intake()
        runtime.close(timeout=SHUTDOWN_TIMEOUT_S)
        control.close()
        forget_dead_hook()
        log.info("runtime.stopped", model=runtime.model_name, batches=loop.batches)
    return 1 if given_up else 0


__all__ = ["open_runtime", "report_unused", "run"]
