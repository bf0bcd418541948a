"""The wire form of errors: a typed Python error ↔ a gRPC status with trailers.

The server turns every error a call ends with into a status code, details that name the
offending field, and two trailers, ``actorline-error-kind`` (a
:data:`stages.errors.ERROR_KINDS` key, ``unauthenticated``, ``engine_dead`` or
``unavailable``) and ``actorline-error-field``. It also sends gRPC's richer error model
(``grpc-status-details-bin``, a ``google.rpc.Status``, as Google APIs do, AIP-193), which
clients in any language decode with their gRPC library's status helpers: an ``ErrorInfo``
(reason: the kind in capitals, domain ``actorline``, metadata ``field``), a ``BadRequest``
naming the field of an invalid argument, and a ``RetryInfo`` when a rate limit knows how long
to wait. The client turns all this back into the same Python error types, ``retry_after``
included. Mapping:

=====================================  ======================  ================
error                                  status                  kind
=====================================  ======================  ================
AuthenticationError                    UNAUTHENTICATED         unauthenticated
PermissionDeniedError                  PERMISSION_DENIED       permission_denied
InvalidRequestError                    INVALID_ARGUMENT        invalid
PromptTooLongError                     INVALID_ARGUMENT        prompt_too_long
RateLimitedError, OverloadedError      RESOURCE_EXHAUSTED      rate_limited, overloaded
EngineDeadError                        UNAVAILABLE             engine_dead
ServiceUnavailableError, other
PipelineError (shutting down)          UNAVAILABLE             unavailable
RequestError, anything else            INTERNAL                error
=====================================  ======================  ================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from pipeline.engine.errors import EngineDeadError
from pipeline.engine.presets import ENGINE_HOST
from pipeline.runtime.errors import PipelineError
from pipeline.server.auth import AuthenticationError, PermissionDeniedError
from stages.errors import (
    ERROR_KINDS,
    InvalidRequestError,
    OverloadedError,
    RateLimitedError,
    RequestError,
)

__all__ = [
    "ERROR_FIELD_KEY",
    "ERROR_KIND_KEY",
    "ErrorStatus",
    "ServiceError",
    "ServiceUnavailableError",
    "error_from_status",
    "status_for",
]

ERROR_KIND_KEY = "actorline-error-kind"
ERROR_FIELD_KEY = "actorline-error-field"
#: the trailer of gRPC's richer error model (a serialized google.rpc.Status)
STATUS_DETAILS_KEY = "grpc-status-details-bin"
#: ``ErrorInfo.domain`` of every error the service reports
ERROR_DOMAIN = "actorline"

_ENGINE_DEAD = "engine_dead"
_UNAVAILABLE = "unavailable"
_INTERNAL = RequestError.kind


class ServiceUnavailableError(ConnectionError):
    """The service cannot take the call: it is unreachable, shutting down, or its engine is
    gone (see also :class:`~pipeline.engine.errors.EngineDeadError`)."""


class ServiceError(Exception):
    """A call failed with a status no typed error describes; ``code`` is the gRPC status
    code's name (e.g. ``"INTERNAL"``)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}" if details else code)
        self.code = code
        self.details = details


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorStatus:
    """How a call ends for an error: ``code`` and ``details`` for the status, ``kind``,
    ``field`` and ``retry_after`` for the trailers."""

    code: grpc.StatusCode
    details: str
    kind: str
    field: str | None = None
    retry_after: float | None = None

    def rich_status(self) -> status_pb2.Status:
        """The ``google.rpc.Status`` of gRPC's richer error model for this error."""
        status = status_pb2.Status(code=self.code.value[0], message=self.details)
        info = error_details_pb2.ErrorInfo(reason=self.kind.upper(), domain=ERROR_DOMAIN)
        if self.field:
            info.metadata["field"] = self.field
        status.details.add().Pack(info)
        if self.field and self.code == grpc.StatusCode.INVALID_ARGUMENT:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=self.field, description=self.details
            )
            status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        if self.retry_after is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(max(0, round(self.retry_after * 1e9)))
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return status

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        pairs: list[tuple[str, str | bytes]] = [(ERROR_KIND_KEY, self.kind)]
        if self.field:
            pairs.append((ERROR_FIELD_KEY, self.field))
        pairs.append((STATUS_DETAILS_KEY, self.rich_status().SerializeToString()))
        return tuple(pairs)


