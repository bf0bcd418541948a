"""The request bodies of the OpenAI-compatible API, as pydantic models, and the API's limits.

Field names and meanings follow OpenAI's API and vLLM's server
(``vllm/entrypoints/openai/protocol.py``): OpenAI's sampling fields, plus vLLM's sampling
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``), and structured outputs (``response_format``, vLLM's
``structured_outputs``). Unknown fields are ignored, as vLLM does. Types are strict: a bool is
not an int, a string is not a number (an int is a float, as in JSON).

NOTE: every list stops at its first bad item (``fail_fast``). Without it, pydantic checks a
union such as ``prompt``'s against each member and collects one error per item for each
member that does not fit: 80 ms of the event loop for a 1 MiB list of token ids (which fits
only the third member), against 1 ms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CHAT_ROLES",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "MAX_CHOICES",
    "MAX_N",
    "ChatCompletionRequest",
    "ChatMessageBody",
    "CompletionRequest",
    "ContentPart",
    "GenerationBody",
    "StreamOptions",
    "describe_problem",
    "param_of",
]

#: chat roles the model's chat template understands ("developer" is OpenAI's new "system")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: OpenAI's default ``max_tokens`` for /v1/completions
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: the most choices (``n``) per prompt
MAX_N = 16
#: the most choices of one request (its prompts times ``n``), each its own engine request
MAX_CHOICES = 64

_BODY = ConfigDict(extra="ignore", strict=True)
_Item = TypeVar("_Item")
#: a list that stops at its first bad item
FailFast = Annotated[list[_Item], Field(fail_fast=True)]


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage``, a stream ends with a usage chunk."""

    model_config = _BODY

    include_usage: bool = False


class GenerationBody(BaseModel):
    """Fields shared by completions and chat completions (None: not given)."""

    model_config = _BODY

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | FailFast[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    #: accepted and ignored: rate limits follow the API key, not a client-chosen name
    user: str | None = None
    # vLLM's sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: FailFast[int] | None = None
    # structured outputs (pipeline.server.http.structured): OpenAI's and vLLM's extra
    response_format: Any = None
    structured_outputs: Any = None


class CompletionRequest(GenerationBody):
    """The body of ``POST /v1/completions``."""

    #: one prompt or several (OpenAI's four forms: text, texts, token ids, token-id lists)
    prompt: str | FailFast[str] | FailFast[int] | FailFast[FailFast[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    #: how many top alternatives to return per token (None: no logprobs)
    logprobs: int | None = None


class ContentPart(BaseModel):
    """One part of a chat message's content (only ``{"type": "text", "text": ...}`` is
    served)."""

    model_config = _BODY

    type: str
    text: str | None = None


class ChatMessageBody(BaseModel):
    """One chat message: its role and its content (text, or a list of text parts)."""

    model_config = _BODY

    role: str
    content: str | FailFast[ContentPart] | None = None


class ChatCompletionRequest(GenerationBody):
    """The body of ``POST /v1/chat/completions``."""

    messages: FailFast[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: FailFast[Any] | None = None


#: every field name of the request bodies (a validation error's location also holds the
#: members of unions, which are not)
_FIELD_NAMES = frozenset(
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessageBody, ContentPart,
                  StreamOptions)
    for name in model.model_fields
)  # fmt: skip


def param_of(location: Sequence[int | str]) -> str | None:
    """The ``param`` naming where a validation error's ``location`` is in the body, such as
    ``messages[0].role`` (None: the body as a whole)."""
    param = ""
    for part in location:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELD_NAMES:
            param += f".{part}" if param else part
    return param or None


def describe_problem(problems: Sequence[Mapping[str, Any]]) -> tuple[str | None, str]:
    """The ``param`` and the message of pydantic's validation ``problems`` of a body: the
    first problem; for a value that fits no member of a union, the members it may be."""
    if not problems:
        return None, "invalid request body"
    first = problems[0]
    location = tuple(first.get("loc", ()))
    param = param_of(location)
    # NOTE: a union's member names follow the field in the location (``prompt``, ``str``)
    member = next(
        (index for index, part in enumerate(location)
         if isinstance(part, str) and part not in _FIELD_NAMES),
        None,
    )  # fmt: skip
    if member is None:
        message = str(first.get("msg", "invalid value"))
    else:
        prefix = location[:member]
        kinds = dict.fromkeys(
            str(problem["loc"][member])
            for problem in problems
            if tuple(problem.get("loc", ()))[:member] == prefix and len(problem["loc"]) > member
        )
        message = f"must be one of: {', '.join(kinds)}"
    return param, f"{param}: {message}" if param else message
