"""An OpenAI-compatible subset over HTTP, on the standard library's ``ThreadingHTTPServer``.

Routes: ``POST /v1/completions`` (``stream`` as server-sent events),
``POST /v1/chat/completions`` (with the GGUF's chat template), ``GET /v1/models``,
``GET /health``. Every completion response and every streamed chunk carries the
``weight_version`` it was generated on. Errors are OpenAI-shaped
``{"error": {"message", "type", "param", "code"}}`` with 400 (bad request), 404 (unknown route or
model), 405, 408 (the body stalled), 413, 500 (the model failed) and 503 (queue full, timed out,
shutting down, too many connections).

One thread per connection (at most ``max_connections``; a connection idle for
``idle_timeout_s`` is closed) parses and validates the request and hands it to the
:class:`~ggufswap.runtime.serving.generate.Batcher`; the inference thread generates; the
connection thread writes what comes back. The server binds ``127.0.0.1`` unless told
otherwise: it has no authentication.

Size: being reworked by issue 29; split there.
"""

from __future__ import annotations

import collections
import difflib
import json
import math
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from ggufswap.logs import get_logger
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.models.registry import Decoder
from ggufswap.runtime.serving.chat import ROLES, ChatTemplate, ChatTemplateError
from ggufswap.runtime.serving.errors import ApiError, Closed, InvalidRequest, ListenError, QueueFull
from ggufswap.runtime.serving.generate import (
    Batcher,
    BatcherOptions,
    Ended,
    Event,
    Failed,
    FailureKind,
    Finished,
    Sampling,
    Started,
    TextDelta,
)
from ggufswap.runtime.serving.tokenizer import GgufTokenizer

log = get_logger(__name__)

MAX_BODY_BYTES: Final = 1 << 20
MAX_STOP_STRINGS: Final = 4  # as OpenAI's API
DEFAULT_MAX_TOKENS: Final = 16  # as OpenAI's API
DEFAULT_TEMPERATURE: Final = 1.0  # as OpenAI's API; 0 is greedy
COMPLETIONS: Final = "/v1/completions"
CHAT_COMPLETIONS: Final = "/v1/chat/completions"
WAIT_GRACE_S: Final = 1.0  # the batcher enforces the deadline; the HTTP thread waits a bit more
OBJECT_COMPLETION: Final = "text_completion"
OBJECT_CHAT: Final = "chat.completion"
# Parameters read (or refused with a reason when not at their default); any other is refused,
# so that a misspelt "max_token" is not silently ignored. "user" is accepted and ignored.
COMMON_KEYS: Final = frozenset(
    {"model", "max_tokens", "temperature", "seed", "stop", "stream", "n", "logprobs", "user"}
)
COMPLETION_KEYS: Final = COMMON_KEYS | {"prompt", "best_of", "echo"}
CHAT_KEYS: Final = COMMON_KEYS | {"messages"}


@dataclass(frozen=True, kw_only=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (see CompletionServer.port)
    # A connection that sends nothing (idle keep-alive, or a request read stalled) for this
    # long is closed.
    idle_timeout_s: float = 30.0
    # Connections served at once (one thread each); further ones are answered 503 at once.
    # None: max_batch + max_queue + CONNECTION_HEADROOM.
    max_connections: int | None = None


CONNECTION_HEADROOM: Final = 16  # connections over the batcher's capacity (health, models)
MIN_BACKLOG: Final = 128  # the listen backlog is the connection limit, at least this


def bad_request(message: str, code: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, kind="invalid_request_error", code=code)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, message, kind="server_error", code=code)


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str, ...]
    sampling: Sampling
    stream: bool
    batched: bool  # prompt was a list (the response has one choice per prompt either way)


def refuse_unknown(body: dict[str, Any], known: frozenset[str], route: str) -> None:
    """A 400 naming the first parameter ``route`` does not know (with the closest known one)."""
    for key in body:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            f"unknown or unsupported parameter '{key}' for {route}{hint} "
            f"(accepted: {', '.join(sorted(known))})",
            kind="invalid_request_error",
            code="unknown_parameter",
            param=key,
        )


