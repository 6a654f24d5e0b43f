"""Text generation on the reference runtime: one inference thread, batches of waiting requests.

Threads: any thread calls :meth:`Batcher.submit`, which tokenizes the prompts, puts a
:class:`Generation` in a bounded queue and returns it; the caller reads its events
(:class:`Started`, :class:`TextDelta`, :class:`Finished`, :class:`Ended` or :class:`Failed`) from
``Generation.events``. The one inference thread runs :meth:`Batcher.run`: each round it admits
waiting requests (up to ``max_batch`` sequences in flight), then decodes one token for every
sequence in flight.

**One weight version per request.** Plans are committed only at request boundaries: the thread
calls :meth:`HotSwapRuntime.at_batch_boundary` when no sequence is in flight, and while a plan is
staged it admits nothing new, so the requests in flight drain (each is bounded by its
``max_tokens`` and its deadline) and the plan is committed right after them. Every token of a
request therefore comes from the version named in its :class:`Started` event, and a streamed
token is never taken back. (Restarting interrupted requests instead would have to un-send
streamed text.)

**KV cache.** Each sequence has its own :class:`KVCache`: its first forward runs the whole prompt
(prefill), every later one only the token picked last. The cache holds activations of one weight
version, and that is sound only because of the rule above: no plan is committed while a sequence
is in flight, so a cache is created and dropped within one version (``_decode_one`` asserts it).

**Determinism.** Each sequence runs its own forwards (``[1, T]`` prefill, then ``[1, 1]`` steps,
never stacked with other requests): CPU matmul results can depend on the batch shape, so a
sequence's logits must not depend on which other requests share its round. The shapes of a
sequence's forwards depend only on its own prompt. Greedy decoding (temperature 0) takes the first
maximal logit; sampling uses a ``torch.Generator`` seeded from the request's ``seed``. Same
prompt, same version, same options: same text.
"""

from __future__ import annotations

import collections
import enum
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from ggufswap import ipc
from ggufswap.logs import get_logger
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.errors import WeightsLost
from ggufswap.runtime.models.kv_cache import KVCache
from ggufswap.runtime.models.registry import Decoder
from ggufswap.runtime.serving.errors import Closed, InvalidRequest, QueueFull
from ggufswap.runtime.serving.streaming import first_stop, sendable_end
from ggufswap.runtime.serving.tokenizer import GgufTokenizer

log = get_logger(__name__)

IDLE_WAIT_S: Final = 0.1  # an idle loop wakes on a request or a staged plan, or this often


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached


