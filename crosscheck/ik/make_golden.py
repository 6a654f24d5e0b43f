"""Golden dequantization data for ik_llama.cpp's quant types, made with ik_llama.cpp's own ggml.

Writes ``tests/fixtures/ik_golden/<type>.bin`` (one per type) and ``manifest.json``, for writing
bit-exact torch decoders of ik_llama.cpp's types. Not part of the test suite and not imported by
it; run by hand (it needs cmake, a C/C++ compiler and about 15 minutes on 2 cores).

Where the source comes from: a snapshot of https://github.com/ikawrakow/ik_llama.cpp (a bare git
directory, ``--git-dir``). Only ``ggml/``, ``cmake/`` and ``CMakeLists.txt`` are needed::

    git --git-dir=GIT_DIR archive HEAD ggml cmake CMakeLists.txt | tar -x   # into WORK/src
    touch ggml/ggml.pc.in
    cmake -S ggml -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \\
        -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_OPENMP=OFF -DCMAKE_CXX_STANDARD=20
    cmake --build build -j2
    cc -O2 -I src/ggml/include crosscheck/ik/golden.c -L build/src -lggml -lm \\
        -Wl,-rpath,build/src -o golden
    ./golden OUTDIR

``golden.c`` quantizes deterministic data (3 rows x 512, see there) with ``ggml_quantize_chunk``
(no imatrix) in a forked child per type, decodes each row with the type's CPU ``to_float`` and
writes the quantized bytes and the float32 output; its header comment gives the file layout, and
``read_golden`` below reads it.

Caveat (documented per type in the manifest): ik's CPU ``to_float`` for ``iq1_bn``/``iq2_bn``
decodes the blocks only and ignores the per-row scale in the row header (its CUDA decoder applies
it), so their golden output is ``row_scale * to_float(row bytes after the header)``, the way the
CUDA decoder reads them.

Row-interleaved types (``_r4``/``_r8``/``_r16``): 16 rows (the first 3 are the other types' rows),
quantized the same way; ik stores each group of ``interleave`` rows together, so ``golden.c``
decodes a group with one ``to_float`` call on its start (``k = interleave * n_per_row``, as ik's
``dequantize_row_*_r4`` expect) and records the interleave in bits 8..15 of the header flags.
``bf16_r16`` has no ``to_float`` in ik's type traits, and ``mxfp4_r8``'s ``to_float`` overruns
its output at this commit (``dequantize_row_mxfp4_r8`` loops over ``k / 32`` blocks, eight
groups' worth); neither is produced (``not_produced`` in the manifest says why).

Usage::

    python crosscheck/ik/make_golden.py --git-dir /path/to/ik_llama.cpp.git --work /tmp/ik
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "ik_golden"
GOLDEN_C = HERE / "golden.c"

PATHS = ["ggml", "cmake", "CMakeLists.txt"]  # all of the repository that the build needs
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
    "-DGGML_OPENMP=OFF",
    "-DCMAKE_CXX_STANDARD=20",
]

MAGIC = b"IKGOLD1\0"
HEADER = struct.Struct("<8sIi16siiQIIII")  # 64 bytes, see golden.c
FLAG_BN_SCALED = 1
INTERLEAVE_SHIFT = 8  # flags bits 8..15: rows stored together (0 for non-interleaved types)

NOT_PRODUCED = {
    "bf16_r16": "ik's type traits give it no to_float (nor from_float) at this commit",
    "mxfp4_r8": (
        "ik's CPU to_float (dequantize_row_mxfp4_r8) loops over k/32 blocks with k = 8 rows, "
        "eight times the group's blocks, and overruns its output (glibc aborts) at this commit"
    ),
}

CAVEATS = {
    "iq1_bn": (
        "CPU to_float ignores the row scale; output = fp16 row header (2 bytes) * "
        "to_float(row bytes after the header), as ik's CUDA decoder reads it"
    ),
    "iq2_bn": (
        "CPU to_float ignores the row scale; output = f32 row header (4 bytes) * "
        "to_float(row bytes after the header), as ik's CUDA decoder reads it"
    ),
    "q1_0_g128": (
        "not an ik_llama.cpp original ('Bonsai 1-bit quants', code 41 in ik's ggml.h); "
        "included because it quantizes without an imatrix"
    ),
}

FORMAT = (
    "little-endian: magic 'IKGOLD1\\0' (8), u32 header size (64), i32 type code, char[16] name, "
    "i32 n_per_row, i32 nrows, u64 row_size, u32 flags (bit 0: output = row header scale x "
    "to_float after the header; bits 8..15: row interleave, 0 if none), u32 blck_size, "
    "u32 type_size, u32 row_meta_size; then nrows x row_size quantized bytes (row r at offset "
    "64 + r*row_size, its first row_meta_size bytes are the per-row header; an interleaved "
    "type's group of `interleave` rows is stored as a whole in those rows' bytes); then nrows x "
    "n_per_row float32 (ggml's CPU to_float output)"
)

DATA = (
    "3 rows x 512: Irwin-Hall(4) values from a 64-bit LCG (seed 0x1234abcd5678ef01), unit "
    "variance, rows scaled by 1, 1/32, 7.5; element 17 of row 0 times 6; row 2 elements "
    "288..319 zero; quantized with ggml_quantize_chunk without an imatrix. Row-interleaved "
    "types: 16 rows, the same 3 then rows scaled by 0.25, 2, 1/8, 3, 0.5, 1.5, 1/16, 4, 0.75, "
    "1.25, 6, 0.375, 2.5 (the LCG continues)"
)


def tool(name: str) -> str:
    """The full path of a command-line tool, or exit with a message."""
    path = shutil.which(name)
    if path is None:
        sys.exit(f"make_golden: {name} not found on PATH")
    return path


def run(cmd: list[str], cwd: Path | None = None) -> str:
    """Run ``cmd``, echoing it; returns its stdout, exits on failure."""
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        sys.exit(f"make_golden: {cmd[0]} failed with status {done.returncode}")
    return done.stdout


def extract(git_dir: Path, src: Path) -> str:
    """Extract ggml/, cmake/ and CMakeLists.txt of HEAD into ``src``; returns the commit."""
    git = tool("git")
    commit = run([git, f"--git-dir={git_dir}", "rev-parse", "HEAD"]).strip()
    if not (src / "ggml" / "CMakeLists.txt").exists():
        src.mkdir(parents=True, exist_ok=True)
        tar_path = src.parent / "ik_ggml.tar"
        run([git, f"--git-dir={git_dir}", "archive", "-o", str(tar_path), "HEAD", *PATHS])
        run([tool("tar"), "-xf", str(tar_path), "-C", str(src)])
        tar_path.unlink()
    (src / "ggml" / "ggml.pc.in").touch()
    return commit


def build(src: Path, build_dir: Path, jobs: int) -> Path:
    """Configure and build ik's standalone ggml; returns the folder holding libggml.so."""
    cmake = tool("cmake")
    run([cmake, "-S", str(src / "ggml"), "-B", str(build_dir), *CMAKE_FLAGS])
    run([cmake, "--build", str(build_dir), f"-j{jobs}"])
    libs = sorted(build_dir.rglob("libggml.so"))
    if not libs:
        sys.exit(f"make_golden: no libggml.so under {build_dir}")
    return libs[0].parent


