"""Coordinated commit across torch.distributed ranks: real gloo ranks under torchrun, each a
runtime over the same tiny model, commit every plan at the same step or reject it on all; a rank
that never stages is rejected by the vote's deadline, a killed rank is named by the others."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from runtime_helpers import ModelDir, fresh_digest

from ggufswap.ipc import Reason
from ggufswap.runtime import Storage
from ggufswap.runtime.coordinated import Ballot, Decision, RankView, Vote, decide
from ggufswap.shards import ModelSpec, tiny_dense

Q = GGMLQuantizationType
RANK_SCRIPT = Path(__file__).with_name("coordinated_rank.py")
RUN_TIMEOUT_S = 300  # the whole torchrun; each collective also times out after 60 s
VOTE_TIMEOUT_S = 5.0  # the deadline tests' vote deadline
# torchrun's agent sleeps this long between checks of its ranks: where every rank finishes, it
# exits at its next check (30 s kept a finished group waiting ~20 s); where a rank is killed,
# 30 s lets the others see the death themselves before the agent stops them.
FINISH_MONITOR_S = 0.5
KILL_MONITOR_S = 30.0
SWAPS = {  # tensors swapped back and forth between two encodings of the same byte size
    "blk.0.attn_q.weight": Q.BF16,
    "blk.1.attn_q.weight": Q.BF16,
    "blk.0.attn_k.weight": Q.IQ4_NL,
    "blk.1.attn_k.weight": Q.IQ4_NL,
}
GROWING = ("token_embd.weight", Q.F32)  # Q8_0 -> F32: 3.8x the bytes
HEADROOM = 16384  # the tight rank's room: any one swap above, not the growing plan


def spec() -> ModelSpec:
    return tiny_dense().with_types(attn_q="f16", attn_k="q4_0", token_embd="q8_0")


def test_decide_commits_only_what_every_rank_staged() -> None:
    """A plan commits when every rank has staged it, waits while one has not, and is rejected
    with the failing rank's reasons when any rank failed it."""
    stale = Reason("blk.0.attn_q.weight", "file changed", stale=True)
    views = [
        RankView(0, (Ballot("a", Vote.STAGED), Ballot("b", Vote.STAGED), Ballot("c", Vote.STAGED))),
        RankView(
            1,
            (
                Ballot("a", Vote.STAGED),
                Ballot("b", Vote.PENDING),
                Ballot("c", Vote.FAILED, (stale,)),
            ),
        ),
    ]
    verdicts = decide(views)
    assert verdicts["a"].decision is Decision.COMMIT
    assert "b" not in verdicts
    assert verdicts["c"].decision is Decision.REJECT
    assert verdicts["c"].reasons == (Reason(stale.tensor, "rank 1: file changed", stale=True),)
    assert decide([RankView(0, (Ballot("d", Vote.STAGED),)), RankView(1, ())]) == {}


def rank_logs(logs: Path) -> str:
    """The end of each rank's stderr (torchrun's ``--log-dir``), for a failure message."""
    return "".join(
        f"\n== {path.relative_to(logs)}\n" + path.read_text()[-3000:]
        for path in sorted(logs.rglob("stderr.log"))
    )


