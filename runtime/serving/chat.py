"""Chat prompts from a GGUF's own template (``tokenizer.chat_template``), as HF and llama.cpp
apply it: a Jinja template rendered in a sandbox with ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``. A model without a template gets no chat route: the server
answers with an error that says so rather than guessing a format.

A template is code from a file (or from a request's ``chat_template``), so compiling and
rendering it are bounded:

- **time**: a trace function (``sys.settrace``, on the rendering thread only, for the render
  alone) checks a deadline at every line the template's code and Jinja's runtime run, so a loop
  of any depth, with or without output, stops at ``seconds``;
- **size**: every value a call, filter or operator takes or returns, every ``namespace``
  assignment (the only state that outlives a loop iteration in the immutable sandbox) and the
  output are held under ``chars`` characters, checked *before* a repetition (``'a' * n``,
  ``s.ljust(n)``) allocates;
- **everything else**: any exception while compiling (a ``RecursionError`` from 5,000 nested
  ``if``) is a :class:`ChatTemplateError`; so is any exception while rendering (an undefined
  attribute, a division by zero, the template's own ``raise_exception``).

A budget exceeded raises :class:`TemplateBudgetExceeded` (the server answers 400).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final

import jinja2
from jinja2.runtime import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ggufswap.runtime.serving.errors import ChatTemplateError, TemplateBudgetExceeded

CHAT_TEMPLATE_KEY: Final = "tokenizer.chat_template"
_SIZED: Final = (str, bytes, list, tuple, dict)
_ACTIVE = threading.local()  # .budget: the budget of the compile or render on this thread


@dataclass(frozen=True)
class RenderBudget:
    """What one compile or render may take: wall-clock seconds and characters."""

    seconds: float = 1.0
    chars: int = 1 << 20


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class _Budget:
    """The limits of one compile or render, enforced from the trace function and the hooks."""

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds
        self.expired = False

    def trace(self, frame: FrameType, event: str, arg: object) -> Callable[..., Any] | None:
        if self.expired or time.monotonic() > self.deadline:
            self.expired = True  # raised again at every later line, should a handler swallow it
            raise TemplateBudgetExceeded(
                f"the chat template ran past its budget of {self.budget.seconds:g} s"
            )
        return self.trace

    def size(self, value: object, what: str) -> None:
        if isinstance(value, _SIZED) and len(value) > self.budget.chars:
            raise TemplateBudgetExceeded(
                f"the chat template made {what} of {len(value):,} characters or items; the "
                f"budget is {self.budget.chars:,}"
            )

    def count(self, value: object, what: str) -> None:
        """An integer that sizes an allocation (a repetition, a padding width)."""
        if isinstance(value, int) and not isinstance(value, bool) and value > self.budget.chars:
            raise TemplateBudgetExceeded(
                f"the chat template asked for {what} of {value:,}; the budget is "
                f"{self.budget.chars:,} characters"
            )

    def run(self, work: Callable[[], Any]) -> Any:
        """``work()`` under the deadline (traced on this thread only, then restored)."""
        previous = sys.gettrace()
        sys.settrace(self.trace)
        try:
            return work()
        finally:
            sys.settrace(previous)


class _Environment(ImmutableSandboxedEnvironment):
    """HF's settings (transformers' ``_compile_jinja_template``: blocks trimmed, sandboxed, loop
    controls) with every call, filter, test, repetition and power held to the current budget."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        self.globals["raise_exception"] = _raise
        self.globals["namespace"] = _BoundedNamespace
        for table in (self.filters, self.tests):
            for name, function in list(table.items()):
                table[name] = self._bounded(function)

    def _bounded(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self._check_args(args, kwargs)
            result = function(*args, **kwargs)
            self._check_result(result)
            return result

        for marker in ("jinja_pass_arg",):  # @pass_context and friends, kept on the wrapper
            if hasattr(function, marker):
                setattr(bounded, marker, getattr(function, marker))
        return bounded

    def _check_args(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        budget = _current()
        for value in (*args, *kwargs.values()):
            budget.size(value, "an argument")
            budget.count(value, "a size")

    def _check_result(self, result: object) -> None:
        _current().size(result, "a value")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        __self._check_args(args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        __self._check_result(result)
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _current()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, _SIZED) and isinstance(times, int):
                    budget.count(len(seq) * times, "a repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            budget.count(abs(left).bit_length() * right, "a power (bits)")
        result = super().call_binop(context, operator, left, right)
        budget.size(result, "a value")
        return result


class _BoundedNamespace(Namespace):
    """``namespace()`` whose attributes stay under the render's size budget."""

    def __setitem__(self, name: str, value: Any) -> None:
        _current().size(value, f"namespace attribute {name!r}")
        super().__setitem__(name, value)


def _current() -> _Budget:
    budget: _Budget | None = getattr(_ACTIVE, "budget", None)
    assert budget is not None, "templates are compiled and rendered under a budget"
    return budget


class ChatTemplate:
    """A compiled chat template with the model's BOS and EOS token texts; renders may run on
    several threads at once (each has its own budget)."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str,
        eos_token: str,
        budget: RenderBudget | None = None,
    ) -> None:
        self.source = source
        self.budget = budget or RenderBudget()
        self._env = _Environment()
        try:
            self._template = self._bounded(lambda: self._env.from_string(source))
        except TemplateBudgetExceeded as exc:
            raise ChatTemplateError(f"{CHAT_TEMPLATE_KEY} does not compile: {exc}") from None
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 (a RecursionError, a TemplateSyntaxError...)
            raise ChatTemplateError(
                f"{CHAT_TEMPLATE_KEY} does not compile: {type(exc).__name__}: {_short(exc)}"
            ) from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, Any],
        *,
        bos_token: str,
        eos_token: str,
        budget: RenderBudget | None = None,
    ) -> ChatTemplate | None:
        """The model's template, or None when its GGUF has none."""
        source = metadata.get(CHAT_TEMPLATE_KEY)
        if not isinstance(source, str) or not source.strip():
            return None
        return cls(source, bos_token=bos_token, eos_token=eos_token, budget=budget)

    def _bounded(self, work: Callable[[], Any]) -> Any:
        budget = _Budget(self.budget)
        _ACTIVE.budget = budget
        try:
            return budget.run(work)
        finally:
            _ACTIVE.budget = None

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of ``messages`` followed by the assistant's turn opening; raises
        :class:`TemplateBudgetExceeded` past the budget, :class:`ChatTemplateError` for any
        other failure."""
        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": True,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }

        def generate() -> str:
            parts: list[str] = []
            total = 0
            for chunk in self._template.generate(**context):
                total += len(chunk)
                if total > self.budget.chars:
                    raise TemplateBudgetExceeded(
                        f"the chat template's output passed its budget of "
                        f"{self.budget.chars:,} characters"
                    )
                parts.append(chunk)
            return "".join(parts)

        try:
            text: str = self._bounded(generate)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (the template's own code failed: a 400)
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(exc).__name__}: {_short(exc)}"
            ) from None
        return text


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "…"


__all__ = ["CHAT_TEMPLATE_KEY", "ChatTemplate", "ChatTemplateError", "RenderBudget"]
