"""The newer architectures' files against ik_llama.cpp (the ``ik-llama-cpp-python`` wheel in
``.venv-ik``), in F32 and in two of ik's own types; run by hand, prints the figures.

``python ik_check.py --ik-python .venv-ik/bin/python``: for each family variant of
``xcheck.FAMILY_VARIANTS``, the writer's file with every matrix in F32, IQ4_KS (K-quant rows of
256: the widened variant) and Q6_0 (ik-only types llama.cpp cannot read); ik_llama.cpp's logits of
``xcheck.TOKENS`` (``ik_logits.py``: F32 K and F16 V cache) against the decoder's through the
tensor store.
Exit status 1 when ik_llama.cpp refuses a file. docs/models.md records what it printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import xcheck
from gguf import GGMLQuantizationType

from ggufswap.shards.ggml_types import GGMLType

HERE = Path(__file__).resolve().parent
TYPES = (GGMLQuantizationType.F32, GGMLType.IQ4_KS, GGMLType.Q6_0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ik-python", required=True, help="Python with ik-llama-cpp-python")
    parser.add_argument(
        "--variants",
        nargs="+",
        help="xcheck variants to check (default: every family variant; ik_llama.cpp also loads "
        "qwen35, qwen35moe and qwen3next, not deepseek32 or glm-dsa)",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="every case at the widened shapes of the K-quant rows (heads of 128, a delta-net "
        "state of 64: ik's hybrids disagree with mainline at the narrow ones)",
    )
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    variants = args.variants or [v for family in xcheck.FAMILY_VARIANTS.values() for v in family]
    with tempfile.TemporaryDirectory(prefix="ggufswap-ik-") as tmp_name:
        tmp = Path(tmp_name)
        paths = {}
        for variant in variants:
            for t in TYPES:
                name = f"{variant}/{t.name}"
                spec = xcheck.case_spec(variant, GGMLType.IQ4_KS if args.wide else t)
                if args.wide:  # the widened spec, every matrix role in t
                    matrices = {r: t for r, q in spec.types.items() if q == GGMLType.IQ4_KS}
                    spec = dataclasses.replace(spec, name=f"{spec.name}-{t.name}", types=matrices)
                paths[name] = xcheck.write_case(spec, tmp / name.replace("/", "-"))[0]
        jobs = tmp / "jobs.json"
        models = {n: str(p) for n, p in paths.items()}
        jobs.write_text(json.dumps({"tokens": list(xcheck.TOKENS), "models": models}))
        out = tmp / "ik.npz"
        done = subprocess.run(
            [args.ik_python, str(HERE / "ik_logits.py"), str(jobs), str(out)],
            check=True,
            capture_output=True,
            text=True,
        )
        report = json.loads(done.stdout.strip().splitlines()[-1])
        with np.load(out) as arrays:
            for i, name in enumerate(report["cases"]):
                f = xcheck.compare(arrays[f"case{i}"], xcheck.project_logits(paths[name]))
                figures = f"top1 {f.top1:5.0%}  mean KLD {f.mean_kld:.1e}  max KLD {f.max_kld:.1e}"
                print(f"{name:28s} {figures}")
    for name, log in report["refused"].items():
        print(f"REFUSED {name}: {log}", file=sys.stderr)
    return 1 if report["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
