"""``/v1/completions`` and ``/v1/chat/completions``: a validated request to the batcher, its
events back as an OpenAI response or a stream of server-sent events.

The event loop never blocks: tokenizing (in ``Batcher.submit``) and rendering a chat template run
on worker threads, and a generation's events wake the loop through the queue's waker. Every
response and every streamed chunk names the ``weight_version`` that produced all its tokens. A
stream that fails after it started ends with a ``data: {"error": ...}`` chunk and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final

from starlette.responses import JSONResponse, StreamingResponse

from ggufswap.runtime.serving.chat import ChatTemplate
from ggufswap.runtime.serving.errors import (
    ApiError,
    ChatTemplateError,
    Closed,
    InvalidRequest,
    QueueFull,
    TemplateBudgetExceeded,
    bad_request,
    unavailable,
)
from ggufswap.runtime.serving.events import (
    Ended,
    Event,
    Failed,
    FailureKind,
    Finished,
    Generation,
    Started,
    TextDelta,
)
from ggufswap.runtime.serving.params import CompletionRequest
from ggufswap.runtime.serving.sampling import TokenLogprob
from ggufswap.runtime.serving.tokenizer import GgufTokenizer

Offload = Callable[..., Awaitable[Any]]  # runs a blocking call on a worker thread
WAIT_GRACE_S: Final = 1.0  # the batcher enforces the deadline; the handler waits a bit more
OBJECT_COMPLETION: Final = "text_completion"
OBJECT_CHAT: Final = "chat.completion"
OBJECT_CHAT_CHUNK: Final = "chat.completion.chunk"


@dataclass
class Reply:
    """The envelope every body and chunk of one response shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def body(self, *, chunk: bool, choices: list[dict[str, Any]], version: int) -> dict[str, Any]:
        kind = OBJECT_COMPLETION
        if self.chat:
            kind = OBJECT_CHAT_CHUNK if chunk else OBJECT_CHAT
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "weight_version": version,
        }


class Events:
    """A generation's events, awaited on the event loop (the batcher's thread wakes it)."""

    def __init__(self, generation: Generation) -> None:
        loop = asyncio.get_running_loop()
        self.generation = generation
        self._flag = asyncio.Event()

        def wake() -> None:  # on the batcher's thread
            loop.call_soon_threadsafe(self._flag.set)

        generation.events.waker = wake

    async def next(self) -> Event:
        """The next event, or a 503 once the request's deadline (plus grace) has passed."""
        events = self.generation.events
        while True:
            try:
                return events.get_nowait()
            except queue.Empty:
                pass
            left = self.generation.deadline - time.monotonic() + WAIT_GRACE_S
            if left <= 0:
                raise unavailable("the request timed out", "timeout")
            try:
                await asyncio.wait_for(self._flag.wait(), left)
            except TimeoutError:
                continue
            self._flag.clear()


async def render_chat(request: CompletionRequest, template: ChatTemplate, offload: Offload) -> str:
    """The request's messages through ``template``, on a worker thread, within its budget."""
    try:
        text: str = await offload(template.render, request.messages)
        return text
    except TemplateBudgetExceeded as exc:
        raise bad_request(str(exc), "template_budget_exceeded", param="messages") from None
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "chat_template_failed", param="messages") from None


async def submit(
    batcher_submit: Callable[..., Generation], request: CompletionRequest, offload: Offload
) -> Generation:
    """Hand the request to the batcher (tokenizing on a worker thread); batcher refusals as
    HTTP errors."""
    try:
        generation: Generation = await offload(
            batcher_submit, list(request.prompts), request.sampling, special=request.chat
        )
        return generation
    except InvalidRequest as exc:
        raise bad_request(str(exc), exc.code) from None
    except QueueFull as exc:
        raise unavailable(str(exc), "queue_full") from None
    except Closed as exc:
        raise unavailable(str(exc), "shutting_down") from None


def failure(event: Failed) -> ApiError:
    if event.kind is FailureKind.ERROR:
        return ApiError(
            HTTPStatus.INTERNAL_SERVER_ERROR, event.message, kind="server_error", code="failed"
        )
    return unavailable(event.message, event.kind.value)


