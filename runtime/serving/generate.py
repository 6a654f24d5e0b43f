"""Text generation on the reference runtime: one inference thread, batches of waiting requests.

Threads: any thread calls :meth:`Batcher.submit`, which tokenizes the prompts, puts a
:class:`Generation` in a bounded queue and returns it; the caller reads its events
(:class:`Started`, :class:`TextDelta`, :class:`Finished`, :class:`Ended` or :class:`Failed`) from
``Generation.events``. The one inference thread runs :meth:`Batcher.run`: each round it admits
waiting requests (up to ``max_batch`` sequences in flight), then decodes one token for every
sequence in flight.

**One weight version per request.** Plans are committed only at request boundaries: the thread
calls :meth:`HotSwapRuntime.at_batch_boundary` when no sequence is in flight, and while a plan is
in flight (accepted, staging or staged) it admits nothing new, so the requests in flight drain
(each is bounded by its ``max_tokens`` and its deadline) and the plan is committed right after
them: a commit waits at most for the longest request in flight, however busy the server.
Every token of a request therefore comes from the version named in its :class:`Started` event,
and a streamed token is never taken back. (Restarting interrupted requests instead would have to
un-send streamed text.)

**KV cache.** Each sequence has its own :class:`KVCache`: its first forward runs the whole prompt
(prefill), every later one only the token picked last. The cache holds activations of one weight
version, and that is sound only because of the rule above: no plan is committed while a sequence
is in flight, so a cache is created and dropped within one version (``_decode_one`` asserts it).

**Determinism.** Each sequence runs its own forwards (``[1, T]`` prefill, then ``[1, 1]`` steps,
never stacked with other requests): CPU matmul results can depend on the batch shape, so a
sequence's logits must not depend on which other requests share its round. The shapes of a
sequence's forwards depend only on its own prompt. Greedy decoding (temperature 0) takes the first
maximal logit; sampling (sampling.py) uses a ``torch.Generator`` seeded from the request's
``seed``. Same prompt, same version, same options: same text.
"""

from __future__ import annotations

import collections
import queue
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
from ggufswap.runtime.serving.events import (
    Ended,
    Event,
    EventQueue,
    Failed,
    FailureKind,
    Finished,
    FinishReason,
    Generation,
    GenerationState,
    Started,
    TextDelta,
)
from ggufswap.runtime.serving.sampling import Sampling, TokenLogprob, new_generator, pick
from ggufswap.runtime.serving.streaming import first_stop, sendable_end
from ggufswap.runtime.serving.tokenizer import GgufTokenizer

__all__ = [  # the events are defined in events.py; callers may take them from here
    "Batcher",
    "BatcherOptions",
    "Ended",
    "Event",
    "EventQueue",
    "Failed",
    "FailureKind",
    "FinishReason",
    "Finished",
    "Generation",
    "GenerationState",
    "Sampling",
    "Started",
    "TextDelta",
]

log = get_logger(__name__)

# A request whose token read weights that changed outside a commit fails with this (the batch
# is dropped, as the serve loop drops one): its text so far stands, nothing after it is sent.
WEIGHTS_CHANGED: Final = (
    "the weights changed under the request (a mapped shard was written or truncated outside a "
    "commit; the runtime serves nothing from it until the agent's plan restores it): retry"
)
IDLE_WAIT_S: Final = 0.1  # an idle loop wakes on a request or a staged plan, or this often


@dataclass(frozen=True, kw_only=True)
class BatcherOptions:
    max_batch: int = 8  # sequences decoded per round
    max_queue: int = 64  # prompts waiting to start; more get QueueFull
    request_timeout_s: float = 60.0  # from submit to the last token
    shutdown_grace_s: float = 5.0  # how long requests in flight may finish after stop
    # A prompt longer than this many characters is refused before it is tokenized (None:
    # PROMPT_CHARS_PER_TOKEN per token of the model's context): tokenizing a megabyte costs
    # seconds and hundreds of megabytes, only to find it cannot fit.
    max_prompt_chars: int | None = None


