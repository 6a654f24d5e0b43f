"""Plans from other clients: the agent follows the runtime's events and restores the files' content.

A client other than the agent (a script, a second agent) commits a plan that loads other bytes.
The agent sees the runtime's ``plan.committed`` event for a plan it did not send, re-reads the
runtime's state and plans the files' content back, at once rather than at its periodic refresh
(``rescan_interval_s``, 300 s in these processes' config).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile import MODEL, TENSOR, Live, live_processes
from processes import wait_for
from runtime_helpers import Q, fresh_digest

from ggufswap.ipc import (
    DealerClient,
    Fields,
    Job,
    MessageType,
    Plan,
    make_message,
    message_from,
    plan_to_wire,
)
from ggufswap.shards import fingerprint, open_shard_set, read_header, requantize

pytestmark = pytest.mark.process

REPLY_S = 60.0
# Well below the agent's periodic refresh (300 s): only the event can explain a restore in time.
RESTORE_S = 30.0


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    with live_processes(tmp_path) as processes:
        yield processes


def runtime_fingerprint(live: Live) -> str:
    with DealerClient(live.control) as client:
        client.send(make_message(MessageType.STATE))
        state = wait_for(lambda: client.poll(0.2), timeout=REPLY_S, what="the runtime's state")
    return str(state[Fields.TENSORS][TENSOR][Fields.Tensor.FINGERPRINT])


def link_state(live: Live) -> str | None:
    link = live.status(live.agent_status).get("models", {}).get(MODEL, {}).get("link")
    return str(link["state"]) if link else None


def send_plan(live: Live, plan: Plan) -> dict[str, Any]:
    """Send ``plan`` as a client of its own; its final reply."""
    with DealerClient(live.control) as client:
        msg = message_from(MessageType.PLAN, plan_to_wire(plan))
        client.send(msg)

        def final() -> dict[str, Any] | None:
            reply = client.poll(0.2)
            if reply is not None and reply.get(Fields.TYPE) in ("committed", "rejected", "error"):
                return reply
            return None

        return dict(wait_for(final, timeout=REPLY_S, what=f"the outcome of {plan.plan_id}"))


@pytest.mark.reliability(
    "faults",
    "another client commits a plan loading other bytes than the watched files",
    tries=1,
    outcome="the agent follows plan.committed and restores the files' content within one "
    "settle window of the event, not at its 300 s refresh; served digest = a fresh load",
)
def test_a_foreign_plan_is_reverted_at_once(live: Live) -> None:
    """A plan from another client that loads a tensor from a file the agent does not watch is
    committed; the agent, told by the runtime's event, plans the watched file's content back
    within seconds, and the runtime then serves what a fresh load of the files serves."""
    watched = open_shard_set(live.first).tensors[TENSOR]
    alt_dir = live.first.parent / "alt"  # inside the runtime's allowed root, not watched
    alt_dir.mkdir()
    alt = alt_dir / "alt.gguf"
    requantize(watched.path, TENSOR, Q.Q4_0, out=alt)
    foreign = next(t for t in read_header(alt).tensors if t.name == TENSOR)
    wait_for(lambda: link_state(live) == "idle", timeout=REPLY_S, what="the agent in sync")
    assert live.weight_version() == 0
    reply = send_plan(live, Plan("foreign-1", MODEL, (Job(foreign, fingerprint(foreign)),)))
    assert reply[Fields.TYPE] == "committed", reply
    committed_at = time.monotonic()
    wait_for(
        lambda: runtime_fingerprint(live) == fingerprint(watched),
        timeout=RESTORE_S,
        what="the agent to restore the watched file's content",
    )
    restored_s = time.monotonic() - committed_at
    assert live.weight_version() == 2, "the foreign commit, then the agent's restore"
    link = live.status(live.agent_status)["models"][MODEL]["link"]
    assert link["events"]["foreign_commits"] >= 1, link["events"]
    assert link["last_plans"][-1]["outcome"] == "committed", link["last_plans"]
    assert live.digest() == fresh_digest(live.first), "served = a fresh load of the files"
    assert restored_s < RESTORE_S
    live.alive()