def compile_golden(src: Path, lib_dir: Path, exe: Path) -> None:
    """Compile golden.c against the built library."""
    run(
        [
            *[tool("cc"), "-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-Wall"],
            *["-I", str(src / "ggml" / "include"), str(GOLDEN_C), "-o", str(exe)],
            *["-L", str(lib_dir), "-lggml", "-lm", f"-Wl,-rpath,{lib_dir}"],
        ]
    )


def read_golden(path: Path) -> dict[str, Any]:
    """One golden file: its header fields, the quantized bytes and the float32 output."""
    data = path.read_bytes()
    (magic, hsize, code, name, n_per_row, nrows, row_size, flags, blck, tsize, meta) = (
        HEADER.unpack_from(data)
    )
    if magic != MAGIC or hsize != HEADER.size:
        raise ValueError(f"{path}: not a golden file")
    qbytes = nrows * row_size
    out = array("f")
    out.frombytes(data[hsize + qbytes :])
    if sys.byteorder != "little":
        out.byteswap()
    if len(out) != nrows * n_per_row:
        raise ValueError(f"{path}: {len(out)} floats, expected {nrows * n_per_row}")
    return {
        "code": code,
        "name": name.rstrip(b"\0").decode(),
        "n_per_row": n_per_row,
        "rows": nrows,
        "row_size": row_size,
        "flags": flags,
        "blck_size": blck,
        "type_size": tsize,
        "row_meta_size": meta,
        "quant": data[hsize : hsize + qbytes],
        "dequant": out,
    }


