"""The request bodies of the OpenAI-compatible API, as pydantic models, and the API's limits.

Field names and meanings follow OpenAI's API and vLLM's server
(``vllm/entrypoints/openai/protocol.py``): OpenAI's sampling fields, plus vLLM's sampling
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``). Unknown fields are ignored, as vLLM does. Types are strict: a bool is
not an int, a string is not a number (an int is a float, as in JSON).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

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
    stop: str | list[str] | None = None
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
    stop_token_ids: list[int] | None = None


class CompletionRequest(GenerationBody):
    """The body of ``POST /v1/completions``."""

    #: one prompt or several (OpenAI's four forms: text, texts, token ids, token-id lists)
    prompt: str | list[str] | list[int] | list[list[int]]
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
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(GenerationBody):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: Any = None
