"""Coverage-guided fuzzing (atheris / libFuzzer) of the two parsers of untrusted bytes.

``read_header`` (a GGUF file) may only raise ``ShardError``; ``decode`` (a wire frame) may only
raise ``IpcError``. Each target runs in a subprocess (libFuzzer exits the process when done), seeded
with a valid input, for ``10 * GGUFSWAP_FUZZ_EXAMPLES`` executions (3000 by default; ``make fuzz``
runs 200,000). A crash leaves its input in the run's directory and the failure names it: add that
input to the regression cases of ``test_reader_hostile.py`` or ``test_ipc_messages.py``.

Skipped when atheris is not installed (``pip install atheris``; wheels exist for CPython 3.10 to
3.12 on Linux x86-64).
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import fuzz_budget
import pytest

pytestmark = pytest.mark.process

EXAMPLES = fuzz_budget.examples(300)
RUNS = 10 * EXAMPLES
TARGETS = ("read_header", "decode")


def _seed(target: str, corpus: Path) -> None:
    """One valid input to start from."""
    if target == "read_header":
        from ggufswap.shards import Layout, tiny_moe, write_model

        with tempfile.TemporaryDirectory() as tmp:
            (first,) = write_model(tiny_moe(n_layers=1), Path(tmp), layout=Layout.SINGLE)
            data = Path(first).read_bytes()
        (corpus / "tiny.gguf").write_bytes(data[:4096])  # the header and some data
        return
    from ggufswap.ipc import Job, MessageType, Plan, encode, make_message, plan_to_wire
    from ggufswap.shards import FileIdentity, TensorRecord
    from ggufswap.shards.ggml_types import GGMLType

    record = TensorRecord(
        "blk.0.ffn_down_exps.weight",
        GGMLType.Q8_0,
        (64, 64, 4),
        192,
        17408,
        "/srv/models/m-00001-of-00002.gguf",
        FileIdentity(1, 2, 3, 4, 5),
    )
    plan = Plan("p1", "m", (Job(record, "ab" * 16),))
    (corpus / "plan.msgpack").write_bytes(
        encode(make_message(MessageType.PLAN, **plan_to_wire(plan)))
    )


def _fuzz(target: str, runs: int, workdir: Path) -> None:  # pragma: no cover (runs in a child)
    """The child process: instrument the parser, then let libFuzzer drive it."""
    import atheris

    with atheris.instrument_imports(include=["ggufswap.shards", "ggufswap.ipc"]):
        from ggufswap.ipc import IpcError, decode
        from ggufswap.shards import ShardError, read_header

    scratch = workdir / "input.gguf"

    def read_header_once(data: bytes) -> None:
        scratch.write_bytes(data)
        try:
            read_header(scratch)
        except ShardError:
            pass

    def decode_once(data: bytes) -> None:
        try:
            decode(data, max_size=1 << 20)
        except IpcError:
            pass

    corpus = workdir / "corpus"
    one = read_header_once if target == "read_header" else decode_once
    # libFuzzer's RSS limit (2 GiB by default) is on the peak RSS, which Linux carries over from
    # the parent into a child: run from an xdist worker that had loaded the real Gemma model, the
    # child started above 2 GiB and reported an "oom" before any input. The limit is 2 GiB above
    # what the child starts with; a single allocation stays limited to 2 GiB.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    atheris.Setup(
        [
            sys.argv[0],
            f"-runs={runs}",
            f"-rss_limit_mb={inherited_mb + 2048}",
            "-malloc_limit_mb=2048",
            "-max_len=8192",
            "-max_total_time=120",
            f"-artifact_prefix={workdir}/",
            str(corpus),
        ],
        one,
    )
    atheris.Fuzz()


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_atheris(target: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """libFuzzer finds no input that makes the parser raise anything but its own error class."""
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris)")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _seed(target, corpus)
    done = subprocess.run(
        [sys.executable, __file__, target, str(RUNS), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "oom-")))
    assert done.returncode == 0, f"{target}: {crashes}\n{done.stderr[-4000:]}"
    assert crashes == []
    assert f"Done {RUNS} runs" in done.stderr, done.stderr[-2000:]
    import reliability

    parser = "GGUF reader (read_header)" if target == "read_header" else "frame decoder (decode)"
    reliability.record(
        "bad input",
        f"atheris coverage-guided inputs to the {parser}",
        tries=RUNS,
        outcome="only its own error class raised; no crash, no hang",
        test=request.node.nodeid,
    )


if __name__ == "__main__":  # the child of test_fuzz_atheris
    _fuzz(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
