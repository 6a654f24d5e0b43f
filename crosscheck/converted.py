"""The cross-check on files llama.cpp itself made: its converter and its quantizer.

``python converted.py --llama-python PY --convert-python PY --llama-src DIR``: ``convert_tiny.py``
(in ``.venv-convert``: torch, transformers) writes tiny Hugging Face checkpoints of each hybrid
architecture and converts them with llama.cpp's ``convert_hf_to_gguf.py`` (F32, F16; a wide
checkpoint for the K-quants); ``llama_logits.py`` (in the cross-check venv) quantizes with
llama.cpp's quantizer (Q8_0 from the tiny F32 file, Q4_K_S from the wide one) and computes
llama.cpp's logits of ``xcheck.TOKENS``; the project's decoder reads each file through the tensor
store as the server does, and the figures must meet ``threshold``: top-1 100% and mean KLD < 1e-6
at F32 (both compute in float), the writer cases' thresholds for the other types, with the same
allowance for llama.cpp's activation rounding (emulated, the case must meet its threshold).

Without ``--only`` it records ``tests/fixtures/crosscheck/converted/``: the tiny F32 files, the
manifest (figures, sha256 of every file) and llama.cpp's logits, which
``tests/test_crosscheck_converted.py`` replays without llama.cpp or the converter.
Exit status 1 when a file is refused or a case misses its threshold.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Final

import xcheck
from run import check_case, llama_cpp_logits

HERE = Path(__file__).resolve().parent
FIXTURES: Final = xcheck.FIXTURES / "converted"
# llama.cpp's LLAMA_FTYPE_* of the quantized files, and the file each is made from.
QUANTIZED: Final = {"Q8_0": (7, "tiny"), "Q4_K": (14, "wide")}  # MOSTLY_Q8_0, MOSTLY_Q4_K_S
F32_LIMIT: Final = xcheck.Threshold(1e-6, exact_top1=True)


def threshold(name: str) -> xcheck.Threshold:
    """F32: both sides compute in float (1e-6); the other types: the writer cases' thresholds."""
    type_name = name.rpartition("/")[2]
    return F32_LIMIT if type_name == "F32" else xcheck.case_threshold(f"x/{type_name}")


def convert(
    convert_python: str, llama_src: Path, out: Path, *, family: str | None = None
) -> dict[str, Path]:
    """``convert_tiny.py`` (or for a family, ``convert_families.py --only FAMILY``) under
    ``convert_python``: ``{NAME-SIZE/TYPE: path}``."""
    script = ["convert_tiny.py"] if family is None else ["convert_families.py", "--only", family]
    done = subprocess.run(
        [
            convert_python,
            str(HERE / script[0]),
            *script[1:],
            "--llama-src",
            str(llama_src),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    files = json.loads(done.stdout.strip().splitlines()[-1])["files"]
    return {name: Path(path) for name, path in files.items()}


def cases(converted: dict[str, Path], out: Path) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """The cases (``ARCH/TYPE`` -> file) and the quantize jobs that make the quantized ones."""
    paths: dict[str, Path] = {}
    jobs = []
    for name, path in converted.items():
        stem, _, type_name = name.partition("/")
        arch, size = stem.rsplit("-", 1)
        if size == "tiny":
            paths[f"{arch}/{type_name}"] = path
        for q_type, (ftype, source) in QUANTIZED.items():
            if size == source and type_name == "F32":
                dst = out / f"{arch}-{q_type}.gguf"
                jobs.append({"src": str(path), "dst": str(dst), "ftype": ftype})
                paths[f"{arch}/{q_type}"] = dst
    return paths, jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="Python with llama-cpp-python")
    parser.add_argument("--convert-python", required=True, help="Python with torch, transformers")
    parser.add_argument("--llama-src", required=True, type=Path, help="the vendored llama.cpp")
    parser.add_argument("--only", help="the cases whose name contains this (no fixtures)")
    parser.add_argument(
        "--family",
        choices=sorted(xcheck.FAMILY_VARIANTS),
        help="convert_families.py's checkpoint of this family; fixtures under its own folder",
    )
    args = parser.parse_args(argv)
    fixtures = (
        FIXTURES if args.family is None else xcheck.family_fixtures(args.family) / "converted"
    )

    import torch

    torch.set_num_threads(1)
    failures: list[str] = []
    manifest: dict[str, Any] = {"tokens": list(xcheck.TOKENS), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="ggufswap-converted-") as tmp_name:
        tmp = Path(tmp_name)
        converted = convert(args.convert_python, args.llama_src, tmp, family=args.family)
        paths, jobs = cases(converted, tmp)
        if args.only:
            paths = {n: p for n, p in paths.items() if args.only in n}
        # llama_logits.py runs the quantize jobs first, then every case's logits.
        reference, report = llama_cpp_logits(args.llama_python, paths, tmp, quantize=jobs)
        manifest["llama_cpp"] = report.get("version", "")
        failures += [
            f"{n}: llama.cpp refused the file:\n{log}" for n, log in report["refused"].items()
        ]
        logits = {}
        for name, path in paths.items():
            if name not in reference:
                continue
            entry, missed = check_case(
                name, path, reference[name], emulate_only=False, limit=threshold(name)
            )
            failures += missed
            entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
            entry["file"] = path.name if name.endswith("/F32") else None
            manifest["cases"][name] = entry
            logits[name] = reference[name]
        if not args.only and not failures:
            if fixtures.exists():
                shutil.rmtree(fixtures)
            fixtures.mkdir(parents=True)
            for name, entry in manifest["cases"].items():
                if entry["file"]:
                    shutil.copy2(paths[name], fixtures / entry["file"])
            xcheck.save_golden(manifest, logits, fixtures)
            print(f"\ngolden fixtures written to {fixtures}")
    for failure in failures:
        print("FAILED " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
