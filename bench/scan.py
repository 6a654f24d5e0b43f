"""Shard-index scan time of a one-tensor-per-shard model (1,000 shards by default).

    python bench/scan.py [--quick] [--shards N]

Rows (``run(quick)`` returns them for ``bench/run_all.py``):

* cold scan by the agent's index vs ``open_shard_set`` on the same files (the bare shard layer,
  measured in the same run; the index also resolves links, applies ignore/glob and groups sets);
* cold scan against the 2 s budget of the agent issue (baseline_s is that budget, not a timing);
* rescan after one shard changed vs the cold scan (HeaderCache: only the changed file is parsed).

Files are written with plain writes (no fsync) into a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType

from ggufswap.agent import ModelIndex
from ggufswap.config import ModelConfig, WatchConfig
from ggufswap.shards import HeaderCache, open_shard_set
from ggufswap.shards.keys import Keys
from ggufswap.shards.writer import TypedValue, encode_metadata

BUDGET_S = 2.0


def _pad(n: int) -> int:
    return (n + 31) // 32 * 32


def _shard(no: int, count: int, seed: int) -> bytes:
    kv = [
        (Keys.Split.NO, TypedValue(GGUFValueType.UINT16, no)),
        (Keys.Split.COUNT, TypedValue(GGUFValueType.UINT16, count)),
        (Keys.Split.TENSORS_COUNT, TypedValue(GGUFValueType.INT32, count)),
    ]
    data = struct.pack("<32f", *[(seed + i) / 7.0 for i in range(32)])
    name = f"t.{no}".encode()
    info = struct.pack("<Q", len(name)) + name
    info += struct.pack("<IQIQ", 1, 32, int(GGMLQuantizationType.F32), 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv)) + encode_metadata(kv) + info
    return head + bytes(_pad(len(head)) - len(head)) + data


def _write(directory: Path, count: int) -> list[Path]:
    paths = []
    for no in range(count):
        path = directory / f"m-{no + 1:05d}-of-{count:05d}.gguf"
        path.write_bytes(_shard(no, count, no))
        paths.append(path)
    return paths


def _best(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def run(quick: bool = False, *, shards: int = 1000) -> list[dict[str, Any]]:
    repeats = 2 if quick else 5
    with tempfile.TemporaryDirectory(prefix="ggufswap-scan-") as tmp:
        paths = _write(Path(tmp), shards)
        model = ModelConfig(name="m", runtime="ipc:///none", watch=(WatchConfig(path=Path(tmp)),))
        baseline = _best(lambda: open_shard_set(paths[0], cache=HeaderCache()), repeats)

        def cold() -> None:
            snap = ModelIndex(model, cache=HeaderCache()).scan()
            assert len(snap.desired) == shards, "every tensor is desired"

        ours = _best(cold, repeats)
        index = ModelIndex(model, cache=HeaderCache())
        index.scan()
        warm_times = []
        for i in range(repeats):
            tmp_file = paths[7].with_name(".x.tmp")
            tmp_file.write_bytes(_shard(7, shards, 1000 + i))
            os.replace(tmp_file, paths[7])
            started = time.perf_counter()
            index.scan()
            warm_times.append(time.perf_counter() - started)
        warm = min(warm_times)
    return [
        {
            "name": f"scan {shards} per-tensor shards, cold (vs open_shard_set)",
            "baseline_s": baseline,
            "ours_s": ours,
            "ratio": baseline / ours,
            "target": None,
        },
        {
            "name": f"scan {shards} per-tensor shards, cold (vs the {BUDGET_S:g} s budget)",
            "baseline_s": BUDGET_S,
            "ours_s": ours,
            "ratio": BUDGET_S / ours,
            "target": 1.0,
        },
        {
            "name": f"rescan {shards} shards, one changed (vs cold scan)",
            "baseline_s": ours,
            "ours_s": warm,
            "ratio": ours / warm,
            "target": None,
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shards", type=int, default=1000)
    args = parser.parse_args()
    for row in run(args.quick, shards=args.shards):
        target = "" if row["target"] is None else f" (target >= {row['target']:g}x)"
        print(
            f"{row['name']}: baseline {row['baseline_s'] * 1000:.1f} ms, "
            f"ours {row['ours_s'] * 1000:.1f} ms, ratio {row['ratio']:.2f}x{target}"
        )


if __name__ == "__main__":
    main()
