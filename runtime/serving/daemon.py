"""``ggufswap runtime``: the reference inference process.

In http mode the port is bound first, so ``/health`` answers ``503 loading`` with the phase and
progress of the start (startup.py) from its first second. Then it loads the configured model onto
its pools, serves batches (probe or perplexity mode) or completions over HTTP (http mode),
answers
``plan``/``state``/``status`` on its control endpoint and publishes events. Tells systemd it is
ready after the model is loaded and the sockets are bound, and pings the watchdog from the
inference loop, so a stuck loop gets the process restarted.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ggufswap.config import Config, Numerics, RuntimeConfig, Storage
from ggufswap.ipc import PlanCommittedEvent, supervisor
from ggufswap.ipc.sdnotify import Notifier, WatchdogPinger
from ggufswap.logs import get_logger
from ggufswap.runtime.control import ControlServer
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.models.ggml_numerics import ggml_fast_path
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.models.registry import Decoder, build_model, unused_tensors
from ggufswap.runtime.pools import Pool
from ggufswap.runtime.serving.serve import Mode, ServeLoop, ServeOptions
from ggufswap.runtime.serving.startup import Phase, Startup, collect_from_now
from ggufswap.runtime.threads import apply_thread_policy, resolve_threads

if TYPE_CHECKING:
    from ggufswap.runtime import TensorStore
    from ggufswap.runtime.serving.http import CompletionServer
    from ggufswap.runtime.serving.prestart import EarlyTokenizer
    from ggufswap.runtime.serving.tokenizer import GgufTokenizer
    from ggufswap.shards import HeaderCache
    from ggufswap.shards.reader import ShardHeader

log = get_logger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


def open_runtime(
    config: Config,
    *,
    on_progress: Callable[[int, int], None] | None = None,
    headers: HeaderCache | None = None,
) -> HotSwapRuntime:
    """Load the configured model onto the configured pools (``on_progress(done, total)``:
    the bytes read so far; ``headers``: headers already parsed)."""
    rc = config.require_runtime()
    pools = [Pool(name=p.name, device=torch.device(p.device), budget=p.budget) for p in rc.pools]
    return HotSwapRuntime.open(
        rc.model,
        pools=pools,
        storage=served_storage(rc),
        compute_dtype=getattr(torch, rc.compute_dtype.value),
        decoded_cache=rc.decoded_cache,
        map_shards=rc.map_shards,
        strict=rc.strict_types,
        placement=rc.placement,
        allowed_roots=[str(r) for r in rc.allowed_roots],
        model_name=rc.name,
        progress=sys.stderr.isatty(),
        on_progress=on_progress,
        headers=headers,
    )


def served_storage(rc: RuntimeConfig) -> Storage:
    """``runtime.storage``, native where it is ``auto`` and the numerics are ggml's (they read
    each weight's GGUF blocks; the configuration refuses ``dequantized`` with them)."""
    if rc.numerics is Numerics.GGML and rc.storage is Storage.AUTO:
        return Storage.NATIVE
    return rc.storage


def served_numerics(store: TensorStore, numerics: Numerics) -> tuple[Numerics, str]:
    """The numerics a decoder over ``store`` serves for ``runtime.numerics``, and why. ``auto``
    is ggml's (llama.cpp's arithmetic end to end, its fastest path on the CPU) where every
    product is a libggml's own kernel (:func:`~ggufswap.runtime.models.ggml_numerics.
    ggml_fast_path`), else the store's fastest products with float32 norms and KV cache
    (``auto`` as served)."""
    if numerics is not Numerics.AUTO:
        return numerics, "configured"
    refused = ggml_fast_path(store)
    if refused is None:
        return Numerics.GGML, "every product is libggml's"
    return Numerics.AUTO, refused


def served_model(runtime: HotSwapRuntime, numerics: Numerics = Numerics.AUTO) -> Decoder:
    """The decoder over ``runtime``'s store for ``runtime.numerics``: :func:`model_in` the
    numerics :func:`chosen_numerics` serves."""
    return model_in(runtime, chosen_numerics(runtime.store, numerics))


