"""The request bodies of the OpenAI-compatible API, as pydantic models, and the API's limits.

Field names and meanings follow OpenAI's API and vLLM's server
(``vllm/entrypoints/openai/protocol.py``): OpenAI's sampling fields, plus vLLM's sampling
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``), and
structured outputs (``response_format``, vLLM's ``structured_outputs``). ``model`` may be left
out (the served model), as vLLM allows. Types are strict: a bool is not an int, a string is not
a number (an int is a float, as in JSON).

Nothing sent is silently ignored: a field these models do not declare is kept
(``extra="allow"``) and refused by :func:`~pipeline.server.http.requests.check_extras` with a
400 naming it, unless its value asks for what the server does anyway (``store: false``,
``service_tier: "auto"``, vLLM's ``add_special_tokens`` at its default, ...: see
:data:`ACCEPTED_AT`), where vLLM would log the field and go on without it.

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
    "ACCEPTED_AT",
    "CHAT_ACCEPTED_AT",
    "CHAT_ROLES",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "COMPLETION_ACCEPTED_AT",
    "EMBEDDINGS_ACCEPTED_AT",
    "MAX_CHOICES",
    "MAX_N",
    "STREAM_OPTIONS_ACCEPTED_AT",
    "ChatCompletionRequest",
    "ChatMessageBody",
    "CompletionRequest",
    "ContentPart",
    "DetokenizeRequest",
    "EmbeddingRequest",
    "FunctionBody",
    "FunctionCallBody",
    "GenerationBody",
    "NamedFunction",
    "NamedToolChoice",
    "StreamOptions",
    "TokenizeRequest",
    "ToolBody",
    "ToolCallBody",
    "describe_problem",
    "param_of",
]

#: chat roles the model's chat template understands ("developer" is OpenAI's new "system")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}  # fmt: skip
#: OpenAI's default ``max_tokens`` for /v1/completions
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: the most choices (``n``) per prompt
MAX_N = 16
#: the most choices of one request (its prompts times ``n``), each its own engine request
MAX_CHOICES = 64

_BODY = ConfigDict(extra="allow", strict=True)
_Item = TypeVar("_Item")

#: fields this server does not implement, accepted only at the values that ask for what it
#: does anyway (OpenAI's and vLLM's defaults, or a no-op); any other value of them, and any
#: field named nowhere, is a 400 naming it (``requests.check_extras``)
ACCEPTED_AT: dict[str, tuple[object, ...]] = {
    # OpenAI: nothing is stored, no tier is chosen, metadata is for stored completions only
    "store": (False, None),
    "service_tier": ("auto", "default", None),
    "metadata": (None,),
    # vLLM's defaults: completions add the tokenizer's special tokens, chat adds the
    # generation prompt and continues no message; spaces between special tokens
    "spaces_between_special_tokens": (True, None),
    "use_beam_search": (False, None),
    "length_penalty": (1.0, 1, None),
    "return_tokens_as_token_ids": (False, None),
    "functions": (None,),
    "function_call": (None, "none"),
    "logits_processors": (None,),
    "mm_processor_kwargs": (None,),
    "documents": (None,),
    "cache_salt": (None,),
    # the scheduling policy decides the order (a request's priority only under "priority")
    "priority": (0, None),
}
#: the same for fields whose default differs by endpoint (vLLM's defaults of each)
COMPLETION_ACCEPTED_AT: dict[str, tuple[object, ...]] = {
    "add_special_tokens": (True, None),
    # chat fields (vLLM's completions do not have them): no template renders a prompt
    "chat_template": (None,),
    "chat_template_kwargs": (None,),
    "add_generation_prompt": (True, None),
    "continue_final_message": (False, None),
}
CHAT_ACCEPTED_AT: dict[str, tuple[object, ...]] = {
    "add_special_tokens": (False, None),
    "echo": (False, None),
}
#: ``stream_options`` fields accepted at these values only
STREAM_OPTIONS_ACCEPTED_AT: dict[str, tuple[object, ...]] = {}
#: the same for ``/v1/embeddings`` (vLLM's defaults there)
EMBEDDINGS_ACCEPTED_AT: dict[str, tuple[object, ...]] = {
    "add_special_tokens": (True, None),
    "priority": (0, None),
}
#: a list that stops at its first bad item
FailFast = Annotated[list[_Item], Field(fail_fast=True)]


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage``, a stream ends with a usage chunk; with
    vLLM's ``continuous_usage_stats`` too, every chunk carries its choice's usage so far."""

    model_config = _BODY

    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationBody(BaseModel):
    """Fields shared by completions and chat completions (None: not given)."""

    model_config = _BODY

    model: str | None = None
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
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # structured outputs (pipeline.server.http.structured): OpenAI's and vLLM's extra
    response_format: Any = None
    structured_outputs: Any = None
    # OpenAI's logit_bias (token id as a string → bias), vLLM's allowed_token_ids, bad_words
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: FailFast[int] | None = None
    bad_words: FailFast[str] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text
    return_token_ids: bool | None = None
    #: vLLM's: score the prompt's tokens too, with this many top alternatives (-1: all)
    prompt_logprobs: int | None = None
    # vLLM's legacy aliases of structured_outputs' keys (deprecated: a log line and a header)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(GenerationBody):
    """The body of ``POST /v1/completions``."""

    #: one prompt or several (OpenAI's four forms: text, texts, token ids, token-id lists)
    prompt: str | FailFast[str] | FailFast[int] | FailFast[FailFast[int]]
    #: the answer's text (and logprobs) start with the prompt's
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


