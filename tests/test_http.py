"""The OpenAI-style HTTP server on the reference runtime: completions (plain and streamed),
determinism, errors, back-pressure, and a 20-swap sweep under concurrent clients."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import Proc, status_of, wait_for
from runtime_helpers import ModelDir, Q, one_thread

from ggufswap.ipc import DealerClient, Fields, MessageType, make_message, plan_to_wire
from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import HotSwapRuntime, PlanState, Storage
from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.chat import ChatTemplate
from ggufswap.runtime.serving.daemon import served_model
from ggufswap.runtime.serving.generate import Batcher, BatcherOptions
from ggufswap.runtime.serving.http import CompletionServer, HttpOptions
from ggufswap.shards import ModelSpec, read_header, requantize, tiny_dense

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

WAIT_S = 30.0
PROMPT = "The cat sat on the mat."
SWAPPED = ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight")


def spec() -> ModelSpec:
    """A tiny dense model whose vocabulary is mostly plain pieces (" t17"), so generated text
    tells tokens apart (the default 256-entry vocabulary is nearly all byte tokens)."""
    return tiny_dense(n_vocab=2048, context_length=512)


# -- HTTP client helpers -----------------------------------------------------------------------


def call(
    port: int, method: str, path: str, body: object = None, *, raw: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    """One request on a fresh connection; the decoded JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def complete(port: int, **body: Any) -> dict[str, Any]:
    status, reply = call(port, "POST", "/v1/completions", {"prompt": PROMPT, **body})
    assert status == 200, reply
    return reply


def stream(port: int, **body: Any) -> list[dict[str, Any] | str]:
    """The server-sent events of a streamed completion: decoded chunks, then "[DONE]"."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        payload = json.dumps({"prompt": PROMPT, "stream": True, **body})
        conn.request("POST", "/v1/completions", body=payload)
        response = conn.getresponse()
        assert response.status == 200, response.read()
        assert response.getheader("Content-Type", "").startswith("text/event-stream")
        events: list[dict[str, Any] | str] = []
        for block in response.read().decode().split("\n\n"):
            if not block:
                continue
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
        return events
    finally:
        conn.close()


def streamed_texts(events: list[dict[str, Any] | str]) -> tuple[dict[int, str], dict[int, str]]:
    """Concatenated text and finish reason per choice index of a stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for event in events[:-1]:
        assert isinstance(event, dict), event
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"] is not None:
                reasons[choice["index"]] = choice["finish_reason"]
    return texts, reasons


# -- an in-process server ----------------------------------------------------------------------


@dataclass
class Served:
    runtime: HotSwapRuntime
    batcher: Batcher
    server: CompletionServer

    @property
    def port(self) -> int:
        return self.server.port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    return ModelDir.write(tmp_path_factory.mktemp("http") / "model", spec())


def start_server(
    first: Path,
    *,
    run_loop: bool = True,
    chat_template: ChatTemplate | None = None,
    chat_error: str | None = None,
    http: HttpOptions | None = None,
    **options: Any,
) -> Iterator[Served]:
    runtime = HotSwapRuntime.open(first, storage=Storage.AUTO)  # as a default config loads
    model = served_model(runtime)  # and serves (numerics: auto)
    batcher = Batcher(
        runtime, model, GgufTokenizer.from_file(first), options=BatcherOptions(**options)
    )
    server = CompletionServer.serving(
        batcher,
        runtime,
        options=http or HttpOptions(port=0),
        chat_template=chat_template,
        chat_error=chat_error,
    ).start()
    stop = threading.Event()
    loop = threading.Thread(target=batcher.run, args=(stop,), name="test-inference")
    if run_loop:
        loop.start()
    try:
        yield Served(runtime, batcher, server)
    finally:
        stop.set()
        if run_loop:
            loop.join(WAIT_S)
        server.close()
        runtime.close()


def assert_swap_round_trip_while_serving(
    models: ModelDir, name: str, variant: Path, saved: Path
) -> None:
    """Serve ``models``; commit ``variant`` as the shard of ``name``: the next response names
    weight version 1; ``saved`` (the original shard) back, version 2 completes as the first."""
    for served in start_server(models.first):
        before = complete(served.port, max_tokens=8, temperature=0)
        assert before["weight_version"] == 0
        for version, source in ((1, variant), (2, saved)):
            models.put(name, source)
            ticket = served.runtime.submit(models.plan(uuid.uuid4().hex, [name]))
            assert ticket.wait(WAIT_S) is PlanState.COMMITTED, ticket.reasons
            reply = complete(served.port, max_tokens=8, temperature=0)
            assert reply["weight_version"] == version, reply
        assert reply["choices"] == before["choices"]


