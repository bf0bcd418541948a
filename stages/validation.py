"""The validation core: one check of a whole request where it enters the engine, and the
one rule that derives its token limit (pure logic).

Every front end (the Python API, the gRPC and HTTP servers) hands its prompt and
:class:`~stages.params.SamplingParams` to the façade (:meth:`pipeline.engine.AsyncEngine.generate`,
or :meth:`~pipeline.engine.AsyncEngine.check` to check a batch before any of it starts),
which builds the :class:`~stages.messages.GenerateRequest` and calls
:func:`validate_generate_request` once, so a value that some stage or transport could not
carry is refused with one typed error naming the field, the same way everywhere. The stages
trust what it passed and check only what they alone know: tokenize, a prompt without tokens
or a chat without a template; admit, the prompt against the model's length, the KV cache and
the vocabulary (:func:`stages.admit.validate_request`), and the tenant's limits. The field
checks themselves are :mod:`stages.checks`; the sampling parameters are checked by
:func:`stages.params.validate_sampling`.

:func:`resolve_max_tokens` is the one place a request's token limit is derived
(``max_tokens=None``, ``min_tokens`` against it, a tenant's burst): admit calls it once the
prompt is tokenized, and the scheduler of a pipeline without admit calls the same function.
See docs/architecture.md §7.1, "Validate at the boundary".
"""

from __future__ import annotations

from stages.chat_template import check_rendering
from stages.checks import check_bool, check_number, check_text, check_token_ids, describe
from stages.errors import InvalidRequestError, PromptTooLongError
from stages.messages import ChatMessage, GenerateRequest
from stages.params import SamplingParams, validate_sampling
from stages.pooling import validate_pooling
from stages.tools import check_tool_messages, check_tool_use

__all__ = [
    "MAX_REQUEST_ID_LENGTH",
    "MAX_TENANT_LENGTH",
    "check_request_id",
    "resolve_max_tokens",
    "room_after_prompt",
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
    a content each, or token ids), the chat-template flag and options
    (:func:`stages.chat_template.check_rendering`) and the sampling parameters. With
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
    check_tool_use(request, request_id)
    chat = request.messages is not None or (request.prompt is not None and request.chat_template)
    check_rendering(request.rendering, has_messages=chat, request_id=request_id)
    if request.pooling is not None:
        if request.tools:
            raise InvalidRequestError(
                "tools: an embedding request calls no tools", field="tools", request_id=request_id
            )
        validate_pooling(request.pooling, request.params, request_id=request_id)


def room_after_prompt(
    prompt_tokens: int, max_model_len: int, *, request_id: str | None = None
) -> int:
    """The tokens the model's length leaves after a prompt of ``prompt_tokens`` tokens.

    Raises:
        PromptTooLongError: it leaves none (naming both numbers).
    """
    room = max_model_len - prompt_tokens
    if room < 1:
        raise PromptTooLongError(
            f"the prompt has {prompt_tokens} tokens; the model's length is {max_model_len} "
            "(prompt plus at least one generated token)",
            field="prompt",
            request_id=request_id,
        )
    return room


def resolve_max_tokens(
    params: SamplingParams,
    *,
    prompt_tokens: int,
    max_model_len: int,
    budget: float | None = None,
    tenant: str = "",
    request_id: str | None = None,
) -> int:
    """The most tokens a request of ``prompt_tokens`` prompt tokens may generate: its
    ``max_tokens``, or with ``max_tokens=None`` what the model's length leaves after the
    prompt (vLLM's rule: vllm/v1/engine/processor.py, ``process_inputs``). ``budget``: the
    tokens (prompt included) the request's tenant may use at once (its token bucket's
    burst); a request without ``max_tokens`` gets at most what the budget leaves after the
    prompt, and pays for that, rather than being refused for a length it never asked for.
    An explicit ``max_tokens`` is kept as given (the scheduler still stops at the model's
    length, with ``finish_reason="length"``).

    Raises:
        PromptTooLongError: the prompt leaves no room for one generated token in the model's
            length (naming both numbers).
        InvalidRequestError: without ``max_tokens``, the prompt leaves no room in the
            tenant's budget (field ``prompt``); ``min_tokens`` is more than the resolved
            limit (field ``min_tokens``, naming both numbers).
    """
    room = room_after_prompt(prompt_tokens, max_model_len, request_id=request_id)
    limit = params.max_tokens
    if limit is None:
        limit = room
        if budget is not None:
            left = int(budget) - prompt_tokens
            if left < 1:
                raise InvalidRequestError(
                    f"the prompt has {prompt_tokens} tokens, which leaves no room for an answer "
                    f"in what tenant {tenant or '(default)'} may use at once ({budget:.0f})",
                    field="prompt",
                    request_id=request_id,
                )
            limit = min(limit, left)
    if params.min_tokens > limit:
        where = (
            "max_tokens"
            if params.max_tokens is not None
            else "what the model's length (and the tenant's budget) leaves after the prompt"
        )
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens}) is more than {where} ({limit})",
            field="min_tokens",
            request_id=request_id,
        )
    return limit


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
    check_tool_messages(messages, request_id)
