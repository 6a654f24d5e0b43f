"""What a generation request is and what it reports: the :class:`Generation` a caller holds and
the events the inference thread puts on its queue (:class:`Started`, :class:`TextDelta`,
:class:`Finished`, :class:`Ended` or :class:`Failed`)."""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ggufswap.runtime.serving.sampling import Sampling, TokenLogprob


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached


class GenerationState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


# -- events, read by the submitting thread -----------------------------------------------------


@dataclass(frozen=True)
class Started:
    weight_version: int


@dataclass(frozen=True)
class TextDelta:
    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens decoded since the last delta


@dataclass(frozen=True)
class Finished:
    index: int
    reason: FinishReason
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens not yet carried by a delta


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


class EventQueue(queue.Queue[Event]):
    """A generation's events; ``waker()``, when set, is called after each put (an event loop's
    ``call_soon_threadsafe``, so an async reader never blocks a thread waiting)."""

    waker: Callable[[], None] | None = None

    def put(self, item: Event, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        waker = self.waker
        if waker is not None:
            waker()


@dataclass(eq=False)
class Generation:
    """One request: its prompts' token ids, options and the queue its events arrive on."""

    prompts: tuple[tuple[int, ...], ...]
    sampling: Sampling
    deadline: float  # time.monotonic() after which the request fails
    events: EventQueue = field(default_factory=EventQueue)
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

    @property
    def sequences(self) -> int:
        """Sequences decoded for it: ``n`` per prompt."""
        return len(self.prompts) * self.sampling.n