@pytest.fixture(scope="module")
def served(model_dir: ModelDir) -> Iterator[Served]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the module's server runs tiny models: one thread (see one_thread)
    try:
        yield from start_server(model_dir.first)
    finally:
        torch.set_num_threads(before)


# -- completions -------------------------------------------------------------------------------


def test_greedy_completion_is_deterministic_and_openai_shaped(served: Served) -> None:
    """The same greedy request twice gives the same text, in an OpenAI-shaped response that
    names the weight version, with token usage."""
    first = complete(served.port, max_tokens=12, temperature=0)
    second = complete(served.port, max_tokens=12, temperature=0)
    assert first["choices"] == second["choices"]
    assert first["id"] != second["id"]
    assert first["id"].startswith("cmpl-")
    assert first["object"] == "text_completion"
    assert first["model"] == served.runtime.model_name
    assert first["weight_version"] == 0
    (choice,) = first["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert choice["text"].strip(), "a greedy completion of 12 plain tokens is not empty"
    usage = first["usage"]
    n_prompt = len(served.batcher.tokenizer.encode(PROMPT))
    assert usage == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 12,
        "total_tokens": n_prompt + 12,
    }


def test_streamed_chunks_concatenate_to_the_plain_completion(served: Served) -> None:
    """A streamed completion's chunks concatenate to the non-streamed text, every chunk names the
    weight version, and the stream ends with [DONE]."""
    plain = complete(served.port, max_tokens=10, temperature=0)["choices"][0]
    events = stream(served.port, max_tokens=10, temperature=0)
    assert events[-1] == "[DONE]"
    assert len(events) > 3, "tokens arrive as separate chunks"
    assert all(isinstance(e, dict) and e["weight_version"] == 0 for e in events[:-1])
    texts, reasons = streamed_texts(events)
    assert texts == {0: plain["text"]}
    assert reasons == {0: plain["finish_reason"]}


def test_a_prompt_list_gives_the_texts_of_single_prompts(served: Served) -> None:
    """A list of prompts gives one choice per prompt, each the text that prompt gets alone: a
    sequence's output does not depend on what shares its batch."""
    prompts = [PROMPT, "A dog.", "Numbers 1 2 3"]
    alone = [
        complete(served.port, prompt=p, max_tokens=6, temperature=0)["choices"][0]["text"]
        for p in prompts
    ]
    together = complete(served.port, prompt=prompts, max_tokens=6, temperature=0)
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [c["text"] for c in together["choices"]] == alone
    texts, _ = streamed_texts(stream(served.port, prompt=prompts, max_tokens=6, temperature=0))
    assert [texts[i] for i in range(3)] == alone


def test_seeded_sampling_repeats(served: Served) -> None:
    """Sampling with a temperature and a seed gives the same text for the same seed."""
    a = complete(served.port, max_tokens=10, temperature=1.0, seed=7)["choices"][0]["text"]
    b = complete(served.port, max_tokens=10, temperature=1.0, seed=7)["choices"][0]["text"]
    assert a == b


