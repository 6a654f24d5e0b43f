"""``ggufswap perplexity --model FILE --text FILE``: perplexity of a GGUF model on a text file.

The protocol is llama-perplexity's, the one the sweep uses too
(:mod:`ggufswap.runtime.serving.perplexity`): the text is tokenized with the model's own
tokenizer (BOS in front when the vocabulary adds it), cut into chunks of ``--ctx`` tokens (at
most ``--chunks``), each chunk evaluated alone with its first token replaced by BOS, and the second
half of each chunk scored. By default the products round as llama.cpp's CPU kernels round
them (``--numerics ggml``), so the figure is comparable with ``llama-perplexity``'s; the sums run
in float64 in a fixed order, so it is reproducible bit for bit on CPU.

With ``--hot-swap --config FILE`` the model is loaded as the config's runtime section says, the
control endpoint takes plans like ``ggufswap runtime`` does, and the text is evaluated again after
every committed plan. Plans are committed only between two evaluations, so each figure belongs to
exactly one ``weight_version``; the figures are printed and reported in ``status``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Final

from ggufswap._cmd_runtime import add_threads_option
from ggufswap._signals import ProcessSignals
from ggufswap.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from torch import Tensor

    from ggufswap.runtime import HotSwapRuntime
    from ggufswap.runtime.models import Decoder

EXIT_OK: Final = 0
EXIT_USAGE: Final = 2
DEFAULT_CTX: Final = 512
WAKE_S: Final = 0.5  # the hot-swap loop re-checks the stop flag this often


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        help="perplexity of a GGUF model on a text file (re-evaluated after every hot-swap)",
        description=(
            "Evaluate perplexity on a text file with the model's own tokenizer. With --hot-swap, "
            "serve the config's control endpoint and re-evaluate after every committed plan."
        ),
    )
    parser.add_argument("--model", metavar="FILE", help="GGUF file (first shard of a split set)")
    parser.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to evaluate")
    parser.add_argument(
        "--ctx", type=int, default=DEFAULT_CTX, metavar="N", help="tokens per chunk (512)"
    )
    parser.add_argument("--chunks", type=int, metavar="N", help="evaluate at most N chunks")
    parser.add_argument("--batch", type=int, default=1, metavar="N", help="chunks per forward")
    parser.add_argument("--json", action="store_true", help="one JSON object per evaluation")
    parser.add_argument(
        "--hot-swap",
        action="store_true",
        help="serve the control endpoint of --config and re-evaluate after every committed plan",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML configuration (runtime section)")
    parser.add_argument(
        "--numerics",
        choices=("exact", "ggml"),
        default="ggml",
        help="ggml (default): activations rounded as llama.cpp's CPU kernels round them, "
        "comparable with llama-perplexity (native storage: with --config, runtime.storage: "
        "native); exact: float products",
    )
    parser.add_argument(
        "--ggml",
        default="auto",
        metavar="auto|mainline|ik|off|PATH",
        help="with --numerics ggml, whose libggml multiplies, as ggufswap sweep --ggml chooses "
        "(auto: mainline's when llama-cpp-python is installed and every type is mainline's)",
    )
    add_threads_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problems = _usage_problems(args)
    config: Config | None = None
    if args.config is not None:
        try:
            config = load_config(args.config)
            rc = config.require_runtime()
        except ConfigError as exc:
            problems.append(str(exc))
        else:
            if args.model is not None and os.path.realpath(args.model) != os.path.realpath(
                rc.model
            ):
                problems.append(
                    f"--model {args.model} is not the config's runtime.model ({rc.model}); "
                    "leave --model out with --config"
                )
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"cannot read --text {args.text}: {exc}")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return EXIT_USAGE
    return _evaluate(args, config, text)


def _usage_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.model is None and args.config is None:
        problems.append("give --model FILE (or --config FILE, whose runtime section names it)")
    if args.hot_swap and args.config is None:
        problems.append("--hot-swap needs --config FILE (its runtime section's control endpoint)")
    if args.ctx < 4:
        problems.append(f"--ctx must be >= 4, found {args.ctx}")
    if args.chunks is not None and args.chunks < 1:
        problems.append(f"--chunks must be >= 1, found {args.chunks}")
    if args.batch < 1:
        problems.append(f"--batch must be >= 1, found {args.batch}")
    return problems


def _select_products(args: argparse.Namespace, model: str | os.PathLike[str]) -> bool:
    """The libggml of ``--ggml`` for the model's types (as the sweep chooses it), made this
    process's before the runtime loads; False (said on stderr) when it cannot be."""
    from ggufswap.runtime.errors import GgmlLibraryError
    from ggufswap.runtime.kernels import ggml_select
    from ggufswap.shards import open_shard_set
    from ggufswap.sweep.libggml import AUTO, choose

    types = {int(r.ggml_type) for r in open_shard_set(model).tensors.values()}
    try:
        ggml_select(choose(args.ggml, types), preferred=args.ggml == AUTO)
    except GgmlLibraryError as exc:
        print(f"ggufswap perplexity: {exc}", file=sys.stderr)
        return False
    return True


