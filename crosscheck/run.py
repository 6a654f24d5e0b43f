"""``make crosscheck``: every case's logits in llama.cpp and in the project's decoder.

For each case of ``xcheck.all_cases()`` (every model variant the writer offers x every checked
type) this writes the model with the project's writer, has llama.cpp compute the logits of
``xcheck.TOKENS`` (``llama_logits.py``, run by the cross-check venv's Python, which has
llama-cpp-python and not this project), computes the same with the project's decoder through the
tensor store, and prints the figures: top-1 agreement, mean and max KL divergence, max
|delta logit| / std. Unless ``--only`` narrows the run, it then checks the other layouts and
writable types (``extra_checks``) and rewrites the golden fixtures (``tests/fixtures/crosscheck``)
that ``tests/test_crosscheck.py`` checks without llama.cpp.

Exit status 1 when llama.cpp refuses a file or a case misses its threshold.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import xcheck
from emulate import Routing, emulating, flips, recording

HERE = Path(__file__).resolve().parent


def llama_cpp_logits(
    python: str,
    paths: dict[str, Path],
    tmp: Path,
    *,
    quantize: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Run ``llama_logits.py`` under ``python``; returns the logits by case and its report.
    ``quantize``: llama.cpp's quantizer writes these files first (``llama_logits.py``)."""
    jobs = tmp / "jobs.json"
    out = tmp / "llama.npz"
    job: dict[str, Any] = {"tokens": xcheck.TOKENS, "models": {c: str(p) for c, p in paths.items()}}
    if quantize:
        job["quantize"] = quantize
    jobs.write_text(json.dumps(job))
    done = subprocess.run(
        [python, str(HERE / "llama_logits.py"), str(jobs), str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(out) as arrays:
        logits = {case: arrays[f"case{i}"] for i, case in enumerate(report["cases"])}
    return logits, report


def _fmt(x: float) -> str:
    return f"{x:.1e}"


def summary_table(figures: dict[str, xcheck.Figures], entries: dict[str, Any]) -> str:
    """Markdown: one row per variant, one column per type, mean KLD (top-1 % when below 100;
    a dagger where the threshold is missed because of llama.cpp's own rounding)."""
    types = [t.name for t in xcheck.CHECK_TYPES]
    lines = ["| variant | " + " | ".join(types) + " |", "|---" * (len(types) + 1) + "|"]
    for variant in xcheck.ALL_VARIANTS:
        if not any(f"{variant}/{t}" in figures for t in types):
            continue  # not run (--only, --family)
        cells = []
        for t in types:
            f = figures.get(f"{variant}/{t}")
            if f is None:
                cells.append("—")
                continue
            top1 = "" if f.top1 == 1.0 else f" ({f.top1:.0%})"
            allowed = " †" if entries[f"{variant}/{t}"]["allowance"] else ""
            cells.append(_fmt(f.mean_kld) + top1 + allowed)
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(figures: dict[str, xcheck.Figures]) -> str:
    lines = [
        "| case | top-1 | mean KLD | max KLD | max Δlogit/std |",
        "|---|---|---|---|---|",
    ]
    for case, f in figures.items():
        lines.append(
            f"| {case} | {f.top1:.0%} | {_fmt(f.mean_kld)} | {_fmt(f.max_kld)} | "
            f"{f.max_dlogit_std:.3f} |"
        )
    return "\n".join(lines)


def _within(routing: Routing, *, emulate: bool) -> Callable[[Any, Path], Any]:
    """A ``project_logits`` wrapper: record the routing, and emulate ggml's rounding if asked."""

    @contextmanager
    def within(runtime: Any, path: Path) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(recording(routing))
            if emulate:
                stack.enter_context(emulating(runtime, path))
            yield

    return within


def check_case(
    name: str,
    path: Path,
    reference: np.ndarray,
    *,
    emulate_only: bool,
    limit: xcheck.Threshold | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The manifest entry of one case (figures, and an allowance when a miss is explained) and
    its failures.

    A case that misses its threshold is run again with ggml's activation rounding emulated in the
    decoder (``emulate.py``): if that meets the threshold, the miss is llama.cpp's own rounding
    (recorded as the case's allowance, with the routing decisions it flips); if not, it fails.
    """
    ggml_type = next(t for t in xcheck.CHECK_TYPES if name.endswith("/" + t.name))
    limit = limit or xcheck.case_threshold(name)
    routing: Routing = []
    ours = xcheck.project_logits(path, within=_within(routing, emulate=emulate_only))
    full = xcheck.compare(reference, ours)
    positions = list(xcheck.GOLDEN_POSITIONS)
    golden = xcheck.decode_logits(*xcheck.encode_logits(reference[positions]))
    at_golden = xcheck.compare(golden, ours[positions])
    misses = full.meets(limit) + at_golden.meets(limit)
    entry: dict[str, Any] = {
        "type": ggml_type.name,
        "figures": full.as_json(),
        "golden_figures": at_golden.as_json(),
        "allowance": None,
    }
    line = (
        f"{name:28s} top1 {full.top1:5.0%}  mean KLD {_fmt(full.mean_kld)}  "
        f"max KLD {_fmt(full.max_kld)}  max dlogit/std {full.max_dlogit_std:.3f}"
    )
    failures: list[str] = []
    if misses and not emulate_only:
        emulated_routing: Routing = []
        emulated = xcheck.compare(
            reference,
            xcheck.project_logits(path, within=_within(emulated_routing, emulate=True)),
        )
        changed, total, margin = flips(routing, emulated_routing)
        if emulated.meets(limit):
            failures = [f"{name}: {m} (also with ggml's rounding emulated)" for m in misses]
        else:
            flipped = f"{changed} of {total} routing decisions" if total else "no routing decision"
            entry["allowance"] = {
                "misses": misses,
                "reason": (
                    f"llama.cpp's activation rounding: emulated in the decoder it flips {flipped}"
                    + (f" (smallest margin {margin:.1e})" if changed else "")
                    + f" and the case meets its threshold (mean KLD {emulated.mean_kld:.1e})"
                ),
                "emulated_mean_kld": emulated.mean_kld,
                "routing_flips": changed,
            }
            line += f"  (allowed: {'; '.join(misses)}; emulated {_fmt(emulated.mean_kld)}"
            line += f", {changed}/{total} routing flips)" if total else ")"
    elif misses:
        failures = [f"{name}: {m}" for m in misses]
    print(line + ("  FAIL" if failures else ""), flush=True)
    return entry, failures


def extra_checks(python: str, cases: dict[str, Any], tmp: Path) -> list[str]:
    """The layouts and the other writable types (``xcheck.LAYOUTS``, ``other_type_specs``): every
    file loads in llama.cpp, a split or per-tensor model gives its single file's logits exactly,
    and each other type agrees within the 4-bit threshold. Returns the failures."""
    paths: dict[str, Path] = {}
    single = cases[xcheck.LAYOUT_CASE]
    for layout in xcheck.LAYOUTS:
        name = f"{xcheck.LAYOUT_CASE}@{layout.value}"
        paths[name] = xcheck.write_layout(single, tmp / "layouts" / layout.value, layout)
    paths[xcheck.LAYOUT_CASE] = xcheck.write_case(single, tmp / "layouts" / "single")[0]
    others = xcheck.other_type_specs()
    for name, spec in others.items():
        paths[name] = xcheck.write_case(spec, tmp / name.replace("/", "-"))[0]
    reference, report = llama_cpp_logits(python, paths, tmp / "layouts")
    failures = [f"{n}: llama.cpp refused the file:\n{log}" for n, log in report["refused"].items()]
    for layout in xcheck.LAYOUTS:
        name = f"{xcheck.LAYOUT_CASE}@{layout.value}"
        same = name in reference and np.array_equal(reference[name], reference[xcheck.LAYOUT_CASE])
        print(f"{name:28s} llama.cpp logits {'equal' if same else 'DIFFER from'} the single file's")
        if not same:
            failures.append(f"{name}: llama.cpp's logits differ from the single file's")
    limit = xcheck.Threshold(1e-2, exact_top1=False)
    for name in others:
        if name not in reference:
            continue
        f = xcheck.compare(reference[name], xcheck.project_logits(paths[name]))
        misses = f.meets(limit)
        failures += [f"{name}: {m}" for m in misses]
        print(
            f"{name:28s} top1 {f.top1:5.0%}  mean KLD {_fmt(f.mean_kld)}  "
            f"max KLD {_fmt(f.max_kld)}  max dlogit/std {f.max_dlogit_std:.3f}"
            + ("  FAIL" if misses else "")
        )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="Python with llama-cpp-python")
    parser.add_argument("--only", help="run the cases whose name contains this (no fixtures)")
    parser.add_argument(
        "--family",
        choices=sorted(xcheck.FAMILY_VARIANTS),
        help="run one family's cases and rewrite only its fixture files (xcheck.FAMILY_VARIANTS)",
    )
    parser.add_argument("--details", action="store_true", help="print one row per case too")
    parser.add_argument(
        "--emulate-ggml-activations",
        action="store_true",
        help="round the decoder's activations as ggml's CPU matmul does (emulate.py; an "
        "experiment: no fixtures are written)",
    )
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    cases = xcheck.all_cases()
    if args.only:
        cases = {name: spec for name, spec in cases.items() if args.only in name}
    if args.family:
        cases = {
            name: spec for name, spec in cases.items() if xcheck.family_of(name) == args.family
        }
    manifest: dict[str, Any] = {"tokens": list(xcheck.TOKENS), "cases": {}}
    figures: dict[str, xcheck.Figures] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ggufswap-crosscheck-") as tmp_name:
        tmp = Path(tmp_name)
        paths, hashes = {}, {}
        for name, spec in cases.items():
            paths[name], hashes[name] = xcheck.write_case(spec, tmp / name.replace("/", "-"))
        reference, report = llama_cpp_logits(args.llama_python, paths, tmp)
        manifest["llama_cpp"] = report.get("version", "")
        manifest["kv_cache"] = "F32"
        for name, log in report["refused"].items():
            failures.append(f"{name}: llama.cpp refused the file:\n{log}")
        for name, spec in cases.items():
            if name not in reference:
                continue
            entry, missed = check_case(
                name, paths[name], reference[name], emulate_only=args.emulate_ggml_activations
            )
            figures[name] = xcheck.Figures(**entry["figures"])
            failures += missed
            spec_json = xcheck.spec_to_json(spec)
            manifest["cases"][name] = {"spec": spec_json, "sha256": hashes[name], **entry}
        if not args.only and not args.family and not args.emulate_ggml_activations:
            print()
            failures += extra_checks(args.llama_python, cases, tmp)
    print("\n" + summary_table(figures, manifest["cases"]))
    if args.details:
        print("\n" + detail_table(figures))
    if not args.only and not args.emulate_ggml_activations and not report["refused"]:
        xcheck.save_golden_by_family(manifest, reference)
        where = xcheck.family_fixtures(args.family)
        print(f"\ngolden fixtures written to {where}{'' if args.family else ' (and each family)'}")
    for failure in failures:
        print("FAILED " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
