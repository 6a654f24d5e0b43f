"""``ggufswap runtime --config FILE``: run the reference inference process."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import threading
from typing import TYPE_CHECKING, Any

from ggufswap._preflight import runtime_problems
from ggufswap.config import (
    AUTO_THREADS,
    MAX_THREADS,
    Config,
    ConfigError,
    ConfigProblem,
    Numerics,
    ServeConfig,
    ServeMode,
    load_config,
    numerics_problems,
    parse_threads,
)
from ggufswap.config.llama_args import LlamaArgs
from ggufswap.config.llama_args import translate as translate_llama_args

if TYPE_CHECKING:
    from ggufswap.runtime.serving.early import EarlyHealth
    from ggufswap.runtime.serving.prestart import EarlyTokenizer
    from ggufswap.runtime.serving.serve import ServeOptions

EXIT_CONFIG = 2
PRELOAD_JOIN_S = 10.0  # a failed start waits this long at most for the preload's log line


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "runtime",
        help="run the reference runtime (load a model, serve batches, apply plans)",
        description=(
            "Load the model of the config's runtime section onto its pools, serve batches, and "
            "apply reload plans between them. SIGTERM/SIGINT shut down cleanly."
        ),
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    d = ServeConfig()
    parser.add_argument(
        "--mode",
        choices=[m.value for m in ServeMode],
        default=None,
        help="http: serve OpenAI-style completions (docs/serving.md); "
        "probe: a fixed batch in a loop, a logits digest per weight version (tests); "
        "perplexity: a token stream in a loop, perplexity per weight version (demo). "
        f"Default: runtime.serve.mode, else {d.mode.value}",
    )
    parser.add_argument(
        "--batch-interval",
        type=float,
        default=None,
        metavar="S",
        help="probe/perplexity: pause between batches "
        f"(default: runtime.serve.batch_interval_s, else {d.batch_interval_s})",
    )
    add_threads_option(parser)
    parser.add_argument(
        "--numerics",
        choices=[n.value for n in Numerics],
        default=None,
        help="how the served decoder computes, overriding runtime.numerics: auto (the fastest "
        "products: ggml's where a libggml runs, float32 norms), exact (float products), ggml "
        "(ggml's CPU arithmetic end to end, llama.cpp's rounding; native storage). "
        "Default: runtime.numerics, else auto",
    )
    parser.add_argument(
        "--llama-args",
        default=None,
        metavar="FLAGS",
        help="a llama-server/llama-perplexity command line (quoted): its placement flags "
        "(-ngl, -ot, --cpu-moe, --n-cpu-moe, -ts, --fit, --fit-target, -sm layer) replace "
        "runtime.placement's, -t sets the threads, -c/-b the perplexity window and batch; "
        "any other flag is refused by name (docs/configuration.md#llama-cpp-flags)",
    )
    _add_http_options(parser, d)
    # ggufswap.main pauses garbage collection until the runtime is ready (startup.py)
    parser.set_defaults(func=run, gc_paused_until_ready=True)


def _add_http_options(parser: argparse.ArgumentParser, d: ServeConfig) -> None:
    """The http mode's flags, each overriding its key of ``runtime.serve`` (defaults ``d``)."""
    http = parser.add_argument_group(
        "http mode", "each flag overrides its key of runtime.serve in the configuration"
    )
    http.add_argument(
        "--http-host", default=None, metavar="HOST", help=f"bind address (default: {d.host})"
    )
    http.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="N",
        help=f"port, 0 for any free one (default: {d.port})",
    )
    http.add_argument(
        "--max-batch",
        type=int,
        default=None,
        metavar="N",
        help=f"sequences decoded per batch (default: {d.max_batch})",
    )
    http.add_argument(
        "--max-queue",
        type=int,
        default=None,
        metavar="N",
        help=f"waiting requests before 503 (default: {d.max_queue})",
    )
    http.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"per-request limit in seconds (default: {d.request_timeout_s:g})",
    )


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's CPU thread count, overriding ``runtime.threads`` (``None``: not
    given)."""
    parser.add_argument(
        "--threads",
        type=_thread_count,
        default=None,
        metavar="N",
        help="torch CPU threads, overriding runtime.threads (default: the config's value, else "
        "one per CPU of this process's affinity; see docs/operations.md)",
    )


def _thread_count(text: str) -> int:
    count = None
    with contextlib.suppress(ValueError):
        count = parse_threads(text)
    if count is None:  # "auto" is what leaving the flag out means
        raise argparse.ArgumentTypeError(
            f"expected an integer between 1 and {MAX_THREADS}, found {text!r} "
            f"(leave --threads out for {AUTO_THREADS})"
        )
    return count


def serve_settings(serve: ServeConfig, args: argparse.Namespace) -> ServeConfig:
    """``runtime.serve`` with each command-line flag that was given in place of its key."""
    flags = {
        "mode": None if args.mode is None else ServeMode(args.mode),
        "batch_interval_s": args.batch_interval,
        "host": args.http_host,
        "port": args.http_port,
        "max_batch": args.max_batch,
        "max_queue": args.max_queue,
        "request_timeout_s": args.request_timeout,
    }
    return dataclasses.replace(serve, **{k: v for k, v in flags.items() if v is not None})


def with_numerics(config: Config, numerics: str | None) -> Config:
    """``config`` with ``--numerics`` in place of ``runtime.numerics`` (ConfigError when the
    rest of the runtime section cannot run with it)."""
    if numerics is None:
        return config
    runtime = dataclasses.replace(config.require_runtime(), numerics=Numerics(numerics))
    problems = [
        ConfigProblem("--numerics", None, f"runtime.{key}", problem)
        for key, problem in numerics_problems(runtime)
    ]
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(config, runtime=runtime)


def with_llama_args(
    config: Config, serve: ServeConfig, text: str | None
) -> tuple[Config, LlamaArgs | None]:
    """``config`` with the placement and threads of a llama.cpp command line, and what else
    the line sets (ConfigError names every flag refused)."""
    if text is None:
        return config, None
    llama = translate_llama_args(text)
    if (llama.ctx, llama.batch_tokens) != (None, None) and serve.mode is not ServeMode.PERPLEXITY:
        raise ConfigError(
            [
                ConfigProblem(
                    "--llama-args",
                    None,
                    "-c" if llama.ctx is not None else "-b",
                    f"-c and -b size the perplexity mode's windows, not {serve.mode.value} mode",
                )
            ]
        )
    runtime = llama.apply(config.require_runtime())
    return dataclasses.replace(config, runtime=runtime), llama


def run(args: argparse.Namespace) -> int:
    try:
        config = with_numerics(load_config(args.config), args.numerics)
        serve = serve_settings(config.require_runtime().serve, args)
        config, llama = with_llama_args(config, serve, args.llama_args)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    from ggufswap.runtime.serving.errors import ListenError

    try:  # the port first, before anything heavy is imported: /health answers 503 at once
        early = _answer_early(config.require_runtime().name, serve)
    except ListenError as exc:  # as the preflight words a taken port
        print(
            f"ggufswap runtime: {config.source}: runtime.serve.port: {exc}; stop the other "
            "server or choose another port (runtime.serve.port, or --http-port)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    # Before any model load: every socket (and the HTTP port, in http mode unless held) free,
    # the model readable. The mode is the command line's over the configuration's.
    unheld = serve.mode is ServeMode.HTTP and early is None
    problems = runtime_problems(config, http_port=(serve.host, serve.port) if unheld else None)
    if problems:
        if early is not None:
            early.handover().close()
        print("\n".join(f"ggufswap runtime: {p}" for p in problems), file=sys.stderr)
        return EXIT_CONFIG
    from ggufswap._signals import ProcessSignals  # imports the shards package (gguf, numpy)

    signals = ProcessSignals().install()
    preload = _preload_torch(early)
    try:
        server = _listen_early(serve, early)
    except ListenError as exc:
        _failed_start(config, exc, preload)
        return EXIT_CONFIG
    from ggufswap.ipc import IpcError
    from ggufswap.runtime import MapRefused
    from ggufswap.runtime.errors import PlacementError
    from ggufswap.shards import ShardError

    early_tokenizer = _before_torch(config, server, preload is not None)
    from ggufswap.runtime.serving import daemon  # torch is imported only by the runtime command

    options = _serve_options(serve, llama)
    try:
        return daemon.run(
            config,
            options=options,
            stop=signals.stop,
            threads=args.threads,
            server=server,
            early=early_tokenizer,
        )
    except (ListenError, IpcError, ShardError, MapRefused, PlacementError) as exc:
        _failed_start(config, exc, preload)
        return EXIT_CONFIG


def _failed_start(config: Config, exc: Exception, preload: threading.Thread | None) -> None:
    """The start's one line, and its last: the torch preload's own log line comes before it."""
    if preload is not None:
        preload.join(PRELOAD_JOIN_S)
    print(f"ggufswap runtime: {config.source}: {exc}", file=sys.stderr)


def _preload_torch(early: EarlyHealth | None) -> threading.Thread | None:
    """torch's library starts loading in a thread (runtime/serving/prestart.py): in http mode
    once the port answers, before the HTTP server's modules and the tokenizer, which run beside
    it. The thread, or None where nothing is loading (no torch: its absence is then the start's
    one line)."""
    from ggufswap.runtime.serving import prestart

    prestart.quiet_torch_import()
    if early is not None:  # what runs beside the load imports its extension modules first
        prestart.import_extensions()
    return prestart.preload_torch_library()


def _before_torch(config: Config, server: Any, preloading: bool) -> EarlyTokenizer | None:
    """What overlaps torch's import, continued: in http mode the tokenizer is built while
    torch's library loads; then the phase ``import`` begins."""
    from ggufswap.runtime.serving import prestart
    from ggufswap.runtime.serving.startup import Phase

    # Nothing to overlap without the preload: the tokenizer waits for the load, as it did.
    if not preloading or server is None:
        return None
    early = prestart.early_tokenizer(config.require_runtime().model, server.startup)
    server.startup.enter(Phase.IMPORT)
    return early