def parse_completion(
    body: object, *, model_name: str, known: frozenset[str] = COMPLETION_KEYS
) -> CompletionRequest:
    """Validate a ``/v1/completions`` body; raise :class:`ApiError` listing every problem.

    Size: being reworked by issue 29; split there.
    """
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, found {type(body).__name__}")
    refuse_unknown(body, known, "/v1/completions" if "prompt" in known else "/v1/chat/completions")
    problems: list[str] = []
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            HTTPStatus.NOT_FOUND,
            f"model {model!r} is not served here; this server serves {model_name!r}",
            kind="invalid_request_error",
            code="model_not_found",
        )
    prompt = body.get("prompt")
    prompts: tuple[str, ...] = ()
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    else:
        problems.append("'prompt' must be a string or a non-empty list of strings")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        problems.append(f"'max_tokens' must be an integer >= 1, found {max_tokens!r}")
    temperature = body.get("temperature", DEFAULT_TEMPERATURE)
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        problems.append(f"'temperature' must be a finite number >= 0, found {temperature!r}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        problems.append(f"'seed' must be an integer, found {seed!r}")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        problems.append(f"'stop' must be a string or a list of strings, found {stop!r}")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        problems.append(f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        problems.append(f"'stream' must be true or false, found {stream!r}")
    for key, default in (("n", 1), ("best_of", 1), ("echo", False), ("logprobs", None)):
        if key in body and body[key] not in (default, None):
            problems.append(f"'{key}' = {body[key]!r} is not supported by this server")
    if problems:
        raise bad_request("; ".join(problems))
    sampling = Sampling(
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        seed=None if seed is None else int(seed),
        stop=stops,
    )
    return CompletionRequest(prompts, sampling, bool(stream), isinstance(prompt, list))


def parse_chat(body: object, *, model_name: str, template: ChatTemplate) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` body and render its messages with the model's
    template into one prompt; raise :class:`ApiError` saying what is wrong."""
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, found {type(body).__name__}")
    refuse_unknown(body, CHAT_KEYS, "/v1/chat/completions")
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and set(m) == {"role", "content"}
            and m["role"] in ROLES
            and isinstance(m["content"], str)
            for m in messages
        )
    ):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            '\'messages\' must be a non-empty list of {"role", "content"} objects, role one of '
            f"{', '.join(ROLES)} and content a string",
            kind="invalid_request_error",
            param="messages",
        )
    if body.get("stream"):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            "'stream' is not supported on /v1/chat/completions by this server; "
            "use /v1/completions to stream",
            kind="invalid_request_error",
            code="unsupported_parameter",
            param="stream",
        )
    try:
        prompt = template.render(messages)
    except ChatTemplateError as exc:
        raise ApiError(
            HTTPStatus.BAD_REQUEST, str(exc), kind="invalid_request_error", param="messages"
        ) from None
    rest = {k: v for k, v in body.items() if k != "messages"}
    return parse_completion(
        {**rest, "prompt": prompt}, model_name=model_name, known=CHAT_KEYS | {"prompt"}
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class CompletionServer:
    """The HTTP face of a :class:`Batcher`; ``start()`` binds and serves on a thread."""

    def __init__(
        self,
        batcher: Batcher,
        runtime: HotSwapRuntime,
        *,
        options: HttpOptions,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.batcher = batcher
        self.chat_template = chat_template
        self.runtime = runtime
        self.model_name = runtime.model_name
        self.options = options
        self.created = int(time.time())
        self._responses = collections.Counter[int]()
        self._lock = threading.Lock()
        limits = batcher.options
        self.max_connections = (
            options.max_connections
            if options.max_connections is not None
            else limits.max_batch + limits.max_queue + CONNECTION_HEADROOM
        )
        self._httpd = _Server((options.host, options.port), _Handler, bind_and_activate=False)
        self._httpd.app = self
        self._httpd.slots = threading.BoundedSemaphore(self.max_connections)
        # A backlog sized for the connection limit: a burst of connections waits to be
        # accepted (and answered, 503 past the limit) instead of being reset by the kernel.
        self._httpd.request_queue_size = max(MIN_BACKLOG, self.max_connections)
        try:
            self._httpd.server_bind()
            self._httpd.server_activate()
        except OSError as exc:
            self._httpd.server_close()
            raise ListenError(f"cannot listen on {options.host}:{options.port}: {exc}") from exc
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="ggufswap-http"
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    def start(self) -> CompletionServer:
        self._thread.start()
        log.info("http.listening", host=self.host, port=self.port, model=self.model_name)
        return self

    def close(self) -> None:
        """Stop accepting connections; connection threads still writing are daemon threads."""
        self.batcher.close()
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(5.0)
        self._httpd.server_close()

    def counted(self, status: int) -> None:
        with self._lock:
            self._responses[status] += 1

    def status(self) -> dict[str, Any]:
        with self._lock:
            responses = {str(k): v for k, v in sorted(self._responses.items())}
        return {"http": {"host": self.host, "port": self.port, "responses": responses}}

    # -- bodies ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.model_name,
            "weight_version": self.runtime.weight_version,
        }

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "ggufswap",
                    "weight_version": self.runtime.weight_version,
                }
            ],
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never blocks shutdown
    block_on_close = False
    app: CompletionServer
    slots: threading.BoundedSemaphore  # one per connection being served

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own, or answer 503 at once when
        ``max_connections`` are being served."""
        if not self.slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def _refuse(self, request: socket.socket) -> None:
        error = unavailable(
            f"{self.app.max_connections} connections are being served; retry later",
            "too_many_connections",
        )
        data = json.dumps(error.body()).encode()
        head = (
            f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            request.settimeout(1.0)  # the accepting thread never waits on a slow client
            request.sendall(head + data)
        except OSError:
            pass
        self.app.counted(HTTPStatus.SERVICE_UNAVAILABLE)
        self.shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for JSON responses; streams close when done
    server: _Server
    server_version = "ggufswap"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.app.options.idle_timeout_s)  # idle and read

    # -- routing ---------------------------------------------------------------------------

    def do_GET(self) -> None:
        app = self.server.app
        routes = {"/health": app.health, "/v1/models": app.models}
        path = self.path.split("?", 1)[0]
        try:
            if path in routes:
                self._json(HTTPStatus.OK, routes[path]())
            elif path in (COMPLETIONS, CHAT_COMPLETIONS):
                raise _not_allowed("GET", path)
            else:
                raise _not_found("GET", path)
        except ApiError as exc:
            self._error(exc)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path not in (COMPLETIONS, CHAT_COMPLETIONS):
                self._discard_body()
                raise (_not_allowed if path in ("/health", "/v1/models") else _not_found)(
                    "POST", path
                )
            self._completions(chat=path == CHAT_COMPLETIONS)
        except ApiError as exc:
            self._error(exc)
        except TimeoutError:  # the body did not arrive within idle_timeout_s
            self.close_connection = True
            self._error(
                ApiError(
                    HTTPStatus.REQUEST_TIMEOUT,
                    f"the request body did not arrive within "
                    f"{self.server.app.options.idle_timeout_s} s",
                    kind="invalid_request_error",
                    code="timeout",
                )
            )
        except Exception as exc:  # a bug: answer 500 rather than drop the connection
            log.exception("http.handler_failed", path=path)
            self.close_connection = True
            self._error(
                ApiError(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    f"{type(exc).__name__}: {exc}",
                    kind="server_error",
                    code="internal",
                )
            )

    # -- completions -----------------------------------------------------------------------

    def _completions(self, *, chat: bool) -> None:
        app = self.server.app
        body = self._read_json()
        if not chat:
            request = parse_completion(body, model_name=app.model_name)
        elif app.chat_template is None:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"model {app.model_name!r} has no chat template (its GGUF has no "
                "tokenizer.chat_template), so chat messages cannot be formatted for it; send a "
                "formatted prompt to POST /v1/completions instead",
                kind="invalid_request_error",
                code="no_chat_template",
            )
        else:
            request = parse_chat(body, model_name=app.model_name, template=app.chat_template)
        max_batch = app.batcher.options.max_batch
        if len(request.prompts) > max_batch:  # each prompt is a sequence of the batch
            raise bad_request(
                f"{len(request.prompts)} prompts in one request; this server decodes at most "
                f"max_batch={max_batch} at once",
                "too_many_prompts",
            )
        try:
            generation = app.batcher.submit(list(request.prompts), request.sampling, special=chat)
        except InvalidRequest as exc:
            raise bad_request(str(exc), "context_length_exceeded") from None
        except QueueFull as exc:
            raise unavailable(str(exc), "queue_full") from None
        except Closed as exc:
            raise unavailable(str(exc), "shutting_down") from None
        reply = _Reply(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=app.model_name
        )
        if chat:
            reply = _Reply(
                id=f"chatcmpl-{uuid.uuid4().hex}",
                created=reply.created,
                model=app.model_name,
                object=OBJECT_CHAT,
            )
        try:
            if request.stream:
                self._stream(generation.events, reply, deadline=generation.deadline)
            else:
                self._complete(generation.events, reply, len(request.prompts), generation.deadline)
        except (BrokenPipeError, ConnectionResetError):
            log.info("http.client_gone", id=reply.id)
            self.close_connection = True
        finally:
            generation.cancel()  # a no-op once it ended; frees the batch slot otherwise

    def _complete(self, events: queue.Queue[Event], reply: _Reply, n: int, deadline: float) -> None:
        texts = [""] * n
        reasons: list[str | None] = [None] * n
        ended: Ended | None = None
        while ended is None:
            event = _next(events, deadline)
            if isinstance(event, TextDelta):
                texts[event.index] += event.text
            elif isinstance(event, Finished):
                reasons[event.index] = event.reason.value
            elif isinstance(event, Ended):
                ended = event
            elif isinstance(event, Failed):
                raise _failure(event)
        pairs = enumerate(zip(texts, reasons, strict=True))
        if reply.object == OBJECT_CHAT:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r}
                for i, (t, r) in pairs
            ]
        else:
            choices = [
                {"index": i, "text": t, "logprobs": None, "finish_reason": r} for i, (t, r) in pairs
            ]
        body = reply.body(choices=choices, weight_version=ended.weight_version)
        body["usage"] = {
            "prompt_tokens": ended.prompt_tokens,
            "completion_tokens": ended.completion_tokens,
            "total_tokens": ended.prompt_tokens + ended.completion_tokens,
        }
        self._json(HTTPStatus.OK, body)

    def _stream(self, events: queue.Queue[Event], reply: _Reply, *, deadline: float) -> None:
        first = _next(events, deadline)  # Started, or a failure still sent as an error status
        if isinstance(first, Failed):
            raise _failure(first)
        assert isinstance(first, Started), f"the first event is Started, found {first!r}"
        version = first.weight_version
        self.close_connection = True
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.server.app.counted(HTTPStatus.OK)
        while True:
            try:
                event = _next(events, deadline)
            except ApiError as exc:
                self._sse(exc.body())
                return
            if isinstance(event, TextDelta):
                choice = {"index": event.index, "text": event.text, "finish_reason": None}
            elif isinstance(event, Finished):
                choice = {"index": event.index, "text": "", "finish_reason": event.reason.value}
            elif isinstance(event, Failed):
                self._sse(_failure(event).body())  # no [DONE]: the stream is incomplete
                return
            else:
                break
            self._sse(reply.body(choices=[{**choice, "logprobs": None}], weight_version=version))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _sse(self, body: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()

    # -- plumbing --------------------------------------------------------------------------

    def _read_json(self) -> object:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise bad_request("a JSON body with a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}",
                kind="invalid_request_error",
            )
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw, parse_constant=_non_finite, parse_float=_finite_float)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            raise bad_request(f"the body is not valid JSON: {exc}", "invalid_json") from None
        except RecursionError:
            raise bad_request("the body is nested too deeply", "invalid_json") from None

    def _discard_body(self) -> None:
        length = self.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) <= MAX_BODY_BYTES:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.server.app.counted(status)

    def _error(self, exc: ApiError) -> None:
        log.info("http.error", status=int(exc.status), code=exc.code, message=exc.message)
        try:
            self._json(exc.status, exc.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http.request", client=self.client_address[0], line=format % args)


@dataclass(frozen=True)
class _Reply:
    id: str
    created: int
    model: str
    object: str = OBJECT_COMPLETION

    def body(self, *, choices: list[dict[str, Any]], weight_version: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "weight_version": weight_version,
        }


def _non_finite(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number (only finite numbers are)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double")
    return value


def _next(events: queue.Queue[Event], deadline: float) -> Event:
    """The next event of a generation, or a 503 once its deadline (plus grace) has passed."""
    try:
        return events.get(timeout=max(0.0, deadline - time.monotonic()) + WAIT_GRACE_S)
    except queue.Empty:
        raise unavailable("the request timed out", "timeout") from None


def _failure(event: Failed) -> ApiError:
    if event.kind is FailureKind.ERROR:
        return ApiError(
            HTTPStatus.INTERNAL_SERVER_ERROR, event.message, kind="server_error", code="failed"
        )
    return unavailable(event.message, event.kind.value)


def _not_found(method: str, path: str) -> ApiError:
    return ApiError(
        HTTPStatus.NOT_FOUND,
        f"no route {method} {path}; routes: POST /v1/completions, POST /v1/chat/completions, "
        "GET /v1/models, GET /health",
        kind="invalid_request_error",
        code="not_found",
    )


def _not_allowed(method: str, path: str) -> ApiError:
    return ApiError(
        HTTPStatus.METHOD_NOT_ALLOWED,
        f"{path} does not take {method}",
        kind="invalid_request_error",
        code="method_not_allowed",
    )


def _token_text(tokenizer: GgufTokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.token(token_id)


class HttpService:
    """Completions over HTTP for the daemon: the batcher runs on the thread that calls
    :meth:`run` (the inference thread), the HTTP server on its own threads."""

    def __init__(
        self,
        runtime: HotSwapRuntime,
        model: Decoder,
        tokenizer: GgufTokenizer,
        *,
        batcher: BatcherOptions,
        http: HttpOptions,
    ) -> None:
        self.batcher = Batcher(runtime, model, tokenizer, options=batcher)
        assert runtime.shards is not None, "open() always records the shard set"
        try:
            chat = ChatTemplate.from_metadata(
                runtime.shards.metadata,
                bos_token=_token_text(tokenizer, tokenizer.bos_id),
                eos_token=_token_text(tokenizer, tokenizer.eos_id),
            )
        except ChatTemplateError as exc:  # served without chat; the route says the template is bad
            log.warning("http.chat_template_unusable", model=runtime.model_name, error=str(exc))
            chat = None
        self.server = CompletionServer(self.batcher, runtime, options=http, chat_template=chat)

    def start(self) -> HttpService:
        self.server.start()
        return self

    def run(self, stop: threading.Event, *, on_iteration: Callable[[], None] | None = None) -> None:
        self.batcher.run(stop, on_iteration=on_iteration)

    @property
    def batches(self) -> int:
        return self.batcher.rounds

    def status(self) -> dict[str, Any]:
        return {"serve": {"mode": "http", **self.batcher.status()}, **self.server.status()}

    def close(self) -> None:
        self.server.close()
