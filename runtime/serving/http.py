"""The OpenAI-compatible HTTP server: uvicorn (httptools) serving the Starlette routes of
:mod:`.routes` on a thread of its own, in front of the :class:`Batcher`.

The port is bound when :class:`CompletionServer` is built, before the model is loaded: ``/health``
answers ``503 loading`` with the start's phase and progress until :meth:`CompletionServer.attach`
hands it the batcher, and every other route answers ``503 loading``. Connection limits and the
whole-request deadlines are :mod:`.http_guard`'s; keep-alive, HTTP parsing, chunked bodies and
streaming are the library's. The server binds ``127.0.0.1`` unless told otherwise: it has no
authentication.

The server's thread is supervised (``ipc/supervisor.py``, essential): an event loop that dies
(a bug in a protocol or the library) is logged and run again on the same listening socket (a new
one on the same port if it was closed), and a server that keeps dying is given up: the daemon
exits 1 for a restart. The routes' worker threads (:mod:`.routes`) are a thread pool's, which a
failing handler does not end; a status lists them as unsupervised.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import uvicorn

from ggufswap.ipc.supervisor import Supervised
from ggufswap.logs import get_logger
from ggufswap.runtime.serving.chat import ChatTemplate, RenderBudget
from ggufswap.runtime.serving.early import listen
from ggufswap.runtime.serving.errors import ChatTemplateError, ListenError
from ggufswap.runtime.serving.http_guard import ConnectionLimits, Limits, guarded_protocol
from ggufswap.runtime.serving.metrics import ServingMetrics
from ggufswap.runtime.serving.routes import Ready, Routes
from ggufswap.runtime.serving.startup import Phase, Startup
from ggufswap.runtime.serving.tokenizer import GgufTokenizer

if TYPE_CHECKING:  # this module loads without torch: the port opens before torch is imported
    from ggufswap.runtime.engine import HotSwapRuntime
    from ggufswap.runtime.models.registry import Decoder
    from ggufswap.runtime.serving.generate import Batcher, BatcherOptions

log = get_logger(__name__)

CONNECTION_HEADROOM: Final = 16  # connections over the batcher's capacity (health, models)
MIN_BACKLOG: Final = 128  # the listen backlog is the connection limit, at least this
START_TIMEOUT_S: Final = 30.0
DEFAULT_CAPACITY: Final = 8 + 64  # BatcherOptions' max_batch + max_queue
STOP_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True, kw_only=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (see CompletionServer.port)
    idle_timeout_s: float = 30.0  # a kept-alive connection idle this long is closed
    # The request line and headers must arrive within this of the connection opening (or of a
    # kept-alive request's first byte), the whole body within body_timeout_s of the headers.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Connections open at once (None: max_batch + max_queue + CONNECTION_HEADROOM), and from one
    # client address (None: half of those); past either, 503 at once.
    max_connections: int | None = None
    max_connections_per_client: int | None = None
    render_timeout_s: float = 1.0  # a chat template's render (its size budget: the prompt cap)


class CompletionServer:
    """The HTTP face of a :class:`Batcher`; serves ``503 loading`` until :meth:`attach`."""

    def __init__(
        self,
        *,
        options: HttpOptions,
        model_name: str,
        capacity: int = DEFAULT_CAPACITY,
        startup: Startup | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        """``sock``: the port already listening (:mod:`.early`), else it is bound here."""
        self.options = options
        self.model_name = model_name
        self.startup = startup or Startup(model_name)
        self.max_connections = (
            options.max_connections
            if options.max_connections is not None
            else capacity + CONNECTION_HEADROOM
        )
        per_client = options.max_connections_per_client
        self.limits = ConnectionLimits(
            Limits(
                header_timeout_s=options.header_timeout_s,
                body_timeout_s=options.body_timeout_s,
                max_connections=self.max_connections,
                max_per_client=per_client
                if per_client is not None
                else max(1, self.max_connections // 2),
            )
        )
        self.metrics = ServingMetrics()
        self.routes = Routes(model_name=model_name, startup=self.startup, metrics=self.metrics)
        self._backlog = max(MIN_BACKLOG, self.max_connections)
        if sock is None:
            sock = listen(options.host, options.port, self._backlog)
        else:  # listening already: listen() again sets this server's backlog (Linux)
            sock.listen(self._backlog)
        self._sock = sock
        # Where it listens (a restart after a crash that closed the socket listens there again).
        bound = self._sock.getsockname()
        self._host, self._port = str(bound[0]), int(bound[1])
        self._config = uvicorn.Config(
            self.routes.app,
            http=guarded_protocol(self.limits),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=max(1, round(options.idle_timeout_s)),
            timeout_graceful_shutdown=int(STOP_TIMEOUT_S / 2),
            backlog=self._backlog,
        )
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        self._server = uvicorn.Server(self._config)
        self._closing = threading.Event()  # set by close(): no run of the server after it
        self._served = False  # a run began with the current uvicorn server (the next needs one)
        self._thread = Supervised(
            "ggufswap-http",
            self._serve,
            stop=self._closing,
            context={"model": model_name, "port": self.port},
        )
        self.batcher: Batcher | None = None

    @classmethod
    def serving(
        cls,
        batcher: Batcher,
        runtime: HotSwapRuntime,
        *,
        options: HttpOptions,
        chat_template: ChatTemplate | None = None,
        chat_error: str | None = None,
    ) -> CompletionServer:
        """A server already attached to ``batcher`` (an embedder's, or a test's)."""
        server = cls(
            options=options,
            model_name=runtime.model_name,
            capacity=batcher.options.max_batch + batcher.options.max_queue,
        )
        server.attach(batcher, runtime, chat_template=chat_template, chat_error=chat_error)
        return server

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return self._host

    def _serve(self) -> None:
        """The server thread's body (supervised): uvicorn's event loop until :meth:`close`. A
        run after a crash serves a new ``uvicorn.Server`` (the dead loop's connections are gone)
        on the listening socket, opened again on the same port if the crash closed it."""
        if self._sock.fileno() == -1:
            self._sock = listen(self._host, self.port, self._backlog)
        if self._served:
            self._server = uvicorn.Server(self._config)
        self._served = True
        if self._closing.is_set():  # after the assignment: close() stops this server or none
            return
        asyncio.run(self._server.serve(sockets=[self._sock]))
        if not self._closing.is_set():
            raise ListenError(f"the HTTP server on {self.host}:{self.port} stopped by itself")

    def start(self) -> CompletionServer:
        """Serve from a thread of its own; return once it accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive():  # restarts count as alive
            if time.monotonic() > deadline:
                raise ListenError(f"the HTTP server did not start within {START_TIMEOUT_S:g} s")
            time.sleep(0.005)
        if not self._server.started:
            raise ListenError(f"the HTTP server on {self.host}:{self.port} stopped at its start")
        # debug: a start that fails before torch loads says one line only; runtime.ready and
        # status name the port
        log.debug("http.listening", host=self.host, port=self.port, model=self.model_name)
        return self

    def attach(
        self,
        batcher: Batcher,
        runtime: HotSwapRuntime,
        *,
        chat_template: ChatTemplate | None,
        chat_error: str | None = None,
    ) -> None:
        """Serve ``batcher`` from now on (``/health`` turns 200)."""
        tokenizer = batcher.tokenizer
        assert runtime.shards is not None, "open() always records the shard set"
        self.batcher = batcher
        self.routes.attach(
            Ready(
                runtime=runtime,
                batcher=batcher,
                tokenizer=tokenizer,
                chat_template=chat_template,
                chat_error=chat_error,
                meta=model_meta(runtime, batcher),
                render_budget=self.render_budget(batcher),
            )
        )
        if not self.startup.ready:
            self.startup.enter(Phase.READY)

    def render_budget(self, batcher: Batcher) -> RenderBudget:
        return RenderBudget(seconds=self.options.render_timeout_s, chars=batcher.max_prompt_chars)

    def close(self) -> None:
        """Refuse new requests, then stop serving (bounded)."""
        if self.batcher is not None:
            self.batcher.close()
        self._closing.set()
        self._server.should_exit = True
        if not self._thread.join(STOP_TIMEOUT_S):
            log.error("http.stop_timeout", timeout_s=STOP_TIMEOUT_S)
        self.routes.close()
        self._sock.close()

    def status(self) -> dict[str, Any]:
        return {
            "http": {
                "host": self.host,
                "port": self.port,
                "connections": self.limits.snapshot(),
                "startup": self.startup.snapshot() if not self.startup.ready else "ready",
            }
        }


def model_meta(runtime: HotSwapRuntime, batcher: Batcher) -> dict[str, Any]:
    """``/v1/models``' ``meta`` (llama-server's fields) and what the GGUF says of the model."""
    assert runtime.shards is not None, "open() always records the shard set"
    md = runtime.shards.metadata
    config = batcher.model.config
    slots = runtime.store.slots.values()
    return {
        "architecture": md.get("general.architecture"),
        "name": md.get("general.name"),
        "path": runtime.shards.first.path,
        "shards": len(runtime.shards.shards),
        "vocab_type": batcher.tokenizer.vocab.kind.value,
        "n_vocab": batcher.tokenizer.n_vocab,
        "n_ctx_train": config.context_length,
        "n_embd": getattr(config, "n_embd", None),
        "n_params": sum(_elements(s.ne) for s in slots),
        "size": sum(s.record.nbytes for s in slots),
        "tensors": len(runtime.store.slots),
    }


def _elements(ne: tuple[int, ...]) -> int:
    count = 1
    for n in ne:
        count *= n
    return count


def chat_template_of(
    runtime: HotSwapRuntime, tokenizer: GgufTokenizer, budget: RenderBudget
) -> tuple[ChatTemplate | None, str | None]:
    """The model's template, or None and why (no template, or one that does not compile: the
    server then serves without chat)."""
    assert runtime.shards is not None, "open() always records the shard set"
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    try:
        return ChatTemplate.from_metadata(
            runtime.shards.metadata,
            bos_token="" if bos is None else tokenizer.token(bos),
            eos_token="" if eos is None else tokenizer.token(eos),
            budget=budget,
        ), None
    except ChatTemplateError as exc:
        log.warning("http.chat_template_unusable", model=runtime.model_name, error=str(exc))
        return None, str(exc)


class HttpService:
    """Completions over HTTP for the daemon: the batcher runs on the thread that calls
    :meth:`run` (the inference thread), the HTTP server on its own thread."""

    def __init__(
        self,
        runtime: HotSwapRuntime,
        model: Decoder,
        tokenizer: GgufTokenizer,
        *,
        batcher: BatcherOptions,
        server: CompletionServer,
        warm_up: Callable[[Batcher], None] | None = None,
    ) -> None:
        from ggufswap.runtime.serving.generate import Batcher

        self.batcher = Batcher(runtime, model, tokenizer, options=batcher)
        self.server = server
        self.runtime = runtime
        self._warm_up = warm_up
        self.chat, self.chat_error = chat_template_of(
            runtime, tokenizer, server.render_budget(self.batcher)
        )

    def start(self) -> HttpService:
        """Attach to the (already listening) server: ``/health`` turns 200."""
        self.server.attach(
            self.batcher, self.runtime, chat_template=self.chat, chat_error=self.chat_error
        )
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
