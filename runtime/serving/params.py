"""The OpenAI request bodies of ``/v1/completions`` and ``/v1/chat/completions``, validated.

Every parameter OpenAI, llama-server and vLLM clients commonly send is read: sampling
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``frequency_penalty``, ``presence_penalty``,
``repetition_penalty``, ``logit_bias``, ``seed``), ``stop``, ``n``, ``logprobs`` (an integer on
completions; ``logprobs: true`` with ``top_logprobs`` on chat), ``stream`` and
``stream_options.include_usage``, the chat ``chat_template`` override, and this server's
``min_weight_version``. Any other key is refused (400 ``unknown_parameter`` naming the closest
known one) rather than silently ignored; every problem of a body is listed in one message.
Nothing here touches the model: the batcher tokenizes, the chat module renders.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

from ggufswap.runtime.serving.errors import ApiError, InvalidRequest, bad_request
from ggufswap.runtime.serving.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, Sampling

MAX_STOP_STRINGS: Final = 4  # as OpenAI's API
DEFAULT_MAX_TOKENS: Final = 16  # as OpenAI's completions API; chat: to the end of the context
DEFAULT_TEMPERATURE: Final = 1.0  # as OpenAI's API; 0 is greedy
MAX_COMPLETION_LOGPROBS: Final = 5  # as OpenAI's completions API
ROLES: Final = ("system", "developer", "user", "assistant")

COMMON_KEYS: Final = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "user",  # accepted and ignored, as by llama-server and vLLM
        "min_weight_version",
    }
)
COMPLETION_KEYS: Final = COMMON_KEYS | {"prompt", "best_of", "echo", "logprobs"}
CHAT_KEYS: Final = COMMON_KEYS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "chat_template",
}


@dataclass(frozen=True)
class CompletionRequest:
    """A validated request: what to generate, how, and how to answer."""

    prompts: tuple[str, ...]  # chat: empty until the messages are rendered
    sampling: Sampling
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    chat: bool
    min_weight_version: int | None = None
    messages: tuple[Mapping[str, str], ...] = ()
    chat_template: str | None = None  # a per-request override of the model's template


def refuse_unknown(body: Mapping[str, Any], known: frozenset[str], route: str) -> None:
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
            param=str(key),
        )


def parse_completion(body: object, *, model_name: str) -> CompletionRequest:
    """Validate a ``/v1/completions`` body; raise :class:`ApiError` listing every problem."""
    body = _object(body)
    refuse_unknown(body, COMPLETION_KEYS, "/v1/completions")
    _check_model(body, model_name)
    problems: list[str] = []
    prompt = body.get("prompt")
    prompts: tuple[str, ...] = ()
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    else:
        problems.append("'prompt' must be a string or a non-empty list of strings")
    for key, default in (("best_of", 1), ("echo", False)):
        if key in body and body[key] not in (default, None):
            problems.append(f"'{key}' = {body[key]!r} is not supported by this server")
    logprobs = _optional_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, problems)
    max_tokens = _optional_int(body, "max_tokens", 1, None, problems)
    return _request(
        body,
        problems,
        prompts=prompts,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs=logprobs,
        chat=False,
    )


def parse_chat(body: object, *, model_name: str) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` body (its messages are rendered later, with a time
    and size budget); raise :class:`ApiError` listing every problem."""
    body = _object(body)
    refuse_unknown(body, CHAT_KEYS, "/v1/chat/completions")
    _check_model(body, model_name)
    messages = _messages(body.get("messages"))
    problems: list[str] = []
    max_tokens = _optional_int(body, "max_completion_tokens", 1, None, problems)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1, None, problems)
    wants_logprobs = body.get("logprobs", False)
    if wants_logprobs not in (True, False, None):
        problems.append(f"'logprobs' must be true or false, found {wants_logprobs!r}")
    top = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, problems)
    if top is not None and not wants_logprobs:
        problems.append("'top_logprobs' needs 'logprobs': true")
    template = body.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        problems.append("'chat_template' must be a non-empty string (a Jinja chat template)")
    return _request(
        body,
        problems,
        prompts=(),
        max_tokens=max_tokens,
        logprobs=(top or 0) if wants_logprobs else None,
        chat=True,
        messages=messages,
        chat_template=template if isinstance(template, str) else None,
    )