class GenerationState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How to decode: ``temperature == 0`` is greedy; ``seed`` fixes the sampler."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, found {self.max_tokens}")
        if not self.temperature >= 0.0:
            problems.append(f"temperature must be >= 0, found {self.temperature}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise InvalidRequest("; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class BatcherOptions:
    max_batch: int = 8  # sequences decoded per round
    max_queue: int = 64  # prompts waiting to start; more get QueueFull
    request_timeout_s: float = 60.0  # from submit to the last token
    shutdown_grace_s: float = 5.0  # how long requests in flight may finish after stop


# -- events, read by the submitting thread -----------------------------------------------------


@dataclass(frozen=True)
class Started:
    weight_version: int


@dataclass(frozen=True)
class TextDelta:
    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    index: int
    reason: FinishReason
    completion_tokens: int


@dataclass(frozen=True)
class Ended:
    weight_version: int
    prompt_tokens: int
    completion_tokens: int


class FailureKind(str, enum.Enum):
    TIMEOUT = "timeout"  # the request's deadline passed
    SHUTDOWN = "shutdown"  # the server stopped before the request finished
    ERROR = "error"  # the model or tokenizer raised


@dataclass(frozen=True)
class Failed:
    message: str
    kind: FailureKind = FailureKind.ERROR


Event = Started | TextDelta | Finished | Ended | Failed


@dataclass(eq=False)
class Generation:
    """One request: its prompts' token ids, options and the queue its events arrive on."""

    prompts: tuple[tuple[int, ...], ...]
    sampling: Sampling
    deadline: float  # time.monotonic() after which the request fails
    events: queue.Queue[Event] = field(default_factory=queue.Queue)
    state: GenerationState = GenerationState.QUEUED
    weight_version: int | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (the client went away or gave up); safe from any thread."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(eq=False)
class _Sequence:
    """One prompt of a request being decoded."""

    owner: Generation
    index: int
    ids: list[int]
    n_prompt: int
    generator: torch.Generator | None
    cache: KVCache  # keys and values of ids[: cache.length], all from the request's version
    sent: int = 0  # characters of the completion already sent
    finished: bool = False

    @property
    def completion(self) -> list[int]:
        return self.ids[self.n_prompt :]


class Batcher:
    """Queues generation requests and decodes them on the thread that calls :meth:`run`."""

    def __init__(
        self,
        runtime: HotSwapRuntime,
        model: Decoder,
        tokenizer: GgufTokenizer,
        *,
        options: BatcherOptions,
    ) -> None:
        self.runtime = runtime
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.context_length = model.config.context_length
        self._queue: queue.Queue[Generation] = queue.Queue(maxsize=options.max_queue)
        # The tokenizer's special-token switch is shared state: one encode at a time.
        self._encode_lock = threading.Lock()
        self._arrived = threading.Event()
        self._closed = threading.Event()
        self._active: list[_Sequence] = []
        self._remaining: dict[Generation, int] = {}  # sequences of a request still decoding
        self._completion_tokens: collections.Counter[Generation] = collections.Counter()
        self._lock = threading.Lock()
        self._counts = collections.Counter[str]()
        self._queued_prompts = 0  # prompts of the requests in _queue and _held
        self._held: Generation | None = None  # taken from the queue, waits for batch room
        self.rounds = 0
        self.last_round_s: float | None = None
        runtime.on_event(self._on_runtime_event)

    def _on_runtime_event(self, event: ipc.Event) -> None:
        if isinstance(event, ipc.PlanStagedEvent):  # wake an idle loop: commit the plan right away
            self._arrived.set()

    # -- any thread ------------------------------------------------------------------------

    def _encode(self, prompt: str, *, special: bool) -> list[int]:
        with self._encode_lock:
            if not special:
                return self.tokenizer.encode(prompt)
            ids = self.tokenizer.encode(prompt, add_bos=False, parse_special=True)
        bos = self.tokenizer.bos_id
        if self.tokenizer.vocab.add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def submit(
        self, prompts: Sequence[str], sampling: Sampling, *, special: bool = False
    ) -> Generation:
        """Tokenize ``prompts`` and queue them as one request; raises :class:`InvalidRequest`,
        :class:`QueueFull` or :class:`Closed`. ``special``: the prompts come from a chat
        template, so control-token texts (``<start_of_turn>``) are tokens, and a BOS the template
        wrote is not added twice."""
        if self._closed.is_set():
            raise Closed("the server is shutting down")
        if not prompts:
            raise InvalidRequest("prompt must hold at least one string")
        encoded = tuple(tuple(self._encode(p, special=special)) for p in prompts)
        problems = []
        for i, ids in enumerate(encoded):
            if not ids:
                problems.append(f"prompt {i} is empty and the tokenizer adds no BOS token")
            elif len(ids) + sampling.max_tokens > self.context_length:
                problems.append(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={sampling.max_tokens} "
                    f"that exceeds the model's context of {self.context_length} tokens"
                )
        if len(prompts) > self.options.max_batch:
            problems.append(
                f"{len(prompts)} prompts in one request; this server decodes at most "
                f"max_batch={self.options.max_batch} sequences at once"
            )
        if problems:
            raise InvalidRequest("; ".join(problems))
        generation = Generation(
            encoded, sampling, deadline=time.monotonic() + self.options.request_timeout_s
        )
        with self._lock:  # every prompt counts against the queue, not every request
            if self._queued_prompts + len(prompts) > self.options.max_queue:
                self._counts["rejected_queue_full"] += 1
                raise QueueFull(
                    f"{self._queued_prompts} prompts are already waiting (max_queue="
                    f"{self.options.max_queue}); retry later"
                )
            self._queued_prompts += len(prompts)
            self._queue.put_nowait(generation)  # never full: each request holds a prompt
        self._arrived.set()
        return generation

    def status(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
        return {
            "rounds": self.rounds,
            "queued": self._queue.qsize() + (self._held is not None),
            "queued_prompts": self._queued_prompts,
            "in_flight": len(self._active),
            "requests": counts,
            "last_round_ms": None
            if self.last_round_s is None
            else round(self.last_round_s * 1e3, 3),
        }

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    # -- the inference thread --------------------------------------------------------------

    def run(self, stop: threading.Event, *, on_iteration: Callable[[], None] | None = None) -> None:
        """Serve until ``stop`` is set, then refuse new requests and finish those in flight
        (bounded by ``shutdown_grace_s``)."""
        while not stop.is_set():
            worked = self.step()
            if on_iteration is not None:
                on_iteration()
            if not worked:
                self._arrived.wait(IDLE_WAIT_S)
                self._arrived.clear()
        self._shutdown()

    def step(self) -> bool:
        """Commit staged plans if no sequence is in flight, admit requests, decode one round;
        return whether a round ran."""
        if not self._active:  # a request boundary: the only place plans are committed
            try:
                self.runtime.at_batch_boundary()
            except WeightsLost:  # served tensors out of service: admit nothing until restored
                return False
            except Exception:  # a commit callback failed; the commit itself stands
                log.exception("serve.commit_callback_failed")
        if not self._closed.is_set() and not self.runtime.wait_staged(0.0):
            self._admit()
        if not self._active:
            return False
        started = time.perf_counter()
        self._round()
        self.last_round_s = time.perf_counter() - started
        self.rounds += 1
        return True

    def _admit(self) -> None:
        version = self.runtime.weight_version
        while len(self._active) < self.options.max_batch:
            if self._held is None:
                try:
                    self._held = self._queue.get_nowait()
                except queue.Empty:
                    return
            generation = self._held
            room = self.options.max_batch - len(self._active)
            if len(generation.prompts) > room and not generation.cancelled:
                return  # the request waits, whole, for room in the batch
            self._held = None
            with self._lock:
                self._queued_prompts -= len(generation.prompts)
            if generation.cancelled:
                self._count("cancelled")
                continue
            if time.monotonic() > generation.deadline:
                self._fail(generation, "timed out waiting in the queue", FailureKind.TIMEOUT)
                continue
            generation.state = GenerationState.RUNNING
            generation.weight_version = version
            generation.events.put(Started(version))
            self._remaining[generation] = len(generation.prompts)
            for index, ids in enumerate(generation.prompts):
                self._active.append(
                    _Sequence(
                        owner=generation,
                        index=index,
                        ids=list(ids),
                        n_prompt=len(ids),
                        generator=_generator(generation.sampling, index),
                        cache=self.model.new_cache(
                            max_len=len(ids) + generation.sampling.max_tokens
                        ),
                    )
                )

    def _round(self) -> None:
        now = time.monotonic()
        for seq in list(self._active):
            owner = seq.owner
            if owner.state is not GenerationState.RUNNING:
                continue  # failed earlier in this round (another of its sequences)
            if owner.cancelled:
                self._drop(owner)
                self._count("cancelled")
                continue
            if now > owner.deadline:
                self._fail(owner, "timed out while generating", FailureKind.TIMEOUT)
                continue
            try:
                self._decode_one(seq)
            except Exception as exc:  # a model or tokenizer failure ends this request only
                log.exception("serve.generation_failed", weight_version=owner.weight_version)
                self._fail(owner, f"generation failed: {exc!r}")
        self._active = [s for s in self._active if not s.finished]

    def _decode_one(self, seq: _Sequence) -> None:
        sampling, cache = seq.owner.sampling, seq.cache
        assert seq.owner.weight_version == self.runtime.weight_version, (
            f"a plan was committed while a request was in flight (version "
            f"{seq.owner.weight_version} -> {self.runtime.weight_version}): its KV cache is stale"
        )
        new = torch.tensor([seq.ids[cache.length :]], dtype=torch.long)  # [1, T]: prompt, then 1
        with torch.inference_mode():
            logits = self.model(new, start_pos=cache.length, cache=cache)[0, -1]  # [V]
        next_id = _pick(logits, sampling.temperature, seq.generator)
        eos = next_id == self.tokenizer.eos_id
        if not eos:
            seq.ids.append(next_id)
        text = self.tokenizer.decode(seq.completion)
        cut = first_stop(text, sampling.stop, since=seq.sent)
        if cut is not None:
            self._finish(seq, text[:cut], FinishReason.STOP)
        elif eos:
            self._finish(seq, text, FinishReason.STOP)
        elif len(seq.completion) >= sampling.max_tokens:
            self._finish(seq, text, FinishReason.LENGTH)
        else:
            end = sendable_end(self.tokenizer, seq.completion, text, sampling.stop, sent=seq.sent)
            self._send(seq, text[:end])

    def _send(self, seq: _Sequence, text: str) -> None:
        if len(text) > seq.sent:
            seq.owner.events.put(TextDelta(seq.index, text[seq.sent :]))
            seq.sent = len(text)

    def _finish(self, seq: _Sequence, text: str, reason: FinishReason) -> None:
        self._send(seq, text)
        seq.finished = True
        owner = seq.owner
        n = len(seq.completion)
        self._completion_tokens[owner] += n
        owner.events.put(Finished(seq.index, reason, n))
        self._remaining[owner] -= 1
        if self._remaining[owner] == 0:
            assert owner.weight_version is not None, "a running request has a version"
            owner.state = GenerationState.DONE
            owner.events.put(
                Ended(owner.weight_version, owner.prompt_tokens, self._completion_tokens[owner])
            )
            self._forget(owner)
            self._count("completed")

    def _fail(
        self, generation: Generation, message: str, kind: FailureKind = FailureKind.ERROR
    ) -> None:
        generation.state = GenerationState.FAILED
        generation.events.put(Failed(message, kind))
        self._drop(generation)
        self._count(f"failed_{kind.value}")

    def _drop(self, generation: Generation) -> None:
        if generation.state is GenerationState.RUNNING:
            generation.state = GenerationState.FAILED
        for seq in self._active:
            if seq.owner is generation:
                seq.finished = True
        self._forget(generation)

    def _forget(self, generation: Generation) -> None:
        self._remaining.pop(generation, None)
        self._completion_tokens.pop(generation, None)

    def _shutdown(self) -> None:
        """Refuse new requests, fail the queued ones, give those in flight a bounded grace."""
        self._closed.set()
        if self._held is not None:
            self._fail(self._held, "the server is shutting down", FailureKind.SHUTDOWN)
            self._held = None
        while True:
            try:
                queued = self._queue.get_nowait()
                self._fail(queued, "the server is shutting down", FailureKind.SHUTDOWN)
            except queue.Empty:
                break
        deadline = time.monotonic() + self.options.shutdown_grace_s
        while self._active and time.monotonic() < deadline:
            self._round()
        for generation in {s.owner for s in self._active}:
            self._fail(generation, "the server is shutting down", FailureKind.SHUTDOWN)
        self._active = []

    def close(self) -> None:
        """Refuse new requests from now on (the loop finishes the rest when stopped)."""
        self._closed.set()


def _generator(sampling: Sampling, index: int) -> torch.Generator | None:
    if sampling.temperature == 0.0:
        return None
    generator = torch.Generator()
    seed = sampling.seed if sampling.seed is not None else random.SystemRandom().getrandbits(63)
    generator.manual_seed((seed + index) % (1 << 63))
    return generator


def greedy_continuation(
    model: Decoder, prompt: list[int], n_new: int, *, cached: bool
) -> list[int]:
    """The greedy continuation of ``prompt``: a full forward per token, or (``cached``) one
    prefill and then one-token steps through a KV cache. The reference both ways agree on."""
    ids = list(prompt)
    cache = model.new_cache(max_len=len(prompt) + n_new) if cached else None
    with torch.inference_mode():
        for _ in range(n_new):
            if cache is None:
                logits = model(torch.tensor([ids]))[0, -1]  # [V]
            else:
                new = torch.tensor([ids[cache.length :]])  # [1, T]
                logits = model(new, start_pos=cache.length, cache=cache)[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The next token: the first maximal logit when greedy, else a seeded sample."""
    # logits: [V] float32
    if temperature == 0.0 or generator is None:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
