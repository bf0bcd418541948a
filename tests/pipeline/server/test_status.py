"""Errors ↔ gRPC status: every typed error survives the trip from server to client."""

from __future__ import annotations

import grpc
import pytest

from pipeline.engine.errors import EngineDeadError
from pipeline.runtime.errors import PipelineClosedError
from pipeline.server.auth import AuthenticationError, PermissionDeniedError
from pipeline.server.status import (
    ERROR_FIELD_KEY,
    STATUS_DETAILS_KEY,
    ServiceError,
    ServiceUnavailableError,
    error_from_status,
    status_for,
)
from stages.errors import (
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RateLimitedError,
    RequestError,
)

ROUND_TRIPS = [
    (AuthenticationError("invalid API key"), grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError("bound to 'a1'", field="lora_name"), grpc.StatusCode.PERMISSION_DENIED),
    (
        InvalidRequestError("top_p must be in (0, 1]", field="top_p"),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (PromptTooLongError("too long", field="prompt"), grpc.StatusCode.INVALID_ARGUMENT),
    (RateLimitedError("over the limit"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RateLimitedError("retry in 0.25s", retry_after=0.25), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OverloadedError("too many queued"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDeadError("engine", -9), grpc.StatusCode.UNAVAILABLE),
    (ServiceUnavailableError("shutting down"), grpc.StatusCode.UNAVAILABLE),
    (RequestError("a stage failed for this request"), grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(
    ("error", "code"), ROUND_TRIPS, ids=[type(error).__name__ for error, _ in ROUND_TRIPS]
)
def test_typed_errors_round_trip(error: Exception, code: grpc.StatusCode) -> None:
    status = status_for(error)
    assert status.code == code
    rebuilt = error_from_status(status.code, status.details, status.trailing_metadata())
    assert type(rebuilt) is type(error)
    assert str(error) in str(rebuilt)  # the details may add the field's name
    assert getattr(rebuilt, "field", None) == getattr(error, "field", None)
    assert getattr(rebuilt, "retry_after", None) == getattr(error, "retry_after", None)


def test_the_rich_status_matches_the_call_and_garbage_in_it_is_ignored() -> None:
    status = status_for(RateLimitedError("slow down", retry_after=1.5))
    rich = status.rich_status()
    assert rich.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]  # as the call's code
    assert rich.message == status.details
    garbage = [
        (key, b"\xff\x00garbage" if key == STATUS_DETAILS_KEY else value)
        for key, value in status.trailing_metadata()
    ]
    rebuilt = error_from_status(status.code, status.details, garbage)
    assert isinstance(rebuilt, RateLimitedError) and rebuilt.retry_after is None


def test_details_always_name_the_field() -> None:
    status = status_for(InvalidRequestError("the prompt is empty", field="prompt_token_ids"))
    assert status.details == "prompt_token_ids: the prompt is empty"
    assert (ERROR_FIELD_KEY, "prompt_token_ids") in status.trailing_metadata()


def test_other_failures_do_not_leak_internals() -> None:
    assert status_for(PipelineClosedError("closed")).code == grpc.StatusCode.UNAVAILABLE
    status = status_for(KeyError("/secret/path"))
    assert status.code == grpc.StatusCode.INTERNAL and "secret" not in status.details


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, AuthenticationError),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, RateLimitedError),
        (grpc.StatusCode.UNAVAILABLE, ServiceUnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, TimeoutError),
        (grpc.StatusCode.UNIMPLEMENTED, ServiceError),
    ],
)
def test_statuses_without_trailers_map_to_the_closest_error(
    code: grpc.StatusCode, expected: type[Exception]
) -> None:
    """As from a proxy or gRPC itself, which add no actorline trailers."""
    error = error_from_status(code, "details", ())
    assert type(error) is expected
    if isinstance(error, ServiceError):
        assert error.code == code.name