def generate(exe: Path, out_dir: Path, commit: str) -> dict[str, Any]:
    """Run ``golden`` into a scratch folder, check its files, then replace ``out_dir``'s."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([str(exe), tmp], capture_output=True, text=True, check=False)
        sys.stderr.write(done.stderr)
        types: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for line in done.stdout.splitlines():
            print(line)
            fields = line.split()
            if not fields or fields[0] not in ("OK", "FAIL"):
                continue  # ggml's own chatter on stdout
            if fields[0] == "FAIL":
                why = NOT_PRODUCED.get(fields[1], "")
                failed[fields[1]] = f"code {fields[2]}: {fields[3]}" + (f"; {why}" if why else "")
                continue
            name = fields[1]
            golden = read_golden(Path(tmp) / f"{name}.bin")
            if golden["blck_size"] * golden["type_size"] == 0:
                raise ValueError(f"{name}: empty block")
            blocks = golden["n_per_row"] // golden["blck_size"]
            expected_row = golden["row_meta_size"] + blocks * golden["type_size"]
            if expected_row != golden["row_size"]:
                raise ValueError(f"{name}: row size {golden['row_size']} != {expected_row}")
            entry: dict[str, Any] = {
                "code": golden["code"],
                "name": name,
                "file": f"{name}.bin",
                "block_size": golden["blck_size"],
                "bytes_per_block": golden["type_size"],
                "row_meta_size": golden["row_meta_size"],
                "bytes_per_row": golden["row_size"],
                "n_per_row": golden["n_per_row"],
                "rows": golden["rows"],
                "flags": golden["flags"],
                "interleave": golden["flags"] >> INTERLEAVE_SHIFT & 0xFF,
                "rel_rmse_vs_source": float(fields[8]),
                "sha256": hashlib.sha256((Path(tmp) / f"{name}.bin").read_bytes()).hexdigest(),
            }
            if name in CAVEATS:
                entry["caveat"] = CAVEATS[name]
            is_bn = name in ("iq1_bn", "iq2_bn")
            assert bool(golden["flags"] & FLAG_BN_SCALED) == is_bn, f"{name}: flags"
            interleave = entry["interleave"]
            assert (interleave > 0) == ("_r" in name), f"{name}: interleave {interleave}"
            assert golden["rows"] % max(interleave, 1) == 0, f"{name}: rows"
            types[name] = entry
        if done.returncode not in (0, 2) or not types:
            sys.exit(f"make_golden: golden exited with status {done.returncode}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("*.bin"):
            old.unlink()
        for name in types:
            shutil.copyfile(Path(tmp) / f"{name}.bin", out_dir / f"{name}.bin")
    manifest = {
        "source": "https://github.com/ikawrakow/ik_llama.cpp",
        "commit": commit,
        "made_by": "crosscheck/ik/make_golden.py (crosscheck/ik/golden.c)",
        "build": ["touch ggml/ggml.pc.in", "cmake -S ggml -B build " + " ".join(CMAKE_FLAGS)],
        "data": DATA,
        "format": FORMAT,
        "reader": "read_golden() in crosscheck/ik/make_golden.py",
        "decoder": (
            "the CPU to_float of ggml's type traits, one call per row on the row's bytes "
            "(per-row header included), after ggml_init()"
        ),
        "not_produced": failed,
        "types": dict(sorted(types.items(), key=lambda item: item[1]["code"])),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git-dir", type=Path, required=True, help="ik_llama.cpp git directory")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder, not in the repo")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--skip-build", action="store_true", help="reuse WORK/build as it is")
    args = parser.parse_args()
    work: Path = args.work.resolve()
    src, build_dir = work / "src", work / "build"
    commit = extract(args.git_dir, src)
    if args.skip_build:
        libs = sorted(build_dir.rglob("libggml.so"))
        if not libs:
            sys.exit(f"make_golden: no libggml.so under {build_dir}")
        lib_dir = libs[0].parent
    else:
        lib_dir = build(src, build_dir, args.jobs)
    exe = work / "golden"
    compile_golden(src, lib_dir, exe)
    manifest = generate(exe, args.out, commit)
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"{len(manifest['types'])} types, {total} bytes in {args.out}, commit {commit}")


if __name__ == "__main__":
    main()
