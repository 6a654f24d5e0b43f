"""Errors raised by the reference server: every one is a :class:`ServingError`."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from ggufswap.runtime.errors import RuntimeLibraryError


class ServingError(RuntimeLibraryError):
    """Base class of every error the serving package raises."""


class TokenizerError(ServingError, ValueError):
    """The GGUF's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


class EvalTextError(ServingError, ValueError):
    """An evaluation text or context that llama-perplexity's protocol cannot use (too short)."""


class GenerateError(ServingError):
    """A generation request could not be queued."""


class InvalidRequest(GenerateError, ValueError):
    """The request cannot be served as asked (too long for the context, empty prompt...);
    ``code`` is the API's error code for it."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


class QueueFull(GenerateError):
    """The bounded request queue is full: the caller should retry later."""


class Closed(GenerateError):
    """The batcher is shutting down and takes no new requests."""


class ChatTemplateError(ServingError, ValueError):
    """The chat template cannot be compiled, or rendering it failed for these messages."""


class TemplateBudgetExceeded(ChatTemplateError):
    """Compiling or rendering a chat template passed its time or size budget."""


class ListenError(ServingError, OSError):
    """The HTTP server cannot bind its address (in use, not local, no permission)."""


class ApiError(ServingError):
    """An error response: HTTP status, OpenAI error type and message."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        *,
        kind: str,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param  # the request parameter at fault, as OpenAI names it

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, code: str | None = None, *, param: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error``."""
    return ApiError(
        HTTPStatus.BAD_REQUEST, message, kind="invalid_request_error", code=code, param=param
    )


def unavailable(message: str, code: str) -> ApiError:
    """A 503 ``server_error``: retry later (queue full, loading, timed out, shutting down)."""
    return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, message, kind="server_error", code=code)
