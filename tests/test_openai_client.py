"""The official ``openai`` client against the server: every sampling parameter, logprobs, ``n``,
streaming with usage on both routes, the chat template override, the model list, and
llama-server's /tokenize, /detokenize, /props and /metrics (issue 29, items 1 and 2)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from runtime_helpers import ModelDir, one_thread
from test_http import CHAT_TEMPLATE, PROMPT, WAIT_S, Served, spec, start_server

from ggufswap.runtime.serving import GgufTokenizer
from ggufswap.runtime.serving.chat import ChatTemplate

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    models = ModelDir.write(tmp_path_factory.mktemp("openai") / "model", spec())
    tokenizer = GgufTokenizer.from_file(models.first)
    assert tokenizer.bos_id is not None
    template = ChatTemplate(
        CHAT_TEMPLATE, bos_token=tokenizer.token(tokenizer.bos_id), eos_token=""
    )
    yield from start_server(models.first, chat_template=template, max_batch=8)


@pytest.fixture
def client(served: Served) -> Iterator[Any]:
    """A client per test, closed after it (with its pooled keep-alive connections)."""
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{served.port}/v1",
        api_key="unused",
        timeout=WAIT_S,
        max_retries=0,
    ) as client:
        yield client


def raw(port: int, method: str, path: str, body: object = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body))
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_defaults_named_explicitly_change_nothing(client: Any, served: Served) -> None:
    """top_p=1, frequency/presence penalties 0, repetition_penalty 1, top_k 0, min_p 0, an empty
    logit_bias and stream_options off give exactly the text of a request that names none."""
    name = served.runtime.model_name
    plain = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
    named = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        top_p=1.0,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        seed=1,
        user="someone",
        extra_body={"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0},
    )
    assert named.choices[0].text == plain.choices[0].text
    assert named.model_extra["weight_version"] == 0


def test_every_sampling_parameter_is_taken_and_acts(client: Any, served: Served) -> None:
    """Each parameter does what it says: logit_bias forces a token, a penalty changes a greedy
    repetition, top_k=1 and min_p=1 sample greedily, a seed repeats, n gives n choices."""
    name = served.runtime.model_name
    tokenizer = served.batcher.tokenizer
    greedy = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
    forced_id = tokenizer.encode(" t17", add_bos=False)[-1]
    forced = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == tokenizer.decode([forced_id] * 3)
    penalised = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"repetition_penalty": 1.5},
    )
    assert penalised.choices[0].text != greedy.choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3, extra_body=extra
        )
        assert sampled.choices[0].text == greedy.choices[0].text, extra
    first, second = (
        client.completions.create(
            model=name, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=11, n=3
        )
        for _ in range(2)
    )
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert (
        first.usage.completion_tokens
        == sum(len(tokenizer.encode(c.text, add_bos=False)) for c in first.choices)
        or first.usage.completion_tokens == 24
    )


def test_logprobs_on_completions_and_chat(client: Any, served: Served) -> None:
    """logprobs=k on completions and logprobs/top_logprobs on chat give one entry per token with
    k alternatives, the chosen token's logprob being the largest under greedy decoding."""
    name = served.runtime.model_name
    done = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(
        abs(lp.token_logprobs[i] - max(lp.top_logprobs[i].values())) < 1e-9 for i in range(4)
    )
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    pieces = "".join(entry.token for entry in content)  # the text of the completion's tokens
    assert pieces.lstrip() == chat.choices[0].message.content.lstrip()


def test_streaming_chat_and_completions_with_usage(client: Any, served: Served) -> None:
    """Streamed chat deltas and streamed completion chunks concatenate to the plain answers;
    stream_options.include_usage adds a last chunk with the usage and no choices."""
    name = served.runtime.model_name
    messages = [{"role": "user", "content": PROMPT}]
    plain = client.chat.completions.create(
        model=name, messages=messages, max_tokens=6, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens
    assert {c.model_extra["weight_version"] for c in chunks} == {0}
    done = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0)
    streamed = list(
        client.completions.create(
            model=name, prompt=PROMPT, max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text


def test_a_chat_template_override_is_used(client: Any, served: Served) -> None:
    """extra_body chat_template renders the messages with that template instead of the model's:
    the answer equals the completion of the prompt it renders."""
    name = served.runtime.model_name
    override = "{% for m in messages %}Q: {{ m['content'] }}{% endfor %} A:"
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=5,
        temperature=0,
        extra_body={"chat_template": override},
    )
    plain = client.completions.create(
        model=name, prompt=f"Q: {PROMPT} A:", max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.content == plain.choices[0].text


def test_models_and_unknown_parameters(client: Any, served: Served) -> None:
    """/v1/models lists the model with its metadata; an unknown parameter is a 400 naming the
    closest known one."""
    (model,) = client.models.list().data
    assert model.id == served.runtime.model_name
    meta = model.model_extra["meta"]
    assert meta["n_vocab"] == served.batcher.tokenizer.n_vocab
    assert meta["n_ctx_train"] == served.batcher.context_length
    assert client.models.retrieve(model.id).id == model.id
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model.id, prompt="x", extra_body={"top_kk": 3})
    assert "did you mean 'top_k'?" in str(raised.value)


def test_llama_server_routes(served: Served) -> None:
    """/tokenize and /detokenize round-trip (with pieces on request), /props names the slots and
    context, /metrics on the serving port has the request, token, queue and swap series."""
    status, body = raw(served.port, "POST", "/tokenize", {"content": PROMPT, "with_pieces": True})
    assert status == 200
    pieces = json.loads(body)["tokens"]
    ids = [p["id"] for p in pieces]
    assert ids == served.batcher.tokenizer.encode(PROMPT, add_bos=False)
    status, body = raw(served.port, "POST", "/detokenize", {"tokens": ids})
    content = json.loads(body)["content"]
    assert (status, content) == (200, served.batcher.tokenizer.decode(ids))
    status, body = raw(served.port, "GET", "/props")
    props = json.loads(body)
    assert props["total_slots"] == served.batcher.options.max_batch
    assert props["default_generation_settings"]["n_ctx"] == served.batcher.context_length
    status, body = raw(served.port, "GET", "/metrics")
    text = body.decode()
    for series in (
        "ggufswap_http_requests_total",
        "ggufswap_http_request_seconds_bucket",
        "ggufswap_completion_tokens_total",
        "ggufswap_queue_prompts",
        "ggufswap_runtime_weight_version",
    ):
        assert series in text, series