def torchrun(
    tmp_path: Path,
    ranks: int,
    model: Path,
    manifest: Path,
    *args: str,
    monitor_s: float = FINISH_MONITOR_S,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run ``ranks`` ranks of coordinated_rank.py under torchrun, whose agent checks on them
    every ``monitor_s`` (it notices the ranks have finished only then); the finished run and the
    directory of the ranks' ``rank-N.json``."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", "--redirects=3", f"--log-dir={tmp_path / 'logs'}",
        f"--monitor-interval={monitor_s}", str(RANK_SCRIPT),
        "--model", str(model), "--plans", str(manifest), "--out", str(out), *args,
    ]  # fmt: skip
    done = subprocess.run(
        command, check=False, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    return done, out


def write_manifest(
    tmp_path: Path, n_plans: int, failing_at: int
) -> tuple[ModelDir, Path, dict[str, Path]]:
    """The model, its variants, and ``n_plans`` plans: each swaps one tensor to its other
    encoding, except plan ``failing_at``, which grows a tensor; returns the model, the manifest,
    and the file each tensor is read from once every plan that commits has."""
    model_dir = ModelDir.write(tmp_path / "model", spec())
    store = tmp_path / "store"
    variants = {name: model_dir.variant(name, qtype, store) for name, qtype in SWAPS.items()}
    originals = {name: model_dir.shard_of(name) for name in SWAPS}
    growing = model_dir.variant(GROWING[0], GROWING[1], store)
    current = dict(originals)
    plans = []
    names = list(SWAPS)
    for i in range(n_plans):
        if i == failing_at:
            files = {GROWING[0]: growing}
        else:
            name = names[i % len(names)]
            current[name] = variants[name] if current[name] == originals[name] else originals[name]
            files = {name: current[name]}
        plans.append({"plan_id": f"plan-{i:02d}", "files": {n: str(p) for n, p in files.items()}})
    manifest = tmp_path / "plans.json"
    manifest.write_text(json.dumps({"store": str(store / "x"), "plans": plans}))
    return model_dir, manifest, current


@pytest.mark.process
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    ("ranks", "tight_rank"),
    [
        pytest.param(4, 2, id="4-ranks-follower-fails", marks=pytest.mark.slow),
        pytest.param(2, 0, id="2-ranks-leader-fails"),  # make test keeps one torchrun group
    ],
)
def test_every_rank_commits_each_plan_at_the_same_step(
    tmp_path: Path, ranks: int, tight_rank: int
) -> None:
    """Under torchrun, 50 plans commit at the same step on every rank (same weight_version and
    the same logits at every step), and a plan one rank cannot stage is rejected on all with that
    rank's reason, every rank's outputs unchanged."""
    n_plans, failing_at = 50, 25
    model_dir, manifest, final = write_manifest(tmp_path, n_plans, failing_at)
    done, out = torchrun(
        tmp_path, ranks, model_dir.first, manifest,
        "--tight-rank", str(tight_rank), "--headroom", str(HEADROOM),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:] + rank_logs(tmp_path / "logs")
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]

    # Every rank ran the same steps on the same weight version with the same outputs.
    records = [r["records"] for r in results]
    assert all(rec == records[0] for rec in records), "ranks disagree on a step"
    versions = [version for _, version, _ in records[0]]
    assert versions[-1] == n_plans - 1, "every plan but the failing one committed"
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(versions))
    digest_of: dict[int, str] = {}
    for _, version, digest in records[0]:
        assert digest_of.setdefault(version, digest) == digest, f"outputs moved at v{version}"
    assert all(digest_of[v] != digest_of[v + 1] for v in range(n_plans - 1)), (
        "a swap changed nothing"
    )

    # The one-rank failure: rejected on every rank, with the failing rank's reason.
    failing = f"plan-{failing_at:02d}"
    for rank, result in enumerate(results):
        outcomes = result["outcomes"]
        assert outcomes[failing]["state"] == "REJECTED", (rank, outcomes[failing])
        others = {p: o["state"] for p, o in outcomes.items() if p != failing}
        assert set(others.values()) == {"COMMITTED"}, (rank, others)
        assert result["group"]["undecided"] == []
    other = 1 if tight_rank == 0 else 0  # a rank that staged it and was told why it failed
    reasons = " ".join(results[other]["outcomes"][failing]["reasons"])
    assert f"rank {tight_rank}:" in reasons, reasons

    # And what every rank serves is what a fresh load of the final files computes.
    reference = model_dir.clone(tmp_path / "final", dict(final))
    assert digest_of[n_plans - 1] == fresh_digest(reference.first, storage=Storage.NATIVE)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_rank_that_never_stages_is_rejected_on_every_rank_by_the_deadline(
    tmp_path: Path,
) -> None:
    """Of 3 ranks, rank 2's stager never finishes the first plan: the vote's deadline (5 s here)
    rejects it on every rank at the same step, naming the rank it waited on; the group then
    commits the next plans; submit() on a follower is refused."""
    model_dir, manifest, _ = write_manifest(tmp_path, n_plans=3, failing_at=-1)
    done, out = torchrun(
        tmp_path, 3, model_dir.first, manifest,
        "--stall-rank", "2", "--vote-timeout", str(VOTE_TIMEOUT_S),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:] + rank_logs(tmp_path / "logs")
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(3)]
    records = [r["records"] for r in results]
    assert all(rec == records[0] for rec in records), "ranks disagree on a step"
    for rank, result in enumerate(results):
        states = {p: o["state"] for p, o in result["outcomes"].items()}
        assert states == {"plan-00": "REJECTED", "plan-01": "COMMITTED", "plan-02": "COMMITTED"}
        reasons = " ".join(result["outcomes"]["plan-00"]["reasons"])
        assert f"rank 0: not staged on every rank within {VOTE_TIMEOUT_S:g} s" in reasons, rank
        assert "waiting on rank 2" in reasons, reasons
    # decided by the deadline: not before it, and long before the stalled stager's watchdog
    assert VOTE_TIMEOUT_S <= results[0]["first_plan_s"] < VOTE_TIMEOUT_S + 30
    assert results[0]["follower_submit"] is None, "the leader takes plans"
    for rank in (1, 2):
        assert f"submit() on rank {rank} of a coordinated group" in results[rank]["follower_submit"]
    assert [v for _, v, _ in records[0]][-1] == 2, "the two plans after it committed"


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_killed_rank_ends_the_others_naming_it(tmp_path: Path) -> None:
    """Of 4 idle ranks, rank 2 is killed (SIGKILL): every other rank's at_batch_boundary raises
    RankLost naming rank 2 as dead, within the vote's deadline of its death."""
    model_dir, manifest, _ = write_manifest(tmp_path, n_plans=0, failing_at=-1)
    done, out = torchrun(
        tmp_path, 4, model_dir.first, manifest,
        "--kill-rank", "2", "--kill-step", "20", "--vote-timeout", str(VOTE_TIMEOUT_S),
        monitor_s=KILL_MONITOR_S,
    )  # fmt: skip
    assert done.returncode != 0, "a rank died"
    logs = done.stderr[-2000:] + rank_logs(tmp_path / "logs")
    killed_at = float((out / "killed-at").read_text())
    for rank in (0, 1, 3):
        path = out / f"rank-{rank}.json"
        assert path.exists(), f"rank {rank} did not end with an error\n{logs}"
        error = json.loads(path.read_text())["error"]
        assert error is not None, rank
        assert len(error["lost"]) == 1, error
        assert error["lost"][0].startswith("rank 2 (pid "), error
        assert error["lost"][0].endswith(" is dead"), error
        assert f"rank {rank} of a coordinated group of 4" in error["message"]
        assert error["at"] - killed_at < VOTE_TIMEOUT_S, (rank, error["at"] - killed_at)