def chosen_numerics(store: TensorStore, numerics: Numerics) -> Numerics:
    """:func:`served_numerics`' choice, logged with its reason (``runtime.numerics``)."""
    serving, why = served_numerics(store, numerics)
    log.info("runtime.numerics", configured=numerics.value, serving=serving.value, why=why)
    return serving


def model_in(runtime: HotSwapRuntime, numerics: Numerics) -> Decoder:
    """The decoder over ``runtime``'s store computing in ``numerics``, as served: ``auto`` the
    store's fastest products with float32 norms and KV cache (``build_model``'s default, not
    resolved again), ``exact`` float products, ``ggml`` ggml's CPU arithmetic end to end (norms,
    products, GELU, an F16 KV cache: llama.cpp's)."""
    assert runtime.shards is not None, "open() always records the shard set"
    hparams = HParams.from_metadata(runtime.shards.metadata, source=runtime.shards.first.path)
    chosen = None if numerics is Numerics.AUTO else numerics.value
    return build_model(hparams, runtime.store, store=runtime.store, numerics=chosen)


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


def open_http(options: ServeOptions, startup: Startup) -> CompletionServer:
    """The HTTP server, listening now (``/health``: 503 ``loading`` until the service attaches)."""
    from ggufswap.runtime.serving.http import CompletionServer, HttpOptions

    return CompletionServer(
        options=HttpOptions(host=options.http_host, port=options.http_port),
        model_name=startup.model,
        capacity=options.max_batch + options.max_queue,
        startup=startup,
    ).start()


def build_service(
    runtime: HotSwapRuntime,
    model: Decoder,
    options: ServeOptions,
    *,
    server: CompletionServer | None,
    startup: Startup,
    early: EarlyTokenizer | None = None,
) -> Service:
    """The serving loop of ``options.mode``; an HTTP service is attached to ``server`` (after
    the tokenizer, unless ``early`` built it from the loaded file, and warm-up phases)."""
    if options.mode is not Mode.HTTP:
        return ServeLoop(runtime, model, options=options)
    from ggufswap.runtime.serving.generate import BatcherOptions
    from ggufswap.runtime.serving.http import HttpService

    assert runtime.shards is not None, "open() always records the shard set"
    assert server is not None, "http mode listens before the load"
    if early is not None and early.serves(runtime.shards.first):
        tokenizer = early.tokenizer
    else:
        if early is not None:
            log.info(
                "startup.tokenizer_rebuilt",
                path=runtime.shards.first.path,
                reason="the file loaded is not the one the tokenizer was built from",
            )
        tokenizer = _loaded_tokenizer(runtime.shards.first, startup)
    service = HttpService(
        runtime,
        model,
        tokenizer,
        batcher=BatcherOptions(
            max_batch=options.max_batch,
            max_queue=options.max_queue,
            request_timeout_s=options.request_timeout_s,
        ),
        server=server,
    )
    startup.enter(Phase.WARMUP)
    service.batcher.warm_up()
    return service.start()


def _loaded_tokenizer(first: ShardHeader, startup: Startup) -> GgufTokenizer:
    """The tokenizer of the loaded first shard (phase ``tokenizer``)."""
    from ggufswap.runtime.serving.tokenizer import GgufTokenizer
    from ggufswap.runtime.serving.tokenizer_cache import cache_dir
    from ggufswap.shards import FileChangedError

    startup.enter(Phase.TOKENIZER)
    try:  # the header the load read: its vocabulary is the loaded model's
        return GgufTokenizer.from_header(first, cache=cache_dir())
    except FileChangedError:  # replaced since: the file as it is now, as before
        return GgufTokenizer.from_file(first.path, cache=cache_dir())


def _with_numerics(
    status: Callable[[], dict[str, Any]], numerics: Numerics
) -> Callable[[], dict[str, Any]]:
    """``status`` with the numerics the decoder serves (``ggml`` where ``auto`` chose them):
    chosen at the load, never changed by a swap."""
    return lambda: {**status(), "numerics": numerics.value}


