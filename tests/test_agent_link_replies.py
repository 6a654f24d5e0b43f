"""The agent's link reads each runtime reply into its typed record (ipc/schema.py) before acting,
and drops a malformed one with its field named, as the runtime side does with requests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from processes import wait_for

from ggufswap.agent import LinkState, RuntimeLink
from ggufswap.config import ModelConfig, VerifyMode
from ggufswap.ipc import (
    MessageType,
    Request,
    RequestServer,
    RuntimeState,
    make_reply,
    state_to_wire,
)

MODEL = "m"


@contextmanager
def _link_to(sockdir: Path, state_reply: dict[str, Any]) -> Iterator[RuntimeLink]:
    """A link to a runtime that answers every ``state`` with ``state_reply``'s fields."""

    def handle(request: Request) -> dict[str, Any]:
        assert request.type is MessageType.STATE, request.type
        return make_reply(request.msg, MessageType.STATE_REPLY, **state_reply)

    endpoint = f"ipc://{sockdir}/rt.sock"
    config = ModelConfig(
        name=MODEL, runtime=endpoint, watch=(), verify=VerifyMode.STAT, request_timeout_s=5.0
    )
    with RequestServer(endpoint, handle, name="runtime"):
        link = RuntimeLink(config, heartbeat_interval_s=0.5).start()
        try:
            yield link
        finally:
            link.stop()


def test_a_state_reply_is_read_into_the_actual_state(sockdir: Path) -> None:
    """A well-formed ``state_reply`` becomes the link's actual state: the link goes idle."""
    with _link_to(sockdir, state_to_wire(RuntimeState(MODEL, 3, ()))) as link:
        wait_for(lambda: link.state is LinkState.IDLE, timeout=10, what="the link in sync")
        assert link.status()["weight_version"] == 3
        assert link.status()["last_error"] is None


def test_a_malformed_reply_is_dropped_with_its_field_named(sockdir: Path) -> None:
    """A ``state_reply`` whose weight version is not a count is refused: the link's last error
    names the reply and the field, and the link does not act on it (it is still syncing)."""
    bad = {**state_to_wire(RuntimeState(MODEL, 3, ())), "weight_version": "soon"}
    with _link_to(sockdir, bad) as link:
        error = wait_for(
            lambda: link.status()["last_error"], timeout=10, what="the bad reply refused"
        )
        assert error.startswith("bad state_reply from ipc://"), error
        assert "field 'weight_version'" in error, error
        assert link.state is LinkState.SYNCING
        assert link.status()["weight_version"] is None