class Formatter:
    """Choices and log-probabilities in the shape of the route (completions or chat)."""

    def __init__(self, tokenizer: GgufTokenizer, *, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.piece_bytes(token_id).decode("utf-8", errors="replace")

    def logprobs(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> Any:
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._piece(e.token_id),
                        "logprob": e.logprob,
                        "bytes": list(self.tokenizer.piece_bytes(e.token_id)),
                        "top_logprobs": [
                            {
                                "token": self._piece(i),
                                "logprob": lp,
                                "bytes": list(self.tokenizer.piece_bytes(i)),
                            }
                            for i, lp in e.top
                        ],
                    }
                    for e in entries
                ]
            }
        return {
            "tokens": [self._piece(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._piece(i): lp for i, lp in e.top} for e in entries],
        }

    def choice(
        self, index: int, text: str, reason: str | None, logprobs: Any, *, delta: bool
    ) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        key = "delta" if delta else "message"
        content: dict[str, Any] = {"content": text} if delta else {}
        if not delta:
            content = {"role": "assistant", "content": text}
        return {"index": index, key: content, "logprobs": logprobs, "finish_reason": reason}


def _role_delta(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def usage(ended: Ended) -> dict[str, int]:
    return {
        "prompt_tokens": ended.prompt_tokens,
        "completion_tokens": ended.completion_tokens,
        "total_tokens": ended.prompt_tokens + ended.completion_tokens,
    }


async def complete(
    events: Events, request: CompletionRequest, reply: Reply, formatter: Formatter
) -> tuple[JSONResponse, Ended]:
    """Wait for every event of a generation; the whole response."""
    n = events.generation.sequences
    texts = [""] * n
    reasons: list[str | None] = [None] * n
    entries: list[list[TokenLogprob]] = [[] for _ in range(n)]
    while True:
        event = await events.next()
        if isinstance(event, TextDelta):
            texts[event.index] += event.text
            entries[event.index].extend(event.logprobs)
        elif isinstance(event, Finished):
            reasons[event.index] = event.reason.value
            entries[event.index].extend(event.logprobs)
        elif isinstance(event, Ended):
            break
        elif isinstance(event, Failed):
            raise failure(event)
    wants = request.sampling.logprobs is not None
    choices = [
        formatter.choice(
            i, texts[i], reasons[i], formatter.logprobs(entries[i]) if wants else None, delta=False
        )
        for i in range(n)
    ]
    body = reply.body(chunk=False, choices=choices, version=event.weight_version)
    body["usage"] = usage(event)
    return JSONResponse(body), event


async def stream(
    events: Events,
    request: CompletionRequest,
    reply: Reply,
    formatter: Formatter,
    on_end: Callable[[Ended | None], None],
) -> StreamingResponse:
    """Server-sent events: a chunk per piece of text, one per finish, an optional usage chunk,
    then ``[DONE]``. A failure before the first token is still an error status."""
    first = await events.next()
    if isinstance(first, Failed):
        raise failure(first)
    assert isinstance(first, Started), f"the first event is Started, found {first!r}"
    version = first.weight_version
    wants = request.sampling.logprobs is not None

    def sse(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse(reply.body(chunk=True, choices=[choice], version=version))

    async def body() -> AsyncIterator[bytes]:
        ended: Ended | None = None
        try:
            if formatter.chat:  # OpenAI's first chat chunk names the role
                for i in range(events.generation.sequences):
                    yield chunk(_role_delta(i))
            while True:
                try:
                    event = await events.next()
                except ApiError as exc:
                    yield sse(exc.body())
                    return
                if isinstance(event, TextDelta | Finished):
                    text = event.text if isinstance(event, TextDelta) else ""
                    reason = event.reason.value if isinstance(event, Finished) else None
                    lp = formatter.logprobs(event.logprobs) if wants else None
                    yield chunk(formatter.choice(event.index, text, reason, lp, delta=True))
                elif isinstance(event, Failed):
                    yield sse(failure(event).body())
                    return
                elif isinstance(event, Ended):
                    ended = event
                    break
            if request.include_usage:
                last = reply.body(chunk=True, choices=[], version=version)
                yield sse({**last, "usage": usage(ended)})
            yield b"data: [DONE]\n\n"
        finally:
            events.generation.cancel()  # a no-op once it ended; the client went away otherwise
            on_end(ended)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