def _start(
    config: Config,
    options: ServeOptions,
    server: CompletionServer | None,
    early: EarlyTokenizer | None = None,
) -> tuple[HotSwapRuntime, Service, ControlServer, Numerics]:
    """The start's phases (startup.py): load, model, the service (tokenizer and warm-up in http
    mode), then the control endpoint; a failure is shown on ``/health`` and closes what opened.
    Also the numerics the decoder serves (chosen once, at the load: a swap never changes them)."""
    startup = server.startup if server is not None else Startup(config.require_runtime().name)
    loop: Service | None = None
    runtime: HotSwapRuntime | None = None
    try:
        startup.enter(Phase.LOAD)
        headers = None if early is None else early.headers  # the header it parsed
        runtime = open_runtime(config, on_progress=startup.progress, headers=headers)
        startup.enter(Phase.MODEL)
        serving = chosen_numerics(runtime.store, config.require_runtime().numerics)
        model = model_in(runtime, serving)
        report_unused(runtime, model)
        loop = build_service(runtime, model, options, server=server, startup=startup, early=early)
        if not startup.ready:
            startup.enter(Phase.READY)
        status = _with_numerics(loop.status, serving)
        control = ControlServer.from_config(runtime, config, extra_status=status).start()
    except BaseException as exc:
        startup.fail(f"{type(exc).__name__}: {exc}")
        if loop is not None:
            loop.close()
        elif server is not None:
            server.close()
        if runtime is not None:
            runtime.close()
        raise
    return runtime, loop, control, serving


def run(
    config: Config,
    *,
    options: ServeOptions,
    stop: threading.Event,
    threads: int | None = None,
    server: CompletionServer | None = None,
    early: EarlyTokenizer | None = None,
) -> int:
    """Serve until ``stop`` is set; return the process exit code.

    ``threads`` (``--threads``) overrides ``runtime.threads``; ``None`` leaves it to the config.
    ``server``: the HTTP server the command line opened before importing torch (http mode);
    None opens one here. ``early``: the tokenizer the command line built meanwhile (used when
    the loaded first shard is its file).
    """
    rc = config.require_runtime()
    notifier = Notifier.from_env()
    started = time.monotonic()
    # Once, before any torch work: the thread policy (runtime/threads.py), logged with its reason.
    apply_thread_policy(resolve_threads(flag=threads, config=rc.threads))
    if server is None and options.mode is Mode.HTTP:
        server = open_http(options, Startup(rc.name))
    runtime, loop, control, serving = _start(config, options, server, early)
    collect_from_now()  # the start paused garbage collection (ggufswap.main)
    if rc.metrics_port is not None:
        from ggufswap.runtime.serving.metrics import RuntimeMetrics

        RuntimeMetrics(runtime).serve(rc.metrics_port)
    log.info(
        "runtime.ready",
        model=runtime.model_name,
        control=rc.control_endpoint,
        mode=options.mode.value,
        numerics=serving.value,
        http_port=None if server is None else server.port,
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
        notifier.stopping()
        _shut_down(loop, control, runtime)
        forget_dead_hook()
        log.info("runtime.stopped", model=runtime.model_name, batches=loop.batches)
    return 1 if given_up else 0


def _shut_down(loop: Service, control: ControlServer, runtime: HotSwapRuntime) -> None:
    """Shutdown, bounded, in this order: the service admits nothing more; the control server
    takes no more plans (those waiting there are answered rejected); the runtime rejects its
    queued and staged plans (their clients told while the sockets still run); then the sockets
    close, and nothing is published after."""
    loop.close()
    control.stop_intake()
    runtime.close(timeout=SHUTDOWN_TIMEOUT_S)
    control.close()


__all__ = [
    "chosen_numerics",
    "model_in",
    "open_runtime",
    "report_unused",
    "run",
    "served_model",
    "served_numerics",
    "served_storage",
]