def _evaluate(args: argparse.Namespace, config: Config | None, text: str) -> int:
    # torch is imported only by the commands that run a model
    from ggufswap.config import Storage
    from ggufswap.runtime import HotSwapRuntime
    from ggufswap.runtime.models import HParams, ModelError, build_model
    from ggufswap.runtime.serving import GgufTokenizer
    from ggufswap.runtime.serving.daemon import open_runtime
    from ggufswap.runtime.serving.errors import EvalTextError
    from ggufswap.runtime.serving.perplexity import eval_batch, text_chunks, text_tokens
    from ggufswap.runtime.serving.tokenizer_cache import cache_dir
    from ggufswap.runtime.threads import apply_thread_policy, resolve_threads

    rc = config.runtime if config is not None else None
    apply_thread_policy(resolve_threads(flag=args.threads, config=rc.threads if rc else None))
    signals = ProcessSignals().install() if args.hot_swap else None
    storage = Storage.NATIVE if args.numerics == "ggml" else Storage.DEQUANTIZED
    if args.numerics == "ggml" and not _select_products(args, rc.model if rc else args.model):
        return EXIT_USAGE
    if config is not None:
        runtime = open_runtime(config)
    else:
        runtime = HotSwapRuntime.open(args.model, storage=storage)
    try:
        assert runtime.shards is not None, "open() always records the shard set"
        hparams = HParams.from_metadata(runtime.shards.metadata, source=runtime.shards.first.path)
        try:
            model = build_model(hparams, runtime.store, store=runtime.store, numerics=args.numerics)
        except ModelError as exc:
            print(f"ggufswap perplexity: {exc}", file=sys.stderr)
            return EXIT_USAGE
        tokenizer = GgufTokenizer.from_file(runtime.shards.first.path, cache=cache_dir())
        ctx = min(args.ctx, hparams.context_length)
        if ctx < args.ctx:
            print(
                f"ggufswap perplexity: --ctx {args.ctx} is longer than the model's context "
                f"({hparams.context_length} tokens); using --ctx {ctx}",
                file=sys.stderr,
            )
        tokens, bos = text_tokens(tokenizer, text)
        try:
            chunks = text_chunks(tokens, n_ctx=ctx, max_chunks=args.chunks)
        except EvalTextError as exc:
            print(f"ggufswap perplexity: {args.text}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        evaluator = _Evaluator(
            model, eval_batch(chunks, bos), batch=args.batch, as_json=args.json,
            numerics=args.numerics,
        )  # fmt: skip
        if signals is None:
            evaluator.evaluate(runtime.weight_version, plans=[])
            return EXIT_OK
        assert config is not None, "--hot-swap is refused without --config"
        return _hot_swap(runtime, config, evaluator, signals.stop)
    finally:
        runtime.close()


class _Evaluator:
    """Evaluates the chunks and keeps one result per weight version."""

    def __init__(
        self, model: Decoder, chunks: Tensor, *, batch: int, as_json: bool, numerics: str
    ) -> None:
        self.model = model
        self.batches = list(chunks.split(batch))  # [<= batch, ctx] each, BOS in place
        self.n_chunks = len(chunks)
        self.ctx = int(chunks.shape[1])
        self.as_json = as_json
        self.numerics = numerics
        self.results: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def evaluate(self, version: int, *, plans: list[str]) -> dict[str, Any]:
        from ggufswap.runtime.progress import ProgressLog
        from ggufswap.runtime.serving.perplexity import NllStats, batch_nll, scored_per_chunk

        started = time.perf_counter()
        total = NllStats()
        progress = ProgressLog(
            "perplexity.progress", total=self.n_chunks, unit="chunks", weight_version=version
        )
        bar = None
        if sys.stderr.isatty():  # a bar on a terminal, progress lines elsewhere
            from tqdm import tqdm

            bar = tqdm(total=self.n_chunks, unit="chunk", desc="perplexity", leave=False)
        try:
            for tokens in self.batches:
                total = total + batch_nll(self.model, tokens)
                (progress if bar is None else bar).update(len(tokens))
        finally:
            if bar is not None:
                bar.close()
        result = {
            "weight_version": version,
            "perplexity": total.perplexity,
            "perplexity_unc": total.perplexity_unc,
            "mean_nll": total.mean_nll,
            "tokens": total.n_tokens,
            "chunks": self.n_chunks,
            "ctx": self.ctx,
            "scored_per_chunk": scored_per_chunk(self.ctx),
            "numerics": self.numerics,
            "plans": plans,
            "eval_s": round(time.perf_counter() - started, 3),
        }
        with self._lock:
            self.results[version] = result
        if self.as_json:
            print(json.dumps(result), flush=True)
        else:
            after = f" after {', '.join(plans)}" if plans else ""
            print(
                f"weight_version {version}{after}: perplexity {total.perplexity:.4f} +/- "
                f"{total.perplexity_unc:.5f} over {total.n_tokens} tokens ({self.n_chunks} chunks "
                f"of {self.ctx}, the second half of each scored; {self.numerics} numerics)",
                flush=True,
            )
        return result

    def status(self) -> dict[str, Any]:
        with self._lock:
            results = {str(v): dict(r) for v, r in self.results.items()}
        return {"perplexity": {"results": results}}


def _hot_swap(
    runtime: HotSwapRuntime, config: Config, evaluator: _Evaluator, stop: threading.Event
) -> int:
    from ggufswap.ipc import Event, PlanCommittedEvent, PlanStagedEvent
    from ggufswap.runtime.control import ControlServer

    staged = threading.Event()
    committed: list[str] = []  # plan ids committed since the last evaluation

    def on_event(event: Event) -> None:
        if isinstance(event, PlanStagedEvent):
            staged.set()
        elif isinstance(event, PlanCommittedEvent):
            committed.append(event.plan_id)

    runtime.on_event(on_event)
    control = ControlServer.from_config(runtime, config, extra_status=evaluator.status).start()
    try:
        evaluator.evaluate(runtime.weight_version, plans=[])
        version = runtime.weight_version
        while not stop.is_set():
            if not staged.wait(WAKE_S):
                continue
            staged.clear()
            runtime.at_batch_boundary()  # between two evaluations: each runs on one version
            if runtime.weight_version != version:
                version = runtime.weight_version
                plans, committed[:] = list(committed), []
                evaluator.evaluate(version, plans=plans)
    finally:
        control.close()
    return EXIT_OK