def _details(error: BaseException, field: str | None) -> str:
    message = str(error) or type(error).__name__
    # NOTE: the details name the field, also when the message itself does not start with it.
    if field and not message.startswith(field):
        return f"{field}: {message}"
    return message


def status_for(error: BaseException) -> ErrorStatus:
    """The status a call ends with for ``error`` (see the module docstring)."""
    if isinstance(error, AuthenticationError):
        return ErrorStatus(grpc.StatusCode.UNAUTHENTICATED, str(error), error.kind)
    if isinstance(error, PermissionDeniedError):
        return ErrorStatus(grpc.StatusCode.PERMISSION_DENIED, str(error), error.kind, error.field)
    if isinstance(error, InvalidRequestError):
        return ErrorStatus(
            grpc.StatusCode.INVALID_ARGUMENT, _details(error, error.field), error.kind, error.field
        )
    if isinstance(error, (RateLimitedError, OverloadedError)):
        return ErrorStatus(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            str(error),
            error.kind,
            retry_after=error.retry_after,
        )
    if isinstance(error, EngineDeadError):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, str(error), _ENGINE_DEAD)
    if isinstance(error, (ServiceUnavailableError, PipelineError)):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, str(error), _UNAVAILABLE)
    if isinstance(error, RequestError):
        return ErrorStatus(grpc.StatusCode.INTERNAL, _details(error, error.field), error.kind)
    return ErrorStatus(grpc.StatusCode.INTERNAL, "internal server error", _INTERNAL)


def _metadata_value(
    metadata: Iterable[tuple[str, str | bytes]] | None, key: str
) -> str | bytes | None:
    for name, value in metadata or ():
        if name == key:
            return value
    return None


def _trailer(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    value = _metadata_value(metadata, key)
    return value.decode() if isinstance(value, bytes) else value


def _retry_after(metadata: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """The ``RetryInfo`` delay in the rich status among ``metadata`` (None: none)."""
    value = _metadata_value(metadata, STATUS_DETAILS_KEY)
    if not isinstance(value, bytes):
        return None
    try:
        status = status_pb2.Status.FromString(value)
    except DecodeError:  # a peer's garbage: no delay, the status code still counts
        return None
    for detail in status.details:
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(retry):
            return retry.retry_delay.ToNanoseconds() / 1e9
    return None


def error_from_status(
    code: grpc.StatusCode,
    details: str,
    trailing_metadata: Iterable[tuple[str, str | bytes]] | None = None,
) -> Exception:
    """The Python error for a call that ended with ``code``: the typed error the server
    raised when the trailers name it, otherwise the closest one for the code.

    Returns:
        AuthenticationError, PermissionDeniedError, InvalidRequestError (``field`` set),
        PromptTooLongError,
        RateLimitedError, OverloadedError, EngineDeadError, ServiceUnavailableError,
        TimeoutError (DEADLINE_EXCEEDED), RequestError, or ServiceError for any other code.
    """
    kind = _trailer(trailing_metadata, ERROR_KIND_KEY)
    field = _trailer(trailing_metadata, ERROR_FIELD_KEY)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(details)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDeniedError(details, field=field)
    if code == grpc.StatusCode.UNAVAILABLE:
        if kind == _ENGINE_DEAD:
            dead = EngineDeadError(ENGINE_HOST, None)
            dead.args = (details,)  # the server's own account (which signal, exit code)
            return dead
        return ServiceUnavailableError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(details)
    retry_after = _retry_after(trailing_metadata)
    if kind in ERROR_KINDS and code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
    ):
        return ERROR_KINDS[kind](details, field=field, retry_after=retry_after)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details, field=field)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimitedError(details, retry_after=retry_after)
    return ServiceError(code.name, details)