def _request(
    body: Mapping[str, Any],
    problems: list[str],
    *,
    prompts: tuple[str, ...],
    max_tokens: int | None,
    logprobs: int | None,
    chat: bool,
    messages: tuple[Mapping[str, str], ...] = (),
    chat_template: str | None = None,
) -> CompletionRequest:
    """The parameters both routes share, then the request (or one 400 naming every problem)."""
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, problems)
    values = {
        "top_p": _number(body, "top_p", 1.0, problems),
        "min_p": _number(body, "min_p", 0.0, problems),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, problems),
        "presence_penalty": _number(body, "presence_penalty", 0.0, problems),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, problems),
    }
    top_k = _optional_int(body, "top_k", -1, None, problems)
    seed = _optional_int(body, "seed", None, None, problems)
    n = _optional_int(body, "n", 1, None, problems)
    version = _optional_int(body, "min_weight_version", 0, None, problems)
    stops = _stops(body.get("stop"), problems)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        problems.append(f"'stream' must be true or false, found {stream!r}")
    include_usage = _include_usage(body.get("stream_options"), problems)
    bias = _logit_bias(body.get("logit_bias"), problems)
    if problems:
        raise bad_request("; ".join(problems))
    try:
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop=stops,
            top_k=max(0, top_k or 0),  # -1 (llama-server) and 0: off
            logit_bias=bias,
            logprobs=logprobs,
            n=1 if n is None else n,
            **values,
        )
    except InvalidRequest as exc:
        raise bad_request(str(exc)) from None
    return CompletionRequest(
        prompts=prompts,
        sampling=sampling,
        stream=bool(stream),
        include_usage=include_usage,
        chat=chat,
        min_weight_version=version,
        messages=messages,
        chat_template=chat_template,
    )


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, found {type(body).__name__}")
    return body


def _check_model(body: Mapping[str, Any], model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            HTTPStatus.NOT_FOUND,
            f"model {model!r} is not served here; this server serves {model_name!r}",
            kind="invalid_request_error",
            code="model_not_found",
            param="model",
        )


def _messages(messages: object) -> tuple[Mapping[str, str], ...]:
    """``messages`` as ``{"role", "content"}`` maps; text content parts are joined."""
    problem = bad_request(
        '\'messages\' must be a non-empty list of {"role", "content"} objects, role one of '
        f"{', '.join(ROLES)} and content a string or a list of text parts",
        param="messages",
    )
    if not isinstance(messages, list) or not messages:
        raise problem
    out = []
    for m in messages:
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not set(m)
            <= {
                "role",
                "content",
                "name",
            }
        ):
            raise problem
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": "..."}] (OpenAI's parts)
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise problem
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise problem
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def _number(body: Mapping[str, Any], key: str, default: float, problems: list[str]) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if not _is_number(value) or not math.isfinite(value):
        problems.append(f"'{key}' must be a finite number, found {value!r}")
        return default
    return float(value)


def _optional_int(
    body: Mapping[str, Any], key: str, low: int | None, high: int | None, problems: list[str]
) -> int | None:
    """``body[key]`` as an integer within ``[low, high]`` (None: no bound), or None if absent."""
    value = body.get(key)
    if value is None:
        return None
    if (
        not _is_int(value)
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        bounds = (
            f" between {low} and {high}"
            if low is not None and high is not None
            else f" >= {low}"
            if low is not None
            else ""
        )
        problems.append(f"'{key}' must be an integer{bounds}, found {value!r}")
        return None
    return int(value)


def _stops(stop: object, problems: list[str]) -> tuple[str, ...]:
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        problems.append(f"'stop' must be a string or a list of strings, found {stop!r}")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        problems.append(f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings")
        return ()
    return stops


def _include_usage(options: object, problems: list[str]) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or not set(options) <= {"include_usage"}:
        problems.append(
            f"'stream_options' must be an object with 'include_usage' only, found {options!r}"
        )
        return False
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        problems.append(f"'stream_options.include_usage' must be true or false, found {include!r}")
        return False
    return include


def _logit_bias(bias: object, problems: list[str]) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` as sorted pairs (ids checked against the vocabulary later)."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        problems.append(f"'logit_bias' must map token ids to numbers, found {bias!r}")
        return ()
    pairs = []
    for key, value in bias.items():
        text = str(key)
        if not text.isdigit() or not _is_number(value) or not math.isfinite(value):
            problems.append(
                f"'logit_bias' maps token ids (digits) to numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], found {key!r}: {value!r}"
            )
            return ()
        pairs.append((int(text), float(value)))
    return tuple(sorted(pairs))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