def test_a_stop_string_ends_the_completion_before_it(served: Served) -> None:
    """A stop string cuts the text where it first appears (finish_reason "stop"), streamed or
    not."""
    full = complete(served.port, max_tokens=12, temperature=0)["choices"][0]["text"]
    pieces = re.findall(r" t\d+", full)
    assert len(pieces) > 2, full
    stop = pieces[2]
    cut = full[: full.find(stop)]
    plain = complete(served.port, max_tokens=12, temperature=0, stop=[stop])["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == (cut, "stop")
    texts, reasons = streamed_texts(stream(served.port, max_tokens=12, temperature=0, stop=stop))
    assert (texts[0], reasons[0]) == (cut, "stop")


def test_health_and_models_name_the_model_and_version(served: Served) -> None:
    """/health and /v1/models name the served model and its current weight version."""
    status, health = call(served.port, "GET", "/health")
    assert status == 200
    assert health == {"status": "ok", "model": served.runtime.model_name, "weight_version": 0}
    status, models = call(served.port, "GET", "/v1/models")
    assert status == 200
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["weight_version"]) for m in models["data"]] == [
        (served.runtime.model_name, "model", 0)
    ]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("POST", "/v1/completions", b"{not json", 400, "invalid_json"),
        ("POST", "/v1/completions", b'{"max_tokens": 4}', 400, None),
        ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, None),
        ("POST", "/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, None),
        ("POST", "/v1/completions", b'{"prompt": "x", "n": 0}', 400, None),
        ("POST", "/v1/completions", b'["prompt"]', 400, None),
        ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, None),
        ("POST", "/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "model_not_found"),
        ("GET", "/v1/nothing", None, 404, "not_found"),
        ("GET", "/v1/completions", None, 405, "method_not_allowed"),
        ("POST", "/v1/completions", b'{"prompt": "x", "max_token": 4}', 400, "unknown_parameter"),
        ("POST", "/v1/completions", b'{"prompt": "x", "temprature": 0}', 400, "unknown_parameter"),
        ("POST", "/v1/completions", b'{"prompt": "x", "top_p": 1.5}', 400, None),
        ("POST", "/v1/completions", b'{"prompt": "x", "top_q": 0.5}', 400, "unknown_parameter"),
        (
            "POST",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            400,
            "no_chat_template",
        ),
    ],
    ids=[
        "bad-json",
        "no-prompt",
        "zero-tokens",
        "negative-temperature",
        "n-zero",
        "not-an-object",
        "past-context",
        "unknown-model",
        "unknown-route",
        "wrong-method",
        "misspelt-max-tokens",
        "misspelt-temperature",
        "top-p-past-1",
        "unknown-top-q",
        "chat-without-template",
    ],
)
def test_bad_requests_get_openai_style_errors(
    served: Served, method: str, path: str, body: bytes | None, status: int, code: str | None
) -> None:
    """A bad request gets its status and an OpenAI-style error body; the server keeps serving."""
    got, reply = call(served.port, method, path, raw=body)
    assert got == status, reply
    assert set(reply) == {"error"}
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"
    if code is not None:
        assert reply["error"]["code"] == code
    assert complete(served.port, max_tokens=2, temperature=0)["weight_version"] == 0


def test_a_full_queue_answers_503_and_a_stuck_request_times_out(model_dir: ModelDir) -> None:
    """With the queue full the server answers 503 at once; a request never served answers 503
    once its timeout has passed (no inference thread runs here)."""
    for served in start_server(model_dir.first, run_loop=False, max_queue=1, request_timeout_s=0.5):
        waiting: list[tuple[int, dict[str, Any]]] = []
        first = threading.Thread(
            target=lambda: waiting.append(
                call(served.port, "POST", "/v1/completions", {"prompt": "a"})
            )
        )
        first.start()
        wait_for(lambda: served.batcher.status()["queued"] == 1, timeout=WAIT_S, what="queued")
        status, reply = call(served.port, "POST", "/v1/completions", {"prompt": "b"})
        assert (status, reply["error"]["code"]) == (503, "queue_full")
        first.join(WAIT_S)
        assert not first.is_alive()
        ((status, reply),) = waiting
        assert (status, reply["error"]["code"]) == (503, "timeout")


def test_a_plan_commits_between_requests_and_responses_name_it(
    tmp_path: Path,
) -> None:
    """A plan submitted while the server idles is committed before the next request, whose
    response and /health name the new version; swapping back restores the original text."""
    models = ModelDir.write(tmp_path / "model", spec())
    name = SWAPPED[2]
    saved = models.save(name, tmp_path / "saved")
    for served in start_server(models.first):
        before = complete(served.port, max_tokens=8, temperature=0)
        assert before["weight_version"] == 0
        models.put(name, models.variant(name, Q.Q4_0, tmp_path / "variants"))
        ticket = served.runtime.submit(models.plan(uuid.uuid4().hex, [name]))
        assert ticket.wait(WAIT_S) is PlanState.COMMITTED, ticket.reasons
        after = complete(served.port, max_tokens=8, temperature=0)
        assert after["weight_version"] == 1
        assert call(served.port, "GET", "/health")[1]["weight_version"] == 1
        models.put(name, saved)
        ticket = served.runtime.submit(models.plan(uuid.uuid4().hex, [name]))
        assert ticket.wait(WAIT_S) is PlanState.COMMITTED, ticket.reasons
        restored = complete(served.port, max_tokens=8, temperature=0)
        assert restored["weight_version"] == 2
        assert restored["choices"] == before["choices"]


