"""llama4's chunked attention and attention temperature against llama.cpp, over a sequence long
enough for both to act (``make crosscheck``'s last llama4 step; the project's venv).

llama.cpp fixes Llama 4's attention chunk at 8192 positions and its NoPE layers' temperature at
``log(floor((p + 1) / 8192) + 1) * 0.1 + 1``, whatever the file says, so with the cross-check's
12 tokens neither shows. Here ``tiny-llama4`` (F32 and Q8_0) is evaluated over ``LENGTH`` tokens
(``8192 + 64``, seeded ids below 256): llama.cpp in micro-batches of 512 through its KV cache
(``llama_logits.py``), the decoder likewise (``model(chunk, start_pos=..., cache=...)``, its
chunked masks over the cached keys). The figures over ``COMPARED`` (the 128 positions around
the chunk border: positions 8192 and later see only the keys of their own chunk in three of the
four layers, and from 8191 the NoPE layer's queries are scaled by 1 + 0.1 ln 2) must meet the
cross-check's thresholds. Unless ``--only``, it writes ``tests/fixtures/crosscheck/llama4/long``
(``cases.json``, ``logits.npz``: llama.cpp's logits at ``KEPT``), which ``tests/test_llama4.py``
replays.

``python long_context.py --llama-python PY [--only F32]``; exit status 1 on a miss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import xcheck
from emulate import emulating
from gguf import GGMLQuantizationType

from ggufswap.shards.writer import ModelSpec

HERE = Path(__file__).resolve().parent
CHUNK: Final = 8192  # llama_model_llama4::load_arch_hparams' n_swa
LENGTH: Final = CHUNK + 64
UBATCH: Final = 512
COMPARED: Final = range(CHUNK - 64, LENGTH)  # both sides of the border, the last position
KEPT: Final = (*range(CHUNK - 8, CHUNK + 8), LENGTH - 1)  # the golden positions
TYPES: Final = (GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0)
FIXTURES: Final = xcheck.family_fixtures("llama4") / "long"


def tokens() -> list[int]:
    """``LENGTH`` seeded token ids below 256, BOS (1) first."""
    ids = np.random.default_rng(0).integers(3, 256, size=LENGTH)
    return [1, *(int(t) for t in ids[1:])]


def spec(ggml_type: GGMLQuantizationType) -> ModelSpec:
    """``tiny-llama4`` with every matrix in ``ggml_type`` (the cross-check's case)."""
    return replace(xcheck.case_spec("llama4", ggml_type), name=f"xc-llama4-long-{ggml_type.name}")


def project_logits(path: Path, ids: list[int], *, emulate: bool = False) -> np.ndarray:
    """``[T, V]`` logits of the decoder over ``path`` through the tensor store, the tokens fed
    in chunks of ``UBATCH`` through a KV cache; ``emulate``: with ggml's activation rounding
    (``emulate.emulating``)."""
    import torch

    from ggufswap.runtime import HotSwapRuntime
    from ggufswap.runtime.models import HParams, build_model

    runtime = HotSwapRuntime.open(path)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(
            HParams.from_metadata(runtime.shards.metadata), runtime.store, store=runtime.store
        )
        cache = model.new_cache(max_len=LENGTH)
        rows = torch.tensor([ids], dtype=torch.int64)
        rounding = emulating(runtime, path) if emulate else nullcontext()
        with torch.inference_mode(), rounding:
            parts = [
                model(rows[:, i : i + UBATCH], start_pos=i, cache=cache)[0]
                for i in range(0, LENGTH, UBATCH)
            ]
        return torch.cat(parts).numpy().astype(np.float32)
    finally:
        runtime.close()


def llama_cpp_logits(python: str, paths: dict[str, Path], ids: list[int], tmp: Path) -> Any:
    """llama.cpp's logits of ``ids`` for each file (``llama_logits.py``, micro-batches)."""
    jobs = tmp / "jobs.json"
    jobs.write_text(
        json.dumps(
            {"tokens": ids, "ubatch": UBATCH, "models": {n: str(p) for n, p in paths.items()}}
        )
    )
    out = tmp / "llama.npz"
    done = subprocess.run(
        [python, str(HERE / "llama_logits.py"), str(jobs), str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(out) as arrays:
        return {case: arrays[f"case{i}"] for i, case in enumerate(report["cases"])}, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="Python with llama-cpp-python")
    parser.add_argument("--only", help="the types whose name contains this (no fixtures)")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    ids = tokens()
    types = [t for t in TYPES if not args.only or args.only in t.name]
    failures: list[str] = []
    manifest: dict[str, Any] = {"length": LENGTH, "ubatch": UBATCH, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="ggufswap-long-") as tmp_name:
        tmp = Path(tmp_name)
        specs = {f"llama4-long/{t.name}": spec(t) for t in types}
        paths, hashes = {}, {}
        for name, s in specs.items():
            paths[name], hashes[name] = xcheck.write_case(s, tmp / name.replace("/", "-"))
        reference, report = llama_cpp_logits(args.llama_python, paths, ids, tmp)
        failures += [
            f"{n}: llama.cpp refused the file:\n{log}" for n, log in report["refused"].items()
        ]
        for name in reference:
            ours = project_logits(paths[name], ids)
            rows = list(COMPARED)
            figures = xcheck.compare(reference[name][rows], ours[rows])
            limit = xcheck.case_threshold("x/" + name.rpartition("/")[2])
            misses = figures.meets(limit)
            entry: dict[str, Any] = {"allowance": None}
            if misses:  # llama.cpp's activation rounding? (as run.py's check_case decides)
                emulated = xcheck.compare(
                    reference[name][rows], project_logits(paths[name], ids, emulate=True)[rows]
                )
                if emulated.meets(limit):
                    failures += [
                        f"{name}: {m} (also with ggml's rounding emulated)" for m in misses
                    ]
                else:
                    entry["allowance"] = {"misses": misses, "emulated_mean_kld": emulated.mean_kld}
                    print(f"  allowed: {'; '.join(misses)}; emulated {emulated.mean_kld:.1e}")
            print(
                f"{name:24s} positions {rows[0]}..{rows[-1]}: top1 {figures.top1:5.0%}  mean KLD "
                f"{figures.mean_kld:.1e}  max KLD {figures.max_kld:.1e}"
                + ("  FAIL" if misses and entry["allowance"] is None else ""),
                flush=True,
            )
            kept = list(KEPT)
            golden = xcheck.decode_logits(*xcheck.encode_logits(reference[name][kept]))
            entry["golden_figures"] = xcheck.compare(golden, ours[kept]).as_json()
            manifest["cases"][name] = {
                **entry,
                "spec": xcheck.spec_to_json(specs[name]),
                "sha256": hashes[name],
                "figures": figures.as_json(),
            }
        if not args.only and not failures:
            FIXTURES.mkdir(parents=True, exist_ok=True)
            save(manifest, {n: r[list(KEPT)] for n, r in reference.items()})
            print(f"\ngolden fixtures written to {FIXTURES}")
    for failure in failures:
        print("FAILED " + failure, file=sys.stderr)
    return 1 if failures else 0


def save(manifest: dict[str, Any], kept: dict[str, np.ndarray]) -> None:
    """The manifest and llama.cpp's logits at ``KEPT`` (int16 codes, as ``xcheck``'s)."""
    arrays: dict[str, Any] = {}
    for i, (name, rows) in enumerate(sorted(kept.items())):
        codes, offset, step = xcheck.encode_logits(rows)
        arrays |= {f"c{i}_codes": codes, f"c{i}_offset": offset, f"c{i}_step": step}
        manifest["cases"][name]["logits_key"] = f"c{i}"
    manifest["kept_positions"] = list(KEPT)
    (FIXTURES / "cases.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(FIXTURES / "logits.npz", **arrays)


if __name__ == "__main__":
    sys.exit(main())
