"""The HTTP routes (a Starlette application): OpenAI's, llama-server's and the weight updates.

| route | what |
|---|---|
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | completions.py |
| ``GET /v1/models``, ``GET /v1/models/{id}`` | the model, with its metadata |
| ``GET /health`` | 200 ``ok`` and the weight version; 503 ``loading``, phase and progress |
| ``GET /props`` | generation defaults, slots, chat template, BOS/EOS (llama-server's) |
| ``POST /tokenize``, ``POST /detokenize`` | llama-server's bodies |
| ``GET /metrics`` | Prometheus: requests, tokens, queue, latency, and the swap series |
| ``POST /v1/weights/update``, ``POST /update_weights_from_disk`` | weights.py |
| ``GET /v1/weights?min_weight_version=N&timeout_s=S`` | waits for a version |

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``), for unknown
routes and methods too; an unexpected exception is logged and answered 500.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ggufswap.logs import get_logger
from ggufswap.runtime.serving import completions as cmp
from ggufswap.runtime.serving.chat import ChatTemplate, RenderBudget
from ggufswap.runtime.serving.errors import ApiError, ChatTemplateError, bad_request, unavailable
from ggufswap.runtime.serving.events import Ended
from ggufswap.runtime.serving.metrics import ServingMetrics
from ggufswap.runtime.serving.params import CompletionRequest, parse_chat, parse_completion
from ggufswap.runtime.serving.startup import Startup
from ggufswap.runtime.serving.tokenizer import GgufTokenizer
from ggufswap.runtime.serving.weights import apply_update, parse_update

if TYPE_CHECKING:  # the server's modules load without torch (ggufswap.runtime)
    from ggufswap.runtime.engine import HotSwapRuntime
    from ggufswap.runtime.serving.generate import Batcher

log = get_logger(__name__)

MAX_BODY_BYTES: Final = 1 << 20
OVERRIDE_TEMPLATES_KEPT: Final = 8  # compiled per-request chat templates, most recent first
# Threads for the blocking work of requests (tokenizing, rendering, waiting for a plan).
WORKER_THREADS: Final = 8
START_TIMEOUT_S: Final = 30.0
Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class Ready:
    """What the routes serve once the runtime has started."""

    runtime: HotSwapRuntime
    batcher: Batcher
    tokenizer: GgufTokenizer
    chat_template: ChatTemplate | None
    chat_error: str | None  # why the model's template is unusable, if it is
    meta: dict[str, Any]  # /v1/models' metadata
    render_budget: RenderBudget


class Routes:
    """The application's state and handlers; :meth:`attach` makes it serve."""

    def __init__(self, *, model_name: str, startup: Startup, metrics: ServingMetrics) -> None:
        self.model_name = model_name
        self.startup = startup
        self.metrics = metrics
        self.ready: Ready | None = None
        self.created = int(time.time())
        self._templates: dict[str, ChatTemplate] = {}
        self._workers = _started_pool(WORKER_THREADS)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
                Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
                Route("/v1/models", self._guard(self.models), methods=["GET"]),
                Route("/v1/models/{model_id:path}", self._guard(self.model), methods=["GET"]),
                Route("/health", self._guard(self.health), methods=["GET"]),
                Route("/props", self._guard(self.props), methods=["GET"]),
                Route("/tokenize", self._guard(self.tokenize), methods=["POST"]),
                Route("/detokenize", self._guard(self.detokenize), methods=["POST"]),
                Route("/metrics", self._guard(self.prometheus), methods=["GET"]),
                Route("/v1/weights/update", self._guard(self.update), methods=["POST"]),
                Route("/update_weights_from_disk", self._guard(self.update), methods=["POST"]),
                Route("/v1/weights", self._guard(self.weights), methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},  # type: ignore[dict-item]
        )

    async def offload(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` on a worker thread, awaited."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._workers, functools.partial(function, *args, **kwargs)
        )

    def close(self) -> None:
        """Let the worker threads go (once the server no longer calls handlers)."""
        self._workers.shutdown(wait=True, cancel_futures=True)

    def attach(self, ready: Ready) -> None:
        self.ready = ready
        self.metrics.attach(ready.runtime, ready.batcher)

    # -- plumbing ----------------------------------------------------------------------------

    def _guard(self, handler: Handler) -> Handler:
        """``handler`` with its errors as OpenAI-shaped responses and its metrics recorded."""

        async def guarded(request: Request) -> Response:
            started = time.monotonic()
            try:
                response = await handler(request)
            except ApiError as exc:
                log.info("http.error", status=int(exc.status), code=exc.code, message=exc.message)
                response = JSONResponse(exc.body(), status_code=exc.status)
            except ClientDisconnect:  # the body deadline passed: the guard answered 408
                response = Response(status_code=HTTPStatus.REQUEST_TIMEOUT)
            except Exception as exc:  # a bug: answer 500 rather than drop the connection
                log.exception("http.handler_failed", path=request.url.path)
                error = ApiError(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    f"{type(exc).__name__}: {exc}",
                    kind="server_error",
                    code="internal",
                )
                response = JSONResponse(error.body(), status_code=error.status)
            self.metrics.request(request.url.path, response.status_code, time.monotonic() - started)
            return response

        return guarded

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = exc.detail
        if exc.status_code == HTTPStatus.NOT_FOUND:
            message = f"no route {request.method} {request.url.path}; {ROUTES_HINT}"
        elif exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
            message = f"{request.url.path} does not take {request.method}"
        body = ApiError(
            HTTPStatus(exc.status_code), message, kind="invalid_request_error", code=code
        ).body()
        self.metrics.request("other", exc.status_code, 0.0)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    def _serving(self) -> Ready:
        """The ready state, or a 503 saying what the start is doing."""
        if self.ready is None:
            snap = self.startup.snapshot()
            raise unavailable(
                f"the model is {snap['status']} (phase {snap['phase']}, progress "
                f"{snap['progress']}); retry later",
                "loading",
            )
        return self.ready

    # -- completions -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        ready = self._serving()
        parsed = parse_completion(await read_json(request), model_name=self.model_name)
        return await self._generate(ready, parsed)

    async def chat(self, request: Request) -> Response:
        ready = self._serving()
        parsed = parse_chat(await read_json(request), model_name=self.model_name)
        template = await self._template(ready, parsed.chat_template)
        prompt = await cmp.render_chat(parsed, template, self.offload)
        parsed = CompletionRequest(**{**parsed.__dict__, "prompts": (prompt,)})
        return await self._generate(ready, parsed)

    async def _template(self, ready: Ready, source: str | None) -> ChatTemplate:
        if source is None:
            if ready.chat_template is None:
                raise ApiError(
                    HTTPStatus.BAD_REQUEST,
                    f"model {self.model_name!r} has no usable chat template "
                    f"({ready.chat_error or 'its GGUF has no tokenizer.chat_template'}), so "
                    "chat messages cannot be formatted for it; send 'chat_template' with the "
                    "request, or a formatted prompt to POST /v1/completions",
                    kind="invalid_request_error",
                    code="no_chat_template",
                )
            return ready.chat_template
        known = self._templates.pop(source, None)
        if known is None:
            bos, eos = _special_text(ready.tokenizer)
            try:
                known = await self.offload(
                    ChatTemplate, source, bos_token=bos, eos_token=eos, budget=ready.render_budget
                )
            except ChatTemplateError as exc:
                raise bad_request(str(exc), "chat_template_failed", param="chat_template") from None
        self._templates[source] = known  # most recent last; the oldest goes first
        while len(self._templates) > OVERRIDE_TEMPLATES_KEPT:
            self._templates.pop(next(iter(self._templates)))
        return known

    async def _generate(self, ready: Ready, parsed: CompletionRequest) -> Response:
        if parsed.min_weight_version is not None:
            await self._wait_version(
                ready, parsed.min_weight_version, ready.batcher.options.request_timeout_s
            )
        generation = await cmp.submit(ready.batcher.submit, parsed, self.offload)
        events = cmp.Events(generation)
        reply = cmp.Reply(chat=parsed.chat, model=self.model_name)
        formatter = cmp.Formatter(ready.tokenizer, chat=parsed.chat)
        started = time.monotonic()

        def on_end(ended: Ended | None) -> None:
            if ended is not None:
                self.metrics.tokens(ended.prompt_tokens, ended.completion_tokens)
                self.metrics.generation(time.monotonic() - started)

        if parsed.stream:
            return await cmp.stream(events, parsed, reply, formatter, on_end)
        try:
            response, ended = await cmp.complete(events, parsed, reply, formatter)
        finally:
            generation.cancel()  # a no-op once it ended; frees the batch slot otherwise
        on_end(ended)
        return response

    async def _wait_version(self, ready: Ready, version: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while ready.runtime.weight_version < version:
            if time.monotonic() > deadline:
                raise unavailable(
                    f"weight_version {version} was not reached within {timeout:g} s (now "
                    f"{ready.runtime.weight_version})",
                    "weight_version_not_reached",
                )
            await asyncio.sleep(0.02)

    # -- the model ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.ready is None:
            return JSONResponse(self.startup.snapshot(), status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model_name,
                "weight_version": self.ready.runtime.weight_version,
            }
        )

    def _model_card(self, ready: Ready) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "ggufswap",
            "weight_version": ready.runtime.weight_version,
            "meta": ready.meta,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card(self._serving())]})

    async def model(self, request: Request) -> Response:
        ready = self._serving()
        if request.path_params["model_id"] != self.model_name:
            raise ApiError(
                HTTPStatus.NOT_FOUND,
                f"model {request.path_params['model_id']!r} is not served here; this server "
                f"serves {self.model_name!r}",
                kind="invalid_request_error",
                code="model_not_found",
            )
        return JSONResponse(self._model_card(ready))

    async def props(self, request: Request) -> Response:
        ready = self._serving()
        options = ready.batcher.options
        bos, eos = _special_text(ready.tokenizer)
        return JSONResponse(
            {
                "default_generation_settings": {
                    "n_ctx": ready.batcher.context_length,
                    "params": {
                        "temperature": 1.0,
                        "top_k": 0,
                        "top_p": 1.0,
                        "min_p": 0.0,
                        "max_tokens": 16,
                        "repetition_penalty": 1.0,
                        "frequency_penalty": 0.0,
                        "presence_penalty": 0.0,
                    },
                },
                "total_slots": options.max_batch,
                "max_queue": options.max_queue,
                "max_prompt_chars": ready.batcher.max_prompt_chars,
                "model_alias": self.model_name,
                "model_path": ready.meta.get("path"),
                "chat_template": ready.chat_template.source if ready.chat_template else None,
                "bos_token": bos,
                "eos_token": eos,
                "weight_version": ready.runtime.weight_version,
                "build_info": "ggufswap",
            }
        )

    async def tokenize(self, request: Request) -> Response:
        ready = self._serving()
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise bad_request(
                'the body must be {"content": string, "add_special"?: bool, "with_pieces"?: bool}',
                param="content",
            )
        content: str = body["content"]
        if len(content) > ready.batcher.max_prompt_chars:
            raise bad_request(
                f"'content' has {len(content):,} characters; at most "
                f"{ready.batcher.max_prompt_chars:,} are tokenized",
                "content_too_long",
            )
        add_special = bool(body.get("add_special", False))
        ids = await self.offload(
            ready.batcher.encode,
            content,
            special=bool(body.get("parse_special", False)),
            add_bos=add_special,
        )
        if body.get("with_pieces"):
            pieces = [
                {"id": i, "piece": ready.tokenizer.piece_bytes(i).decode("utf-8", "replace")}
                for i in ids
            ]
            return JSONResponse({"tokens": pieces})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        ready = self._serving()
        body = await read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        n = ready.tokenizer.n_vocab
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n for t in tokens
        ):
            raise bad_request(f"'tokens' must be a list of token ids in 0..{n - 1}", param="tokens")
        return JSONResponse({"content": ready.tokenizer.decode(tokens)})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=self.metrics.content_type)

    # -- weights -----------------------------------------------------------------------------

    async def update(self, request: Request) -> Response:
        ready = self._serving()
        update = parse_update(await read_json(request))
        outcome = await self.offload(apply_update, ready.runtime, update)
        status = (
            HTTPStatus.OK
            if outcome["outcome"] in ("committed", "unchanged")
            else (HTTPStatus.CONFLICT if outcome["outcome"] == "rejected" else HTTPStatus.ACCEPTED)
        )
        return JSONResponse(outcome, status_code=status)

    async def weights(self, request: Request) -> Response:
        ready = self._serving()
        query = request.query_params
        try:
            version = int(query.get("min_weight_version", "0"))
            timeout = float(query.get("timeout_s", "0"))
        except ValueError:
            raise bad_request("min_weight_version is an integer, timeout_s a number") from None
        if not math.isfinite(timeout) or timeout < 0:
            raise bad_request("timeout_s must be a finite number >= 0")
        await self._wait_version(ready, version, timeout)
        return JSONResponse(
            {"model": self.model_name, "weight_version": ready.runtime.weight_version}
        )


ROUTES_HINT: Final = (
    "routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
    "GET /props, POST /tokenize, POST /detokenize, GET /metrics, POST /v1/weights/update, "
    "GET /v1/weights"
)


def _started_pool(n: int) -> ThreadPoolExecutor:
    """A pool whose ``n`` threads all start now (a pool starts them on demand): the server's
    threads are there from its start to its close, none come and go with the traffic."""
    pool = ThreadPoolExecutor(n, thread_name_prefix="ggufswap-http-work")
    everyone = threading.Barrier(n + 1)
    for _ in range(n):
        pool.submit(everyone.wait, START_TIMEOUT_S)
    everyone.wait(START_TIMEOUT_S)
    return pool


def _special_text(tokenizer: GgufTokenizer) -> tuple[str, str]:
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    return (
        "" if bos is None else tokenizer.token(bos),
        "" if eos is None else tokenizer.token(eos),
    )


async def read_json(request: Request) -> object:
    """The request's JSON body: 413 past :data:`MAX_BODY_BYTES` (by header or as it streams),
    400 for invalid JSON, non-finite numbers or nesting too deep to parse."""
    length = request.headers.get("content-length")
    if (
        length is not None
        and length.isascii()
        and length.isdigit()
        and int(length) > MAX_BODY_BYTES
    ):
        raise _too_large(int(length))
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise _too_large(len(raw))
    try:
        return json.loads(bytes(raw), parse_constant=_non_finite, parse_float=_finite_float)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise bad_request("the body is nested too deeply", "invalid_json") from None


def _too_large(size: int) -> ApiError:
    return ApiError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"the body has {size:,} bytes or more; the limit is {MAX_BODY_BYTES:,}",
        kind="invalid_request_error",
        code="body_too_large",
    )


def _non_finite(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number (only finite numbers are)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double")
    return value
