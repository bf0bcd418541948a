"""OpenAI-style errors of the HTTP API: every error is answered as
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.

=====================================  ======  =====================  =======================
error                                  status  type                   code
=====================================  ======  =====================  =======================
body not JSON (or not UTF-8, too deep) 400     invalid_request_error  invalid_json
invalid body or parameter              400     invalid_request_error  invalid_value, ...
PromptTooLongError                     400     invalid_request_error  context_length_exceeded
AuthenticationError (no or bad key)    401     invalid_request_error  invalid_api_key
PermissionDeniedError (key may not)    403     invalid_request_error  permission_denied
unknown model                          404     invalid_request_error  model_not_found
unknown path                           404     invalid_request_error  not_found
method the path does not serve         405     invalid_request_error  method_not_allowed
body over the cap                      413     invalid_request_error  request_too_large
RateLimitedError                       429     rate_limit_error       rate_limit_exceeded
OverloadedError                        503     server_error           overloaded
the engine died or is shutting down    503     server_error           engine_unavailable
anything else                          500     server_error           null
=====================================  ======  =====================  =======================

``param`` names the offending field where one is to blame. A 429 carries ``Retry-After``
(whole seconds; the openai client waits that long before it retries).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pipeline.runtime.errors import PipelineError
from pipeline.server.auth import AuthenticationError, PermissionDeniedError
from pipeline.server.http.schema import describe_problem
from stages.errors import (
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RateLimitedError,
)

__all__ = [
    "INVALID_REQUEST",
    "SERVER_ERROR",
    "ApiError",
    "add_error_handlers",
    "error_body",
]

logger = logging.getLogger("actorline.server.http")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
#: the body field of an engine request's field, where their names differ
_BODY_PARAMS = {"prompt_token_ids": "prompt"}
#: the ``code`` of the framework's own HTTP errors (an unknown path, a wrong method)
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``. A lone surrogate in the message
    or param (a hostile body's key or value, named in the refusal) has no UTF-8 form, so no
    answer could carry it: it is written as its escape, ``\\ud800``."""
    return {
        "error": {
            "message": _utf8(message),
            "type": error_type,
            "param": None if param is None else _utf8(param),
            "code": code,
        }
    }


def _utf8(text: str) -> str:
    """``text`` with each character that has no UTF-8 form (a lone surrogate) escaped."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class ApiError(HTTPException):
    """An error answered as OpenAI-style JSON with HTTP ``status``.

    NOTE: an HTTPException, so that one raised while FastAPI reads a body (the body cap)
    reaches the handler as it is rather than as FastAPI's generic 400.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, dict(headers) if headers is not None else None)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        """The JSON body of the answer."""
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_error(cls, error: BaseException) -> ApiError:
        """The answer to an error of the engine API or of authentication (an ApiError is
        its own answer)."""
        if isinstance(error, ApiError):
            return error
        if isinstance(error, AuthenticationError):
            return cls(401, str(error), code="invalid_api_key")
        if isinstance(error, PermissionDeniedError):
            return cls(403, str(error), param=_param(error.field), code="permission_denied")
        if isinstance(error, PromptTooLongError):
            return cls(400, str(error), param=_param(error.field), code="context_length_exceeded")
        if isinstance(error, InvalidRequestError):
            return cls(400, str(error), param=_param(error.field), code="invalid_value")
        if isinstance(error, RateLimitedError):
            seconds = max(1, math.ceil(error.retry_after or 1))
            return cls(
                429,
                str(error),
                error_type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(seconds)},
            )
        if isinstance(error, OverloadedError):
            return cls(503, str(error), error_type=SERVER_ERROR, code="overloaded")
        if isinstance(error, PipelineError):
            return cls(
                503,
                f"the engine is not available: {error}",
                error_type=SERVER_ERROR,
                code="engine_unavailable",
            )
        return cls(500, f"{type(error).__name__}: {error}", error_type=SERVER_ERROR)


def _param(field: str | None) -> str | None:
    return _BODY_PARAMS.get(field, field) if field is not None else None


def _validation_error(error: RequestValidationError) -> ApiError:
    """The 400 for a body that is not JSON or does not fit the request model: the first
    problem, naming its field (never echoing the body's values)."""
    problems = error.errors()
    first = problems[0] if problems else {"msg": "invalid request body"}
    if first.get("type") == "json_invalid":
        context = first.get("ctx")
        detail = context.get("error", "") if isinstance(context, dict) else ""
        return ApiError(400, f"the body is not valid JSON: {detail}", code="invalid_json")
    # NOTE: FastAPI's locations start with where the value was: "body"
    in_body = [
        {**problem, "loc": tuple(problem.get("loc", ()))[1:]}
        if tuple(problem.get("loc", ()))[:1] == ("body",)
        else problem
        for problem in problems
    ]
    param, message = describe_problem(in_body)
    return ApiError(400, message, param=param, code="invalid_value")


def _unparsed_body(error: HTTPException) -> ApiError | None:
    """The 400 ``invalid_json`` for a body FastAPI could not parse for a reason other than
    a JSON syntax error (those are :func:`_validation_error`'s): bytes that are not UTF-8,
    JSON nested past the parser's depth. FastAPI answers them with its generic 400 ("There
    was an error parsing the body") raised from the parser's error; None for any other
    error."""
    cause = error.__cause__
    if error.status_code != 400:
        return None
    if isinstance(cause, UnicodeDecodeError):
        detail = f"it is not UTF-8 ({cause.reason} at byte {cause.start})"
    elif isinstance(cause, RecursionError):
        detail = "its arrays and objects are nested too deeply"
    elif isinstance(cause, ValueError):
        detail = str(cause)
    else:
        return None
    return ApiError(400, f"the body is not valid JSON: {detail}", code="invalid_json")


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error OpenAI-style: API errors, invalid bodies, HTTP errors of the
    framework (unknown route, wrong method, ...), and anything unexpected (500, logged with
    its traceback)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        unparsed = _unparsed_body(error)
        if unparsed is not None:
            return unparsed.response()
        return ApiError(
            error.status_code,
            str(error.detail),
            code=_HTTP_CODES.get(error.status_code),
            headers=error.headers,
        ).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        answer = ApiError.from_error(error)
        if answer.status == 500:
            logger.error("request failed: %s", error, exc_info=error)
        return answer.response()
