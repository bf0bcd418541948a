"""The validation core: one check of a whole request where it enters the engine (pure logic).

Every front end (the Python API, the gRPC and HTTP servers, the CLI) turns its own encoding
into a :class:`~stages.messages.GenerateRequest` and calls :func:`validate_generate_request`
before the request enters the pipeline, so a value that some stage or transport could not
carry is refused with one typed error naming the field, the same way everywhere; the tokenize
stage calls it again for requests that reach the pipeline by another way (a custom caller of
its entry). The field checks themselves are :mod:`stages.checks`; the sampling parameters are
checked by :func:`stages.params.validate_sampling`. See docs/architecture.md, "Failure: one
request or the pipeline".
"""

from __future__ import annotations

from stages.checks import check_bool, check_number, check_text, check_token_ids, describe
from stages.errors import InvalidRequestError
from stages.messages import ChatMessage, GenerateRequest
from stages.params import SamplingParams, validate_sampling

__all__ = [
    "MAX_REQUEST_ID_LENGTH",
    "MAX_TENANT_LENGTH",
    "check_request_id",
    "validate_generate_request",
]

#: characters of a caller's request id (the pipeline's own id adds a short suffix)
MAX_REQUEST_ID_LENGTH = 1024
#: characters of a tenant name
MAX_TENANT_LENGTH = 1024
#: what the API adds to a caller's id inside the pipeline ("#" and a counter)
_ID_SUFFIX_ROOM = 32
#: the inputs of a GenerateRequest, exactly one of which is set
_INPUTS = ("prompt", "messages", "prompt_token_ids")


def check_request_id(value: object, *, max_length: int = MAX_REQUEST_ID_LENGTH) -> str:
    """``value`` if it is a usable request id: a non-empty string with a UTF-8 form, of at
    most ``max_length`` characters.

    Raises:
        InvalidRequestError: naming ``request_id``.
    """
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(
            f"request_id must be a non-empty string, got {describe(value)}", field="request_id"
        )
    return check_text("request_id", value, max_length=max_length)


def validate_generate_request(request: GenerateRequest, *, vocab_size: int | None = None) -> None:
    """Check every field of ``request`` against what every stage and transport can carry:
    its id and tenant, exactly one input (a non-empty prompt, chat messages with a role and
    a content each, or token ids), the chat-template flag and the sampling parameters. With
    ``vocab_size`` token ids are checked against the vocabulary. (Whether the prompt fits the
    model is admit's to say, once it is tokenized: :func:`stages.admit.validate_request`.)

    Raises:
        InvalidRequestError: naming the first field that is wrong.
    """
    request_id = check_request_id(
        request.request_id, max_length=MAX_REQUEST_ID_LENGTH + _ID_SUFFIX_ROOM
    )
    check_text("tenant", request.tenant, max_length=MAX_TENANT_LENGTH, request_id=request_id)
    check_bool("chat_template", request.chat_template, request_id=request_id)
    check_number("arrival_time", request.arrival_time, request_id=request_id)
    given = [name for name in _INPUTS if getattr(request, name) is not None]
    if len(given) != 1:
        raise InvalidRequestError(
            "give exactly one of prompt, messages or prompt_token_ids"
            + (f" (got {', '.join(given)})" if given else ""),
            field="prompt",
            request_id=request_id,
        )
    if request.prompt is not None:
        check_text("prompt", request.prompt, allow_empty=False, request_id=request_id)
    elif request.messages is not None:
        _check_messages(request.messages, request_id)
    else:
        check_token_ids(
            "prompt_token_ids",
            request.prompt_token_ids,
            vocab_size=vocab_size,
            request_id=request_id,
        )
    if not isinstance(request.params, SamplingParams):
        raise InvalidRequestError(
            f"params must be a SamplingParams, got {describe(request.params)}",
            field="params",
            request_id=request_id,
        )
    validate_sampling(request.params, vocab_size=vocab_size, request_id=request_id)


def _check_messages(messages: object, request_id: str) -> None:
    """Chat messages: a non-empty tuple of ChatMessage, each with a non-empty role and a
    content, both text with a UTF-8 form.

    Raises:
        InvalidRequestError: naming ``messages``.
    """
    if not isinstance(messages, tuple) or not messages:
        raise InvalidRequestError(
            f"messages must be a non-empty list of chat messages, got {describe(messages)}",
            field="messages",
            request_id=request_id,
        )
    for index, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise InvalidRequestError(
                f"messages[{index}] must be a chat message, got {describe(message)}",
                field="messages",
                request_id=request_id,
            )
        check_text(
            "messages",
            message.role,
            allow_empty=False,
            request_id=request_id,
            where=f"messages[{index}].role",
        )
        check_text(
            "messages", message.content, request_id=request_id, where=f"messages[{index}].content"
        )
