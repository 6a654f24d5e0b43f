"""The HTTP server against slow clients, greedy clients, hostile chat templates and oversized
prompts (issue 28, breaks 5 and 6 and the HTTP items of "also degraded").

Each attack is one test that records its row in the reliability matrix; the attacker connects
from 127.0.0.2 and the real client from 127.0.0.1 (both loopback), so the per-client limit tells
them apart as it would two hosts.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from processes import wait_for
from runtime_helpers import ModelDir, one_thread
from test_http import WAIT_S, Served, start_server

from ggufswap.runtime.serving.chat import ChatTemplate
from ggufswap.runtime.serving.http import HttpOptions
from ggufswap.shards import tiny_dense

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

ATTACKER = "127.0.0.2"
SIMPLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "assistant:"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    return ModelDir.write(tmp_path_factory.mktemp("limits") / "model", tiny_dense(n_vocab=512))


def call(port: int, method: str, path: str, body: object = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def read_all(sock: socket.socket) -> bytes:
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer


class Trickler(threading.Thread):
    """A slowloris connection: ``head`` and then one byte of ``tail`` every ``interval_s`` until
    the server closes it; what the server answered, and how many bytes it took."""

    def __init__(self, port: int, head: bytes, tail: bytes, interval_s: float) -> None:
        super().__init__(name="slowloris", daemon=True)
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=WAIT_S, source_address=(ATTACKER, 0)
        )
        self.head, self.tail, self.interval_s = head, tail, interval_s
        self.sent = 0
        self.answer = b""
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            self.sock.sendall(self.head)
            self.sock.settimeout(self.interval_s)
            for byte in self.tail:
                if self.stop.is_set():
                    return
                try:
                    chunk = self.sock.recv(65536)
                except TimeoutError:
                    self.sock.sendall(bytes([byte]))
                    self.sent += 1
                    continue
                self.answer = chunk + read_all(self.sock)
                return
        except OSError:
            return
        finally:
            self.sock.close()


@pytest.fixture
def guarded(model_dir: ModelDir) -> Iterator[Served]:
    options = HttpOptions(
        port=0,
        header_timeout_s=1.0,
        body_timeout_s=1.0,
        max_connections=12,
        max_connections_per_client=4,
    )
    yield from start_server(model_dir.first, http=options, max_batch=2, max_queue=4)


HEADER_TRICKLE = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000
BODY_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{"


@pytest.mark.reliability(
    "bad input",
    "slowloris: 16 connections from one client sending one header or body byte every 0.2 s",
    tries=16,
    outcome="past 4 per client: 503 at once; each held one cut by its whole-request deadline "
    "(408) while still trickling; a real client served 200 throughout",
)
def test_slowloris_is_cut_by_whole_request_deadlines_and_the_per_client_limit(
    guarded: Served,
) -> None:
    """Connections trickling one byte at a time are closed (408) by the header or body deadline
    however steadily they send, connections past the per-client limit get 503 at once, and a real
    client is served throughout."""
    attackers = [
        Trickler(guarded.port, *((b"", HEADER_TRICKLE) if i % 2 else (BODY_HEAD, b"a" * 5000)), 0.2)
        for i in range(16)
    ]
    started = time.monotonic()
    for attacker in attackers:
        attacker.start()
    served: list[float] = []
    try:
        while any(a.is_alive() for a in attackers) and time.monotonic() - started < WAIT_S:
            asked = time.monotonic()
            status, body = call(
                guarded.port,
                "POST",
                "/v1/completions",
                {"prompt": "a b", "max_tokens": 1, "temperature": 0},
            )
            assert status == 200, body
            served.append(time.monotonic() - asked)
    finally:
        for attacker in attackers:
            attacker.stop.set()
            attacker.join(WAIT_S)
    statuses = sorted(a.answer.split(b" ", 2)[1].decode() for a in attackers if a.answer)
    assert len(statuses) == 16, statuses
    assert statuses.count("503") >= 12, statuses  # 4 per client at most, whatever the timing
    cut = [a for a in attackers if a.answer.startswith(b"HTTP/1.1 408")]
    assert cut, statuses
    assert all(a.sent < len(a.tail) for a in cut), "cut while still sending, not at the end"
    assert served, "the real client was served during the attack"
    print(
        f"\nslowloris: {statuses.count('503')} refused at once, {len(cut)} cut by deadlines "
        f"after {max(a.sent for a in cut)} trickled bytes at most; the real client got "
        f"{len(served)} answers, slowest {max(served) * 1e3:.0f} ms"
    )


def test_a_slow_but_steady_client_within_the_deadline_is_served(guarded: Served) -> None:
    """Paired: a request whose bytes arrive over a few pauses, within the deadlines, is served."""
    body = json.dumps({"prompt": "a b", "max_tokens": 1, "temperature": 0}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=WAIT_S) as sock:
        for piece in (head[:10].encode(), head[10:].encode(), body[:5], body[5:]):
            sock.sendall(piece)
            time.sleep(0.1)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


@pytest.mark.reliability(
    "bad input",
    "Content-Length: ² (a Unicode digit) and a 1 MiB prompt",
    tries=2,
    outcome="400 each, never 500; the 1 MiB prompt refused by its length before tokenizing",
)
def test_a_unicode_content_length_and_a_megabyte_prompt_get_400(guarded: Served) -> None:
    """A Content-Length of '²' is a 400 (not a 500), and a 1 MiB prompt is a 400
    prompt_too_long before any tokenizing; the server keeps serving."""
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=WAIT_S) as sock:
        sock.sendall(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ²\r\n\r\n".encode()
        )
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    before = guarded.batcher.status()
    status, reply = call(
        guarded.port,
        "POST",
        "/v1/completions",
        {"prompt": "a " * ((1 << 20) // 2 - 64), "max_tokens": 1},
    )
    assert (status, reply["error"]["code"]) == (400, "prompt_too_long"), reply
    assert guarded.batcher.status()["queued_prompts"] == before["queued_prompts"]
    status, _ = call(guarded.port, "GET", "/health")
    assert status == 200


BOMBS = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}",
    "nested loops under the size cap": "{% for i in range(1000) %}{% for j in range(1000) %}"
    "{% for k in range(1000) %}{% endfor %}{% endfor %}{% endfor %}",
    "a 10 MB string": "{{ 'a ' * 5000000 }}",
    "a doubling namespace": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "a padded string": "{{ 'a'.ljust(1000000000) }}",
    "a recursive macro": "{% macro m(s) %}{{ m(s ~ s) }}{% endmacro %}{{ m('a') }}",
    "a runtime error": "{{ messages[0]['content'] / 0 }}",
    "an undefined method": "{{ messages.nothing() }}",
}


@pytest.mark.reliability(
    "bad input",
    "hostile chat templates per request: nested loops, 10 MB strings, doubling, padding, "
    "recursion, runtime errors",
    tries=len(BOMBS),
    outcome="400 within the render budget (1 s, the prompt's character cap); other clients "
    "served; the server keeps serving",
)
def test_hostile_chat_templates_get_a_400_within_the_budget(model_dir: ModelDir) -> None:
    """Each hostile template sent as a request's chat_template is a 400 naming the budget or
    the failure, within the render budget, while another client keeps being served."""
    options = HttpOptions(port=0, render_timeout_s=1.0)
    messages = [{"role": "user", "content": "hi"}]
    for served in start_server(model_dir.first, http=options):
        for what, source in BOMBS.items():
            asked = time.monotonic()
            status, reply = call(
                served.port,
                "POST",
                "/v1/chat/completions",
                {"messages": messages, "chat_template": source, "max_tokens": 1},
            )
            took = time.monotonic() - asked
            assert status == 400, (what, reply)
            assert reply["error"]["code"] in ("template_budget_exceeded", "chat_template_failed"), (
                what,
                reply,
            )
            print(f"\n{what}: 400 {reply['error']['code']} in {took * 1e3:.0f} ms")
        status, reply = call(
            served.port,
            "POST",
            "/v1/chat/completions",
            {
                "messages": messages,
                "chat_template": SIMPLE_TEMPLATE,
                "max_tokens": 1,
                "temperature": 0,
            },
        )
        assert status == 200, reply


@pytest.mark.reliability(
    "bad input",
    "a model whose chat template nests 5,000 {% if %} (RecursionError when compiled)",
    tries=1,
    outcome="the server starts and serves completions; chat answers 400 no_chat_template "
    "naming the compile error",
)
def test_a_template_that_does_not_compile_leaves_the_server_serving_without_chat(
    model_dir: ModelDir,
) -> None:
    """A template whose compile raises RecursionError (not a TemplateError) is reported as a
    ChatTemplateError, and the server serves without chat."""
    source = "{% if true %}" * 5000 + "x" + "{% endif %}" * 5000
    with pytest.raises(Exception) as raised:
        ChatTemplate(source, bos_token="", eos_token="")
    assert type(raised.value).__name__ == "ChatTemplateError", raised.value
    assert "RecursionError" in str(raised.value)
    for served in start_server(model_dir.first, chat_error=str(raised.value)):
        status, reply = call(
            served.port,
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}]},
        )
        assert (status, reply["error"]["code"]) == (400, "no_chat_template"), reply
        assert "RecursionError" in reply["error"]["message"]
        status, _ = call(served.port, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 1})
        assert status == 200


def test_the_render_budget_stops_a_loop_at_its_deadline_and_passes_real_templates() -> None:
    """A template looping for ever stops at the render budget's deadline with
    TemplateBudgetExceeded; an ordinary template renders the same text under the budget."""
    from ggufswap.runtime.serving.chat import RenderBudget
    from ggufswap.runtime.serving.errors import TemplateBudgetExceeded

    budget = RenderBudget(seconds=0.2, chars=1 << 16)
    loops = ChatTemplate(
        BOMBS["nested loops under the size cap"], bos_token="", eos_token="", budget=budget
    )
    started = time.monotonic()
    with pytest.raises(TemplateBudgetExceeded, match=r"0\.2 s"):
        loops.render([{"role": "user", "content": "hi"}])
    print(f"\nstopped after {time.monotonic() - started:.2f} s (budget 0.2 s)")
    plain = ChatTemplate(SIMPLE_TEMPLATE, bos_token="<s>", eos_token="", budget=budget)
    assert plain.render([{"role": "user", "content": "hi"}]) == "<s>user: hi\nassistant:"


def test_connections_past_the_per_client_limit_get_503_while_others_are_served(
    guarded: Served,
) -> None:
    """With one client holding its 4 connections open, its fifth gets 503
    too_many_connections_from_client, and another client is still served."""
    held = [
        socket.create_connection(
            ("127.0.0.1", guarded.port), timeout=WAIT_S, source_address=(ATTACKER, 0)
        )
        for _ in range(4)
    ]
    try:
        wait_for(
            lambda: guarded.server.limits.snapshot()["open"] >= 4,
            timeout=WAIT_S,
            what="4 connections open",
        )
        with socket.create_connection(
            ("127.0.0.1", guarded.port), timeout=WAIT_S, source_address=(ATTACKER, 0)
        ) as fifth:
            fifth.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = read_all(fifth)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"too_many_connections_from_client" in answer
        assert call(guarded.port, "GET", "/health")[0] == 200
    finally:
        for sock in held:
            sock.close()
