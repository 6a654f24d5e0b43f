"""``make crosscheck``, the families recorded in fixtures of their own (``xfamily.FAMILIES``).

``python families.py --llama-python PY --ik-python PY [--only FAMILY] [--details]``: for each
family (DeepSeek-V3.2 / GLM-5.x ``dsa``; ik_llama.cpp's three-tensor deepseek2 ``ik-mla``), every
variant x ``xcheck.CHECK_TYPES`` case is written by the project's writer, its reference computes
the logits of ``xcheck.TOKENS`` (llama.cpp through ``llama_logits.py`` in the cross-check venv, or
ik_llama.cpp through ``ik_logits.py`` in ``.venv-ik``, as ``xfamily.ENGINES`` says), the
project's decoder computes them through the tensor store, and ``run.check_case`` measures and
judges each case (the same thresholds and allowances as ``run.py``; for ik_llama.cpp a miss is
explained by ik's rounding, ``emulate.ROUNDING = "ik"``). Each family's golden fixtures
go to ``tests/fixtures/crosscheck/<family>/`` (``tests/test_crosscheck_families.py`` replays
them), unless ``--only`` narrows the run.

Exit status 1 when a reference refuses a file or a case misses its threshold.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import emulate
import numpy as np
import xcheck
import xfamily
from run import HERE, check_case, detail_table, llama_cpp_logits


def ik_llama_logits(
    python: str, paths: dict[str, Path], tmp: Path
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Run ``ik_logits.py`` under ``python``: the logits by case and its report."""
    jobs, out = tmp / "ik-jobs.json", tmp / "ik.npz"
    jobs.write_text(
        json.dumps({"tokens": xcheck.TOKENS, "models": {c: str(p) for c, p in paths.items()}})
    )
    done = subprocess.run(
        [python, str(HERE / "ik_logits.py"), str(jobs), str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(out) as arrays:
        logits = {case: arrays[f"case{i}"] for i, case in enumerate(report["cases"])}
    return logits, report


def check_own_type(
    name: str, path: Path, reference: np.ndarray, limit: xcheck.Threshold
) -> tuple[dict[str, Any], list[str]]:
    """``run.check_case`` for a type it does not know (ik_llama.cpp's): the figures against
    ``limit``, and a miss allowed when the decoder with the reference's rounding emulated
    (``emulate.ROUNDING``) meets it."""
    ours = xcheck.project_logits(path)
    figures = xcheck.compare(reference, ours)
    positions = list(xcheck.GOLDEN_POSITIONS)
    golden = xcheck.decode_logits(*xcheck.encode_logits(reference[positions]))
    at_golden = xcheck.compare(golden, ours[positions])
    entry: dict[str, Any] = {
        "type": name.rpartition("/")[2],
        "figures": figures.as_json(),
        "golden_figures": at_golden.as_json(),
        "allowance": None,
    }
    misses = figures.meets(limit) + at_golden.meets(limit)
    line = f"{name:28s} top1 {figures.top1:5.0%}  mean KLD {figures.mean_kld:.1e}"
    if misses:
        emulated = xcheck.compare(reference, xcheck.project_logits(path, within=emulate.emulating))
        if emulated.meets(limit):
            print(line + "  FAIL", flush=True)
            return entry, [f"{name}: {m} (also with the rounding emulated)" for m in misses]
        reason = f"{emulate.ROUNDING}'s activation rounding: emulated, mean KLD "
        entry["allowance"] = {
            "misses": misses,
            "reason": reason + f"{emulated.mean_kld:.1e}",
            "emulated_mean_kld": emulated.mean_kld,
        }
        line += f"  (allowed: {'; '.join(misses)}; emulated {emulated.mean_kld:.1e})"
    print(line, flush=True)
    return entry, []


def summary(family: str, figures: dict[str, xcheck.Figures], entries: dict[str, Any]) -> str:
    """Markdown: one row per variant of ``family``, one column per type, mean KLD (top-1 % when
    below 100; a dagger for a recorded allowance)."""
    own = xfamily.EXTRA_TYPES.get(family, ())
    types = [t.name for t in (*xcheck.CHECK_TYPES, *own)]
    lines = ["| variant | " + " | ".join(types) + " |", "|---" * (len(types) + 1) + "|"]
    for variant in xfamily.FAMILIES[family]:
        cells = []
        for t in types:
            f = figures.get(f"{variant}/{t}")
            if f is None:
                cells.append("—")
                continue
            top1 = "" if f.top1 == 1.0 else f" ({f.top1:.0%})"
            dagger = " †" if entries[f"{variant}/{t}"]["allowance"] else ""
            cells.append(f"{f.mean_kld:.1e}{top1}{dagger}")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_family(
    family: str, args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, Any], dict[str, np.ndarray], list[str]]:
    """One family's manifest, reference logits and failures."""
    cases = xfamily.all_cases(family)
    if args.only and args.only != family:
        cases = {n: s for n, s in cases.items() if args.only in n}
    paths, hashes = {}, {}
    for name, spec in cases.items():
        paths[name], hashes[name] = xcheck.write_case(spec, tmp / name.replace("/", "-"))
    engine = xfamily.ENGINES[family]
    if engine == "ik_llama.cpp":
        reference, report = ik_llama_logits(args.ik_python, paths, tmp)
        emulate.ROUNDING = "ik"  # a miss is explained by ik's rounding, not ggml's
    else:
        reference, report = llama_cpp_logits(args.llama_python, paths, tmp)
        emulate.ROUNDING = "llama.cpp"
    manifest: dict[str, Any] = {
        "tokens": list(xcheck.TOKENS),
        "reference": engine,
        "reference_version": report.get("version", "ik-llama-cpp-python 0.1.5"),
        "kv_cache": "F32",
        "cases": {},
    }
    failures = [f"{n}: {engine} refused the file:\n{log}" for n, log in report["refused"].items()]
    figures = {}
    for name, spec in cases.items():
        if name not in reference:
            continue
        if name.rpartition("/")[2] in {t.name for t in xcheck.CHECK_TYPES}:
            entry, missed = check_case(name, paths[name], reference[name], emulate_only=False)
        else:
            limit = xcheck.case_threshold(name)
            entry, missed = check_own_type(name, paths[name], reference[name], limit)
        figures[name] = xcheck.Figures(**entry["figures"])
        failures += missed
        spec_json = xcheck.spec_to_json(spec)
        manifest["cases"][name] = {"spec": spec_json, "sha256": hashes[name], **entry}
    print(f"\n{family} ({engine}):\n" + summary(family, figures, manifest["cases"]))
    if args.details:
        print("\n" + detail_table(figures))
    return manifest, reference, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="Python with llama-cpp-python")
    parser.add_argument("--ik-python", required=True, help="Python with ik-llama-cpp-python")
    parser.add_argument("--only", help="a family, or the cases whose name contains this")
    parser.add_argument("--details", action="store_true", help="print one row per case too")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    failures: list[str] = []
    for family in xfamily.FAMILIES:
        if (
            args.only
            and args.only != family
            and not any(args.only in name for name in xfamily.all_cases(family))
        ):
            continue
        with tempfile.TemporaryDirectory(prefix=f"ggufswap-{family}-") as tmp_name:
            manifest, reference, missed = check_family(family, args, Path(tmp_name))
        failures += missed
        whole = not args.only or args.only == family
        if whole and not missed:
            xcheck.save_golden(manifest, reference, xfamily.fixtures_of(family))
            print(f"golden fixtures written to {xfamily.fixtures_of(family)}")
    for failure in failures:
        print("FAILED " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