def _serve_options(serve: ServeConfig, llama: LlamaArgs | None) -> ServeOptions:
    """The serve loop's options: the configuration's, with llama-perplexity's -c and -b."""
    from ggufswap.runtime.serving.serve import Mode, ServeOptions

    options = ServeOptions(
        mode=Mode(serve.mode.value),
        batch_interval_s=serve.batch_interval_s,
        http_host=serve.host,
        http_port=serve.port,
        max_batch=serve.max_batch,
        max_queue=serve.max_queue,
        request_timeout_s=serve.request_timeout_s,
    )
    if llama is None:
        return options
    eval_ctx, eval_batch = llama.windows(options.eval_ctx)
    return dataclasses.replace(
        options,
        eval_ctx=eval_ctx or options.eval_ctx,
        eval_batch=eval_batch or options.eval_batch,
    )


def _answer_early(model: str, serve: ServeConfig) -> EarlyHealth | None:
    """http mode: the port bound and answering 503 ``loading`` from a thread (before the HTTP
    server's libraries, torch and the model load); None in the other modes."""
    if serve.mode is not ServeMode.HTTP:
        return None
    from ggufswap.runtime.serving.early import EarlyHealth, listen
    from ggufswap.runtime.serving.startup import Startup

    sock = listen(serve.host, serve.port, backlog=128)
    return EarlyHealth(sock, Startup(model)).start()


def _listen_early(serve: ServeConfig, early: EarlyHealth | None) -> Any:
    """http mode: the HTTP server, taking the early socket over (``/health``: 503 ``loading``
    with the start's phase) before the model and torch load; None in the other modes."""
    if early is None:
        return None
    from ggufswap.runtime.serving.http import CompletionServer, HttpOptions

    startup = early.startup
    return CompletionServer(
        options=HttpOptions(host=serve.host, port=serve.port),
        model_name=startup.model,
        capacity=serve.max_batch + serve.max_queue,
        startup=startup,
        sock=early.handover(),
    ).start()