# -- the runtime process under a sweep ---------------------------------------------------------


def send_plan(control: str, plan: Plan) -> int:
    """Send ``plan`` over the control socket; the weight version of its ``committed`` reply."""
    with DealerClient(control) as client:
        client.send(make_message(MessageType.PLAN, **plan_to_wire(plan)))
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            reply = client.poll(0.2)
            if reply is None:
                continue
            kind = reply[Fields.TYPE]
            assert kind != MessageType.REJECTED.value, reply
            if kind == MessageType.COMMITTED.value:
                version: int = reply[Fields.WEIGHT_VERSION]
                return version
    raise AssertionError(f"plan {plan.plan_id} not committed within {WAIT_S}s")


@dataclass(frozen=True)
class Answer:
    prompt: str
    streamed: bool
    version: int
    text: str
    latency_s: float
    done_at: float


def client_loop(port: int, index: int, done: threading.Event, out: list[Answer | str]) -> None:
    """Ask completions (plain and streamed, two prompts) until ``done``; record every answer or
    failure."""
    prompts = [PROMPT, f"Client {index} asks."]
    n = 0
    while not done.is_set() or n < 2:
        prompt, streamed = prompts[n % 2], bool(n // 2 % 2)
        n += 1
        started = time.monotonic()
        try:
            if streamed:
                events = stream(port, prompt=prompt, max_tokens=6, temperature=0)
                assert events[-1] == "[DONE]", events
                versions = {e["weight_version"] for e in events[:-1] if isinstance(e, dict)}
                assert len(versions) == 1, versions
                texts, _ = streamed_texts(events)
                version, text = versions.pop(), texts[0]
            else:
                reply = complete(port, prompt=prompt, max_tokens=6, temperature=0)
                version, text = reply["weight_version"], reply["choices"][0]["text"]
        except Exception as exc:  # noqa: BLE001 (every failure is recorded and fails the test)
            out.append(f"client {index}: {exc!r}")
            continue
        now = time.monotonic()
        out.append(Answer(prompt, streamed, version, text, now - started, now))


@pytest.mark.process
def test_concurrent_clients_get_answers_through_a_20_swap_sweep(tmp_path: Path) -> None:
    """While 20 plans (re-quantized shards renamed into place, sent over the control socket) are
    committed under a runtime serving HTTP, 4 concurrent clients get every answer; each names a
    version that existed, and answers on one version to one prompt are identical."""
    models = ModelDir.write(tmp_path / "model", spec())
    saved = {name: models.save(name, tmp_path / "saved") for name in SWAPPED}
    variants = {name: models.variant(name, Q.Q4_0, tmp_path / "variants") for name in SWAPPED}
    run_dir = tmp_path / "run"
    control = f"ipc://{run_dir}/rt.sock"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"runtime:\n  name: tiny\n  model: {models.first}\n  control_endpoint: {control}\n"
    )
    proc = Proc(
        ["runtime", "--config", str(config), "--mode", "http", "--http-port", "0"],
        log=tmp_path / "runtime.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        status = wait_for(
            lambda: (s := status_of(control)) is not None and "http" in s and s,
            timeout=60,
            what="the runtime to serve HTTP",
        )
        port = status["http"]["port"]
        done = threading.Event()
        answers: list[list[Answer | str]] = [[] for _ in range(4)]
        clients = [
            threading.Thread(target=client_loop, args=(port, i, done, answers[i])) for i in range(4)
        ]
        for c in clients:
            c.start()
        versions = [0]
        sweep_started = time.monotonic()
        try:
            for i in range(20):
                name = SWAPPED[i % len(SWAPPED)]
                models.put(name, variants[name] if i // len(SWAPPED) % 2 == 0 else saved[name])
                versions.append(send_plan(control, models.plan(f"sweep-{i}", [name])))
        finally:
            sweep_ended = time.monotonic()
            done.set()
            for c in clients:
                c.join(WAIT_S)
        assert not any(c.is_alive() for c in clients)
    finally:
        code = proc.stop()
    assert code == 0, proc.log()
    assert versions == list(range(21))
    failures = [a for per_client in answers for a in per_client if isinstance(a, str)]
    assert not failures, failures
    served = [a for per_client in answers for a in per_client if isinstance(a, Answer)]
    assert all(per_client for per_client in answers), "every client got answers"
    assert {a.version for a in served} <= set(versions)
    texts: dict[tuple[int, str], set[str]] = {}
    for a in served:
        texts.setdefault((a.version, a.prompt), set()).add(a.text)
    assert all(len(t) == 1 for t in texts.values()), texts
    during = [a for a in served if sweep_started <= a.done_at <= sweep_ended]
    latencies = sorted(a.latency_s for a in served)
    print(
        f"\nsweep of 20 swaps in {sweep_ended - sweep_started:.2f}s: {len(served)} answers "
        f"({len(during)} during the sweep) on {len({a.version for a in served})} versions, "
        f"0 failures; latency p50 {statistics.median(latencies) * 1e3:.1f} ms, "
        f"max {latencies[-1] * 1e3:.1f} ms"
    )


@pytest.mark.process
@pytest.mark.real_model
def test_real_model_serves_english_and_a_swap_under_it(tmp_path: Path, real_gemma: Path) -> None:
    """Gemma 3 270M served over HTTP continues a sequence greedily, streamed and not, and after a
    re-quantized attention weight is swapped in, answers name the new weight version."""
    gguf = tmp_path / real_gemma.name
    shutil.copyfile(real_gemma, gguf)
    prompt = "Monday, Tuesday, Wednesday,"
    for served in start_server(gguf):
        plain = complete(served.port, prompt=prompt, max_tokens=3, temperature=0)
        assert "Thursday" in plain["choices"][0]["text"], plain
        texts, _ = streamed_texts(stream(served.port, prompt=prompt, max_tokens=3, temperature=0))
        assert texts == {0: plain["choices"][0]["text"]}
        name = "blk.3.attn_q.weight"
        requantize(gguf, name, Q.Q8_0)
        plan = Plan("q8", "", (Job(read_header(gguf).tensor_map()[name]),))
        assert served.runtime.submit(plan).wait(WAIT_S) is PlanState.COMMITTED
        after = complete(served.port, prompt=prompt, max_tokens=3, temperature=0)
        assert after["weight_version"] == 1
        assert "Thursday" in after["choices"][0]["text"], after


def test_unknown_parameter_names_itself_and_the_closest_known_one(served: Served) -> None:
    """A misspelt parameter is refused with OpenAI's ``param`` and a suggestion, not ignored."""
    status, reply = call(served.port, "POST", "/v1/completions", {"prompt": "x", "max_token": 4})
    assert status == 400
    assert reply["error"]["param"] == "max_token"
    assert "did you mean 'max_tokens'?" in reply["error"]["message"]


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_completion_renders_the_template_and_answers_as_chat(model_dir: ModelDir) -> None:
    """With a chat template, /v1/chat/completions answers what /v1/completions answers for the
    rendered prompt, shaped as a chat completion; bad messages get a 400 naming them."""
    tokenizer = GgufTokenizer.from_file(model_dir.first)
    assert tokenizer.bos_id is not None
    template = ChatTemplate(
        CHAT_TEMPLATE, bos_token=tokenizer.token(tokenizer.bos_id), eos_token=""
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    rendered = template.render(messages)
    assert rendered.endswith(f"user: {PROMPT}\nassistant:"), rendered
    for served in start_server(model_dir.first, chat_template=template):
        status, chat = call(
            served.port,
            "POST",
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 5, "temperature": 0},
        )
        assert status == 200, chat
        assert chat["object"] == "chat.completion"
        (choice,) = chat["choices"]
        assert choice["message"]["role"] == "assistant"
        prompt = rendered.removeprefix(template.bos_token)  # /v1/completions adds the BOS
        plain = complete(served.port, prompt=prompt, max_tokens=5, temperature=0)
        assert choice["message"]["content"] == plain["choices"][0]["text"]
        assert chat["usage"] == plain["usage"]
        status, bad = call(
            served.port, "POST", "/v1/chat/completions", {"messages": [{"role": "bot"}]}
        )
        assert (status, bad["error"]["param"]) == (400, "messages"), bad