class FunctionCallBody(BaseModel):
    """The function of a tool call: its name and its arguments (JSON text)."""

    model_config = _BODY

    name: str
    arguments: str


class ToolCallBody(BaseModel):
    """A call an assistant message made (OpenAI's ``tool_calls[i]``)."""

    model_config = _BODY

    id: str
    type: str = "function"
    function: FunctionCallBody


class ChatMessageBody(BaseModel):
    """One chat message: its role and its content (text, or a list of text parts); an
    assistant's ``tool_calls``, a tool message's ``tool_call_id``. (``name`` is refused: a
    chat template may ignore it.)"""

    model_config = _BODY

    role: str
    content: str | FailFast[ContentPart] | None = None
    tool_calls: FailFast[ToolCallBody] | None = None
    tool_call_id: str | None = None


class FunctionBody(BaseModel):
    """A function the model may call: its name, what it does, its parameters' JSON schema
    (``strict``: OpenAI's flag; the arguments follow the schema when ``tool_choice``
    enforces them, see docs/serving.md)."""

    model_config = _BODY

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolBody(BaseModel):
    """One of ``tools``: a function tool (the only type)."""

    model_config = _BODY

    type: str
    function: FunctionBody


class NamedFunction(BaseModel):
    model_config = _BODY

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function to call."""

    model_config = _BODY

    type: str
    function: NamedFunction


class ChatCompletionRequest(GenerationBody):
    """The body of ``POST /v1/chat/completions``."""

    messages: FailFast[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: FailFast[ToolBody] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template options (stages.chat_template)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(BaseModel):
    """The body of vLLM's ``POST /tokenize``: a ``prompt`` (completion form) or chat
    ``messages`` rendered by the chat template (chat form)."""

    model_config = _BODY

    model: str | None = None
    prompt: str | None = None
    messages: FailFast[ChatMessageBody] | None = None
    tools: FailFast[ToolBody] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """The body of vLLM's ``POST /detokenize``."""

    model_config = _BODY

    model: str | None = None
    tokens: FailFast[int]


class EmbeddingRequest(BaseModel):
    """The body of ``POST /v1/embeddings`` (OpenAI's fields, and vLLM's ``normalize`` and
    ``truncate_prompt_tokens``)."""

    model_config = _BODY

    model: str | None = None
    #: one input or several (OpenAI's four forms: text, texts, token ids, token-id lists)
    input: str | FailFast[str] | FailFast[int] | FailFast[FailFast[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    #: accepted and ignored: rate limits follow the API key, not a client-chosen name
    user: str | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None


#: every field name of the request bodies (a validation error's location also holds the
#: members of unions, which are not)
_FIELD_NAMES = frozenset(
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessageBody, ContentPart,
                  StreamOptions, TokenizeRequest, DetokenizeRequest, ToolBody, FunctionBody,
                  ToolCallBody, FunctionCallBody, NamedToolChoice, NamedFunction,
                  EmbeddingRequest)
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
