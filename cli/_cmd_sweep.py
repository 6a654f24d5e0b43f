"""``ggufswap sweep``: per-tensor quantization benchmarking of a GGUF model with PPL and KLD.

Loads the model once, evaluates the baseline once, then for every round of the recipe swaps the
round's tensors to the target type, measures PPL and KL divergence against the baseline
(llama-perplexity's protocol and figures), restores them and checks that the logits are the
baseline's again bit for bit. Results go to ``--out``: ``ppl_results.csv`` and
``kld_results.csv`` (the GGUF Tool Suite's layout), ``rounds.jsonl`` (one verified round a line,
the journal a restart resumes from), ``report.json``, and a table on stdout. See docs/sweep.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ggufswap._cmd_runtime import add_threads_option

if TYPE_CHECKING:
    from ggufswap.sweep import Recipe, Round, SweepOptions, SweepReport, TensorSet

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
DEFAULT_CTX: Final = 512


def register(subparsers: Any) -> None:
    """Size: one flat list of options, long but not complex."""
    parser = subparsers.add_parser(
        "sweep",
        help="per-tensor quantization sweep of a model: PPL and KLD per tensor and quant type",
        description=(
            "Swap each tensor (or group) the recipe names to each target quant type, measure PPL "
            "and KL divergence against the baseline as llama-perplexity --kl-divergence does, "
            "restore and verify; results as the GGUF Tool Suite's ppl_results.csv and "
            "kld_results.csv. Resumable: run the same command again after a kill."
        ),
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--model", metavar="FILE", help="GGUF file or any shard (in-process)")
    target.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="run against a runtime process and an agent as this config describes them "
        "(its runtime.model laid out one tensor per shard; see docs/sweep.md)",
    )
    parser.add_argument("--text", required=True, metavar="FILE", help="UTF-8 evaluation text")
    parser.add_argument("--recipe", required=True, metavar="FILE", help="YAML recipe")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="results dir")
    parser.add_argument(
        "--ctx", type=int, default=DEFAULT_CTX, metavar="N", help="tokens per chunk (512)"
    )
    parser.add_argument("--chunks", type=int, metavar="N", help="evaluate at most N chunks")
    parser.add_argument(
        "--verify-chunks",
        type=int,
        default=1,
        metavar="N",
        help="chunks re-evaluated after each restore to check the baseline logits (0: all)",
    )
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="TYPE=PATH",
        help="take TYPE's tensors from PATH: a GGUF of the same model in that type, or a "
        "directory of its per-tensor shards (the Tool Suite's quant_downloader.sh layout); "
        "repeatable",
    )
    parser.add_argument(
        "--baseline",
        metavar="MODEL",
        help="measure KLD against this model's logits (e.g. the BF16 or Q8_0 model whose "
        "tensors the swaps replace; default: the swept model itself)",
    )
    parser.add_argument(
        "--imatrix", type=Path, metavar="FILE", help="importance matrix for ik's llama-quantize"
    )
    parser.add_argument(
        "--storage",
        choices=("dequantized", "native", "auto"),
        help="how the in-process runtime holds weights (native by default; --numerics ggml "
        "needs it; with --config: runtime.storage)",
    )
    parser.add_argument(
        "--numerics",
        choices=("exact", "ggml"),
        default="ggml",
        help="ggml (default): activations rounded as llama.cpp's CPU kernels round them, figures "
        "comparable with llama-perplexity's (native storage); exact: float products (no "
        "rounding noise in the figures; docs/sweep.md)",
    )
    parser.add_argument(
        "--ggml",
        default="auto",
        metavar="auto|mainline|ik|off|PATH",
        help="with --numerics ggml, whose libggml multiplies: mainline (llama-cpp-python's: "
        "figures comparable with llama.cpp's), ik (ik-llama-cpp-python's: with ik_llama.cpp's), "
        "off (emulated), a libggml's path; auto (default): mainline when llama-cpp-python is "
        "installed and every type of the sweep is mainline's, else ik",
    )
    parser.add_argument(
        "--keep-scratch",
        action="store_true",
        help="keep OUT/scratch (the rounds' tensors) at the end (removed round by round otherwise)",
    )
    parser.add_argument(
        "--ppl-percent",
        action="store_true",
        help="ppl_results.csv as the Tool Suite's percent deltas against the baseline (+1.23%%)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-plot", action="store_true", help="no OUT/sweep.png (written when matplotlib is)"
    )
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="spread the rounds over the workers of a Ray cluster (ggufswap[ray]): ADDRESS as "
        "ray.init takes it, or 'auto' (this machine's cluster, else a new local one); the model "
        "(and each --source) must be at the same path on every node; see docs/scale-out.md",
    )
    parser.add_argument(
        "--ray-workers",
        type=int,
        metavar="N",
        help="with --ray: N workers (default one per alive node); --threads is per worker",
    )
    parser.add_argument(
        "--ray-placement-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="with --ray: end the sweep when the workers cannot be placed within S seconds "
        "(one line names what was asked and what the cluster has free; default 60)",
    )
    add_threads_option(parser)
    parser.set_defaults(func=run)


def _problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.ctx < 4:
        problems.append(f"--ctx must be >= 4, found {args.ctx}")
    if args.chunks is not None and args.chunks < 1:
        problems.append(f"--chunks must be >= 1, found {args.chunks}")
    if args.verify_chunks < 0:
        problems.append(f"--verify-chunks must be >= 0, found {args.verify_chunks}")
    for item in args.source:
        if "=" not in item:
            problems.append(f"--source expects TYPE=PATH, found {item!r}")
    if args.ray is not None and args.config is not None:
        problems.append("--ray runs in-process workers (--model); it does not take --config")
    if args.ray_workers is not None and (args.ray is None or args.ray_workers < 1):
        problems.append(f"--ray-workers must be >= 1 and needs --ray, found {args.ray_workers}")
    if args.ray_placement_timeout <= 0:
        problems.append(f"--ray-placement-timeout must be > 0, found {args.ray_placement_timeout}")
    if args.numerics == "ggml" and args.storage not in (None, "native"):
        problems.append(f"--numerics ggml needs --storage native, found {args.storage}")
    return problems


def _sources(items: list[str]) -> dict[int, TensorSet]:
    from ggufswap.sweep import open_source, parse_qtype

    out: dict[int, TensorSet] = {}
    for item in items:
        type_name, _, path = item.partition("=")
        target = parse_qtype(type_name)
        out[int(target)] = open_source(path, target)
    return out


def _options(args: argparse.Namespace) -> SweepOptions:
    from ggufswap.config import Storage
    from ggufswap.runtime.models import Numerics
    from ggufswap.sweep import SweepOptions

    return SweepOptions(
        n_ctx=args.ctx,
        max_chunks=args.chunks,
        verify_chunks=args.verify_chunks,
        storage=Storage(args.storage or "native"),
        numerics=Numerics(args.numerics),
        ggml=args.ggml,
        plot=not args.no_plot,
        keep_scratch=args.keep_scratch,
        ppl_percent=args.ppl_percent,
    )


def run(args: argparse.Namespace) -> int:
    from ggufswap._logsetup import configure_logging
    from ggufswap.runtime.serving.errors import EvalTextError
    from ggufswap.shards import ShardError
    from ggufswap.sweep import Recipe, RecipeError, SweepLibraryError

    if args.log_level == "info":  # the default: the bar and the table say it all
        configure_logging(level="error")
    problems = _problems(args)
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"cannot read --text {args.text}: {exc}")
    recipe = None
    try:
        recipe = Recipe.load(args.recipe)
    except RecipeError as exc:
        problems.append(str(exc))
    try:
        # with --ray the sources are opened by the workers, on their nodes
        sources = _sources(args.source) if not problems and args.ray is None else {}
    except (ShardError, SweepLibraryError, ValueError) as exc:
        problems.append(f"--source: {exc}")
    if problems:
        print("\n".join(f"ggufswap sweep: {p}" for p in problems), file=sys.stderr)
        return EXIT_USAGE
    assert recipe is not None, "a recipe that failed to load is a problem above"
    try:
        if args.config is not None:
            report = _process_sweep(args, recipe, sources)
        elif args.ray is not None:
            report = _ray_sweep(args, text, recipe)
        else:
            report = _sweep(args, text, recipe, sources)
    except (EvalTextError, ShardError, SweepLibraryError) as exc:
        print(f"ggufswap sweep: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _print_report(report)
    return EXIT_OK


def _announce(line: str) -> None:
    print(f"ggufswap sweep: {line}", file=sys.stderr, flush=True)


def _announce_over_bar(line: str) -> None:
    """A line above the progress bar (the Ray sweep's restarts and retries mid-sweep)."""
    from tqdm import tqdm

    tqdm.write(f"ggufswap sweep: {line}", file=sys.stderr)


def _sweep(
    args: argparse.Namespace, text: str, recipe: Recipe, models: dict[int, TensorSet]
) -> SweepReport:
    # torch is imported only by the commands that run a model
    from ggufswap.runtime.threads import apply_thread_policy, resolve_threads
    from ggufswap.sweep import run_sweep

    apply_thread_policy(resolve_threads(flag=args.threads))
    return run_sweep(
        args.model,
        text=text,
        recipe=recipe,
        out_dir=args.out.resolve(),
        options=_options(args),
        models=models,
        baseline_model=args.baseline,
        imatrix=args.imatrix,
        progress=_no_bar if args.no_progress else _bar,
        announce=_announce,
    )


def _ray_sweep(args: argparse.Namespace, text: str, recipe: Recipe) -> SweepReport:
    from ggufswap.sweep import SweepError, parse_qtype

    try:
        from ggufswap.sweep.ray_driver import RayOptions, run_ray_sweep
    except ImportError as exc:
        raise SweepError(f"--ray needs Ray: pip install 'ggufswap[ray]' ({exc})") from None
    sources = {}
    for item in args.source:
        type_name, _, path = item.partition("=")
        sources[int(parse_qtype(type_name))] = str(Path(path).resolve())
    try:
        return run_ray_sweep(
            str(Path(args.model).resolve()),
            text=text,
            recipe=recipe,
            out_dir=args.out.resolve(),
            options=_options(args),
            ray_options=RayOptions(
                address=args.ray,
                workers=args.ray_workers,
                threads=args.threads,
                placement_timeout_s=args.ray_placement_timeout,
            ),
            sources=sources,
            baseline_model=_resolved(args.baseline),
            imatrix=_resolved(args.imatrix),
            progress=_no_bar if args.no_progress else _bar,
            announce=_announce if args.no_progress else _announce_over_bar,
        )
    except ConnectionError as exc:
        raise SweepError(f"--ray {args.ray}: cannot reach the Ray cluster: {exc}") from None


def _resolved(path: str | Path | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def _process_sweep(
    args: argparse.Namespace, recipe: Recipe, models: dict[int, TensorSet]
) -> SweepReport:
    from ggufswap.config import ConfigError, load_config
    from ggufswap.sweep import Sweep, SweepError
    from ggufswap.sweep.procs import ProcessTarget

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        raise SweepError(str(exc)) from None
    out_dir: Path = args.out.resolve()
    target = ProcessTarget(
        config_path=args.config.resolve(),
        config=config,
        text=Path(args.text).resolve(),
        out_dir=out_dir,
        n_ctx=args.ctx,
        max_chunks=args.chunks,
        threads=args.threads,
        numerics=args.numerics,
        ggml=args.ggml,
        targets=recipe.targets,
        verify_chunks=args.verify_chunks,
        models=models,
        baseline_model=args.baseline,
        imatrix=args.imatrix,
    )
    _announce(f"starting the runtime and the agent (logs in {out_dir}/logs)")
    try:
        target.start()
        sweep = Sweep(
            target=target,
            recipe=recipe,
            out_dir=out_dir,
            options=_options(args),
            progress=_no_bar if args.no_progress else _bar,
        )
        return sweep.run()
    finally:
        for line in target.close():
            print(f"ggufswap sweep: {line}", file=sys.stderr)


def _bar(rounds: Iterator[Round], total: int) -> Iterator[Round]:
    from tqdm import tqdm

    with tqdm(total=total, unit="round", file=sys.stderr, dynamic_ncols=True) as bar:
        for r in rounds:
            bar.set_postfix_str(r.key, refresh=True)
            yield r
            bar.update(1)


def _no_bar(rounds: Iterator[Round], total: int) -> Iterator[Round]:
    return rounds


def _print_report(report: SweepReport) -> None:
    from ggufswap.sweep.results import KLD_CSV, PPL_CSV, render_table

    table = render_table(
        report.journal.values(), ppl_base=report.ppl_base, protocol=report.protocol
    )
    print("\n".join(table))
    for skip in report.skipped:
        target = "" if skip.target == "*" else f" ({skip.target})"
        same = " (recorded as baseline-equivalent)" if skip.equivalent else ""
        print(f"skipped {skip.unit}{target}: {skip.reason}{same}")
    for refused in report.refused:
        print(f"refused {refused['key']}: {refused['why']}")
    done = len(report.journal)
    print(
        f"{done} of {report.rounds_planned} rounds recorded ({len(report.recorded)} now, "
        f"{report.resumed} from the journal); every restore reproduced the baseline logits"
    )
    print(f"disk high-water mark: {report.disk_high_water} bytes (scratch + saved originals)")
    print(f"results: {report.out_dir / PPL_CSV}, {report.out_dir / KLD_CSV}")
    if report.plot is not None:
        print(report.plot.note)
