"""The HTTP server under abuse: oversized prompt lists, non-finite numbers, deep JSON, idle and
stalled connections, more connections than it serves, and bursts past the listen backlog.

Each attack is answered with an HTTP status (never a dropped connection), and good requests are
still served afterwards. Every test records its row in the reliability matrix.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
import time
from typing import Any

import pytest
from processes import wait_for
from runtime_helpers import ModelDir, one_thread
from test_http import WAIT_S, start_server

from ggufswap.runtime.serving.http import MIN_BACKLOG, HttpOptions
from ggufswap.shards import tiny_dense

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    """A smaller model than test_http's: these tests never read what it generates."""
    return ModelDir.write(tmp_path_factory.mktemp("abuse") / "model", tiny_dense(n_vocab=512))


def call(port: int, method: str, path: str, *, raw: bytes | None = None) -> tuple[int, Any]:
    """One request on a fresh connection; the status and the decoded JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def post(port: int, body: object) -> tuple[int, Any]:
    return call(port, "POST", COMPLETIONS, raw=json.dumps(body).encode())


def served_ok(port: int) -> None:
    status, reply = post(port, {"prompt": "a b", "max_tokens": 1, "temperature": 0})
    assert status == 200, reply


@pytest.mark.reliability(
    "bad input",
    "HTTP prompt lists over max_batch, and prompts over the queue",
    tries=2,
    outcome="400 too_many_prompts; 503 queue_full counting prompts, not requests",
)
def test_every_prompt_counts_against_max_batch_and_the_queue(model_dir: ModelDir) -> None:
    """A request with more prompts than max_batch is a 400; prompts, not requests, fill the
    queue, so a second request whose prompts do not fit is a 503 queue_full at once."""
    for served in start_server(
        model_dir.first, run_loop=False, max_batch=2, max_queue=3, request_timeout_s=2.0
    ):
        status, reply = post(served.port, {"prompt": ["a", "b", "c"], "max_tokens": 1})
        assert (status, reply["error"]["code"]) == (400, "too_many_prompts"), reply
        waiting: list[tuple[int, Any]] = []
        first = threading.Thread(
            target=lambda: waiting.append(post(served.port, {"prompt": ["a", "b"]}))
        )
        first.start()
        wait_for(
            lambda: served.batcher.status()["queued_prompts"] == 2, timeout=WAIT_S, what="queued"
        )
        status, reply = post(served.port, {"prompt": ["c", "d"]})
        assert (status, reply["error"]["code"]) == (503, "queue_full"), reply
        # The queued request is served by rounds run here (not left to its 2 s timeout).
        deadline = time.monotonic() + WAIT_S
        while first.is_alive() and time.monotonic() < deadline:
            served.batcher.step()
            first.join(0.01)
        assert not first.is_alive()
        assert waiting[0][0] == 200, waiting


def test_a_prompt_list_of_max_batch_is_served(model_dir: ModelDir) -> None:
    """Paired: a list of exactly max_batch prompts is served, one choice per prompt."""
    for served in start_server(model_dir.first, max_batch=2, max_queue=2):
        status, reply = post(served.port, {"prompt": ["a", "b"], "max_tokens": 1})
        assert status == 200, reply
        assert len(reply["choices"]) == 2


BAD_BODIES = {
    "temperature NaN": b'{"prompt": "a", "temperature": NaN}',
    "temperature Infinity": b'{"prompt": "a", "temperature": Infinity}',
    "temperature -Infinity": b'{"prompt": "a", "temperature": -Infinity}',
    "temperature 1e999": b'{"prompt": "a", "temperature": 1e999}',
    "100,000-deep array": b"[" * 100_000 + b"]" * 100_000,
    "100,000-deep prompt": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.reliability(
    "bad input",
    "HTTP bodies with NaN, Infinity, 1e999 or 100,000-deep nesting",
    tries=len(BAD_BODIES),
    outcome="400 with an OpenAI-style error body; the server keeps serving",
)
def test_non_finite_numbers_and_deep_nesting_get_a_400(model_dir: ModelDir) -> None:
    """Non-finite numbers and deeply nested JSON are answered 400 with an error body, never a
    dropped connection; the server keeps serving."""
    for served in start_server(model_dir.first):
        for what, body in BAD_BODIES.items():
            status, reply = call(served.port, "POST", COMPLETIONS, raw=body)
            assert status == 400, (what, reply)
            assert reply["error"]["type"] == "invalid_request_error", (what, reply)
        served_ok(served.port)


@pytest.mark.reliability(
    "bad input",
    "HTTP connections idle, or stalled mid-body",
    tries=2,
    outcome="closed at the header deadline; a stalled body answered 408 at the body deadline",
)
def test_idle_and_stalled_connections_are_closed(model_dir: ModelDir) -> None:
    """A connection that sends nothing is closed at the header deadline; one whose body stalls
    gets a 408 at the body deadline and is closed."""
    options = HttpOptions(port=0, idle_timeout_s=0.5, header_timeout_s=0.5, body_timeout_s=0.5)
    for served in start_server(model_dir.first, http=options):
        with socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S) as idle:
            assert idle.recv(1) == b""  # closed by the server, not by this side's timeout
        with socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S) as stalled:
            stalled.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}"
            )
            answer = b""
            while chunk := stalled.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        served_ok(served.port)


@pytest.mark.reliability(
    "bad input",
    "HTTP connections past max_connections (held open with keep-alive)",
    tries=1,
    outcome="503 too_many_connections at once; served again once one closes",
)
def test_connections_past_the_limit_get_503(model_dir: ModelDir) -> None:
    """With max_connections connections held open, another one is answered 503 at once; once
    one closes, requests are served again."""
    limit = 3
    options = HttpOptions(port=0, max_connections=limit, max_connections_per_client=limit)
    for served in start_server(model_dir.first, http=options):
        held = [
            http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
            for _ in range(limit)
        ]
        try:
            for conn in held:  # each is accepted and served; keep-alive then holds its thread
                conn.request("GET", "/health")
                assert conn.getresponse().read()
            status, reply = call(served.port, "GET", "/health")
            assert (status, reply["error"]["code"]) == (503, "too_many_connections"), reply
        finally:
            held.pop().close()
        wait_for(lambda: call(served.port, "GET", "/health")[0] == 200, timeout=WAIT_S, what="200")
        for conn in held:
            conn.close()


def listen_backlog(port: int) -> int:
    """The backlog of the socket listening on ``port`` (``ss`` shows it as Send-Q)."""
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    return int(out[2])


@pytest.mark.process
@pytest.mark.reliability(
    "bad input",
    "HTTP burst of 200 connections at once",
    tries=200,
    outcome="listen backlog >= 128; every connection answered 200 or 503, none reset",
)
def test_a_burst_of_connections_is_answered_not_reset(model_dir: ModelDir) -> None:
    """The listen backlog is sized for the connection limit (at least MIN_BACKLOG), and each of
    200 connections opened at once gets an HTTP answer: 200, or 503 past the limit."""
    for served in start_server(model_dir.first, http=HttpOptions(port=0, max_connections=16)):
        assert listen_backlog(served.port) >= MIN_BACKLOG
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        socks = [
            socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S) for _ in range(200)
        ]
        statuses = []
        try:
            for sock in socks:
                sock.sendall(request)
            for sock in socks:
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
                statuses.append(answer.split(b" ", 2)[1])
        finally:
            for sock in socks:
                sock.close()
        assert set(statuses) <= {b"200", b"503"}, statuses
        assert len(statuses) == 200
        served_ok(served.port)