PROMPT_CHARS_PER_TOKEN: Final = 8


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
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)

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

    def encode(self, text: str, *, special: bool, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text`` (thread-safe). ``special``: control-token texts are tokens
        and a BOS the text starts with is not added twice; ``add_bos``: None as the file says."""
        with self._encode_lock:
            if not special:
                return self.tokenizer.encode(text, add_bos=add_bos)
            ids = self.tokenizer.encode(text, add_bos=False, parse_special=True)
        bos = self.tokenizer.bos_id
        wanted = self.tokenizer.vocab.add_bos if add_bos is None else add_bos
        if wanted and bos is not None and ids[:1] != [bos]:
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
        self._check_lengths(prompts)
        sequences = len(prompts) * sampling.n
        if sequences > self.options.max_batch:
            raise InvalidRequest(
                f"{len(prompts)} prompts x n={sampling.n} is {sequences} sequences in one "
                f"request; this server decodes at most max_batch={self.options.max_batch} "
                "sequences at once",
                "too_many_prompts",
            )
        n_vocab = self.tokenizer.n_vocab
        if any(not 0 <= token < n_vocab for token, _ in sampling.logit_bias):
            raise InvalidRequest(
                f"logit_bias names a token id outside the vocabulary (0..{n_vocab - 1})",
                "invalid_logit_bias",
            )
        encoded = tuple(tuple(self.encode(p, special=special)) for p in prompts)
        problems = []
        for i, ids in enumerate(encoded):
            if not ids:
                problems.append(f"prompt {i} is empty and the tokenizer adds no BOS token")
            elif len(ids) + (sampling.max_tokens or 1) > self.context_length:
                problems.append(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={sampling.max_tokens} "
                    f"that exceeds the model's context of {self.context_length} tokens"
                )
        if problems:
            raise InvalidRequest("; ".join(problems), "context_length_exceeded")
        generation = Generation(
            encoded, sampling, deadline=time.monotonic() + self.options.request_timeout_s
        )
        with self._lock:  # every sequence counts against the queue, not every request
            if self._queued_prompts + sequences > self.options.max_queue:
                self._counts["rejected_queue_full"] += 1
                raise QueueFull(
                    f"{self._queued_prompts} prompts are already waiting (max_queue="
                    f"{self.options.max_queue}); retry later"
                )
            self._queued_prompts += sequences
            self._queue.put_nowait(generation)  # never full: each request holds a prompt
        self._arrived.set()
        return generation

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt, in characters, that is tokenized at all."""
        chars = self.options.max_prompt_chars
        return chars if chars is not None else self.context_length * PROMPT_CHARS_PER_TOKEN

    def _check_lengths(self, prompts: Sequence[str]) -> None:
        """Refuse, before tokenizing, a prompt longer than :attr:`max_prompt_chars`."""
        cap = self.max_prompt_chars
        long = [(i, len(p)) for i, p in enumerate(prompts) if len(p) > cap]
        if long:
            raise InvalidRequest(
                "; ".join(
                    f"prompt {i} has {n:,} characters; at most {cap:,} are taken "
                    f"({PROMPT_CHARS_PER_TOKEN} per token of the model's context of "
                    f"{self.context_length}), and it could not fit"
                    for i, n in long
                ),
                "prompt_too_long",
            )

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
        # While a plan is in flight (queued, staging or staged) no request starts: the ones
        # running finish, the plan commits right after them, and staging does not compete with
        # new work for the CPU. A commit waits at most for the longest request in flight.
        if not self._closed.is_set() and self.runtime.plans_in_flight == 0:
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
            if generation.sequences > room and not generation.cancelled:
                return  # the request waits, whole, for room in the batch
            self._held = None
            with self._lock:
                self._queued_prompts -= generation.sequences
            if generation.cancelled:
                self._count("cancelled")
                continue
            if time.monotonic() > generation.deadline:
                self._fail(generation, "timed out waiting in the queue", FailureKind.TIMEOUT)
                continue
            generation.state = GenerationState.RUNNING
            generation.weight_version = version
            generation.events.put(Started(version))
            self._remaining[generation] = generation.sequences
            n = generation.sampling.n
            for index in range(generation.sequences):  # prompt i's choices: i * n ... i * n + n-1
                ids = generation.prompts[index // n]
                self._active.append(
                    _Sequence(
                        owner=generation,
                        index=index,
                        ids=list(ids),
                        n_prompt=len(ids),
                        generator=new_generator(generation.sampling, index),
                        cache=self.model.new_cache(max_len=self._limit(generation, ids) + len(ids)),
                    )
                )

    def _limit(self, generation: Generation, prompt: Sequence[int]) -> int:
        """The most tokens a sequence of ``generation`` generates after ``prompt``."""
        return generation.sampling.max_tokens or self.context_length - len(prompt)

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
                intact = self._decode_one(seq)
            except Exception as exc:  # a model or tokenizer failure ends this request only
                log.exception("serve.generation_failed", weight_version=owner.weight_version)
                self._fail(owner, f"generation failed: {exc!r}")
                continue
            if not intact:  # nothing computed from bytes that changed outside a commit is sent
                log.error("serve.weights_changed", weight_version=owner.weight_version)
                self._fail(owner, WEIGHTS_CHANGED)
        self._active = [s for s in self._active if not s.finished]

    def _decode_one(self, seq: _Sequence) -> bool:
        """Decode and send one token of ``seq``; False, with nothing sent, when the weights it
        read may have changed under it (``HotSwapRuntime.batch_intact``: a mapped shard written
        or truncated outside a commit)."""
        sampling, cache = seq.owner.sampling, seq.cache
        assert seq.owner.weight_version == self.runtime.weight_version, (
            f"a plan was committed while a request was in flight (version "
            f"{seq.owner.weight_version} -> {self.runtime.weight_version}): its KV cache is stale"
        )
        new = torch.tensor([seq.ids[cache.length :]], dtype=torch.long)  # [1, T]: prompt, then 1
        with torch.inference_mode():
            logits = self.model(new, start_pos=cache.length, cache=cache, last_only=True)[0, -1]
        if not self.runtime.batch_intact():
            return False
        next_id, logprob = pick(
            logits,
            sampling,
            seq.generator,
            prompt=seq.ids[: seq.n_prompt],
            completion=seq.completion,
        )
        if logprob is not None:
            seq.unsent_logprobs.append(logprob)
        eos = next_id == self.tokenizer.eos_id
        if not eos:
            seq.ids.append(next_id)
        text = self.tokenizer.decode(seq.completion)
        cut = first_stop(text, sampling.stop, since=seq.sent)
        if cut is not None:
            self._finish(seq, text[:cut], FinishReason.STOP)
        elif eos:
            self._finish(seq, text, FinishReason.STOP)
        elif len(seq.completion) >= self._limit(seq.owner, seq.ids[: seq.n_prompt]):
            self._finish(seq, text, FinishReason.LENGTH)
        else:
            end = sendable_end(self.tokenizer, seq.completion, text, sampling.stop, sent=seq.sent)
            self._send(seq, text[:end])
        return True

    def _send(self, seq: _Sequence, text: str) -> None:
        if len(text) > seq.sent:
            logprobs = tuple(seq.unsent_logprobs)
            seq.unsent_logprobs.clear()
            seq.owner.events.put(TextDelta(seq.index, text[seq.sent :], logprobs))
            seq.sent = len(text)

    def _finish(self, seq: _Sequence, text: str, reason: FinishReason) -> None:
        self._send(seq, text)
        seq.finished = True
        owner = seq.owner
        n = len(seq.completion)
        self._completion_tokens[owner] += n
        owner.events.put(Finished(seq.index, reason, n, tuple(seq.unsent_logprobs)))
        seq.unsent_logprobs.clear()
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

    def warm_up(self) -> None:
        """One short prefill and decode step on the inference thread, nothing sent: the first
        client does not pay for first-call allocations and kernel set-up."""
        ids = self.encode("Hello", special=False) or [0]
        cache = self.model.new_cache(max_len=len(ids) + 1)
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids]), cache=cache, last_only=True)[0, -1]
            self.model(
                torch.tensor([[int(torch.argmax(logits))]]), start_pos=cache.length, cache=cache
            )

    def close(self) -> None:
        """Refuse new requests from now on (the loop finishes the rest when stopped)."""
        self._closed.set()
