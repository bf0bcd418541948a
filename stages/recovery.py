"""How an LLM stage answers a request whose message it failed on (pure logic, no IO).

The rule (docs/architecture.md, "Failure: one request or the pipeline"): a handler that fails
on one request's message answers that request with a typed error and the stage goes on; only
a broken stage (its own invariants) fails the pipeline. The stages implement
:meth:`pipeline.runtime.stage.Stage.recover` with these helpers.
"""

from __future__ import annotations

from stages.errors import InvalidRequestError, RequestError, RequestFailedError
from stages.messages import EngineRequest, GenerateRequest, RequestRejected
from transports.errors import EncodeError

__all__ = ["REQUEST_MESSAGES", "rejection", "request_error", "request_id_of"]

#: the messages that belong to exactly one request (every other one covers many)
REQUEST_MESSAGES = (GenerateRequest, EngineRequest)


def request_id_of(message: object) -> str | None:
    """The id of the one request ``message`` belongs to; None for a message of many
    requests (a step, a batch of outputs) or one without a usable id."""
    if isinstance(message, REQUEST_MESSAGES):
        request_id = message.request_id
        if isinstance(request_id, str):
            return request_id
    return None


def request_error(stage: str, error: Exception) -> RequestError:
    """The typed error a request gets when stage ``stage`` failed on its message with
    ``error``: a RequestError as it is; an EncodeError (a value the link to the next stage
    cannot carry, which the validation core should have refused) as an InvalidRequestError;
    anything else as a RequestFailedError naming the stage and the error."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, EncodeError):
        return InvalidRequestError(
            f"the request holds a value the engine's links cannot carry: {error}"
        )
    return RequestFailedError(
        f"stage {stage!r} failed on this request: {type(error).__qualname__}: {error}"
    )


def rejection(
    stage: str, request_id: str, error: Exception, *, abort: bool = False
) -> RequestRejected:
    """The :class:`RequestRejected` that answers ``request_id`` for ``error`` (see
    :func:`request_error`); ``abort``: the engine may hold the request (it failed in a
    frontend stage after admission), so stop-check aborts it there."""
    return RequestRejected.of(request_id, request_error(stage, error), abort=abort)
