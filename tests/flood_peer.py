"""A flooding client in a process of its own, for the fairness tests.

    python flood_peer.py ENDPOINT CONNECTIONS FRAMES

``FRAMES`` is a msgpack file: a list of ``[msg_id, frame]``. Frame ``i`` is sent on connection
``i % CONNECTIONS`` (plain DEALER sockets). The process then prints one JSON line mapping each
msg id to the type of its first reply (or nothing for an id not answered within 30 s) and keeps
its sockets open until its stdin closes, so its plans stay in flight meanwhile.

:class:`FloodPeer` runs it from a test. A process of its own, because the runtime tells clients
apart by process on ``ipc://`` (SO_PEERCRED): connections of the test process would all be the
test's own.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
from processes import close_piped

FIRST_REPLIES_S = 30.0


def main(argv: list[str]) -> int:
    endpoint, connections, frames_file = argv[0], int(argv[1]), Path(argv[2])
    frames: list[list[Any]] = msgpack.unpackb(frames_file.read_bytes())
    ctx = zmq.Context()
    socks = []
    for _ in range(connections):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    for i, (_msg_id, frame) in enumerate(frames):
        socks[i % connections].send(frame)
    first: dict[str, str] = {}
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + FIRST_REPLIES_S
    while len(first) < len(frames) and time.monotonic() < deadline:
        for sock, _event in poller.poll(100):
            reply = msgpack.unpackb(sock.recv())
            first.setdefault(str(reply.get("in_reply_to")), str(reply.get("type")))
    print(json.dumps(first), flush=True)
    sys.stdin.read()  # until the test closes it
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
    return 0


class FloodPeer:
    """Runs :func:`main` in a subprocess; ``first_replies()`` waits for its JSON line."""

    def __init__(
        self, endpoint: str, frames: list[tuple[str, bytes]], *, connections: int, tmp: Path
    ):
        self.frames_file = tmp / f"flood-{id(self)}.msgpack"
        self.frames_file.write_bytes(msgpack.packb([[i, f] for i, f in frames]))
        self.popen = subprocess.Popen(
            [sys.executable, __file__, endpoint, str(connections), str(self.frames_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def first_replies(self, timeout: float = FIRST_REPLIES_S + 30) -> dict[str, str]:
        assert self.popen.stdout is not None, "started with a stdout pipe"
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        assert ready, f"the flooder (pid {self.pid}) reported nothing within {timeout}s"
        line = self.popen.stdout.readline()
        assert line, f"the flooder (pid {self.pid}) exited: {self.popen.wait(5)}"
        return dict(json.loads(line))

    def close(self) -> None:
        close_piped(self.popen)

    def __enter__(self) -> FloodPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
