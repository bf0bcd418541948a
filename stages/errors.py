"""Typed errors that a request can end with, and their wire form.

A rejected request is answered with a :class:`~stages.messages.RequestRejected` message whose
``kind`` maps back to one of these classes on the caller's side (:func:`error_from_rejection`).
"""

from __future__ import annotations

__all__ = [
    "ENGINE_DEAD",
    "ERROR_KINDS",
    "InvalidRequestError",
    "OverloadedError",
    "PromptTooLongError",
    "RateLimitedError",
    "RequestError",
    "RequestFailedError",
    "error_from_kind",
    "error_kind",
]


class RequestError(Exception):
    """A request was refused or failed; ``field`` names the offending input, if any;
    ``retry_after``: seconds after which the same request may be accepted, when known (a
    rate limit knows when its bucket will hold enough)."""

    kind = "error"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.request_id = request_id
        self.retry_after = retry_after


class InvalidRequestError(RequestError, ValueError):
    """A parameter or the prompt is invalid; ``field`` names it."""

    kind = "invalid"


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit the model's length."""

    kind = "prompt_too_long"


class RateLimitedError(RequestError):
    """The tenant is over its requests/s or tokens/s limit; retry later."""

    kind = "rate_limited"


class OverloadedError(RequestError):
    """Too many requests are queued; retry later."""

    kind = "overloaded"


class RequestFailedError(RequestError):
    """A stage failed on this request's message (a bug, or a value it could not handle): the
    request ended, everyone else's go on (docs/architecture.md, "Failure: one request or the
    pipeline"). Retrying the same request fails the same way."""

    kind = "failed"


#: the ``kind`` of a :class:`~stages.messages.RequestRejected` that ends a request because the
#: engine replica holding it died (data parallelism: the other replicas go on). It is no
#: RequestError: the API raises ``pipeline.engine.errors.EngineDeadError`` for it.
ENGINE_DEAD = "engine_dead"

ERROR_KINDS: dict[str, type[RequestError]] = {
    cls.kind: cls
    for cls in (
        RequestError,
        InvalidRequestError,
        PromptTooLongError,
        RateLimitedError,
        OverloadedError,
        RequestFailedError,
    )
}


def error_kind(error: RequestError) -> str:
    return type(error).kind


def error_from_kind(
    kind: str,
    message: str,
    *,
    field: str | None = None,
    request_id: str | None = None,
    retry_after: float | None = None,
) -> RequestError:
    """Rebuild the typed error for a wire ``kind`` (unknown kinds give RequestError)."""
    cls = ERROR_KINDS.get(kind, RequestError)
    return cls(message, field=field, request_id=request_id, retry_after=retry_after)
