"""vLLM's token endpoints beside the OpenAI API: ``POST /tokenize`` (a prompt, or chat
messages rendered by the model's chat template, to token ids), ``POST /detokenize`` (token
ids to text) and ``GET /version``, in vLLM's shapes (``vllm/entrypoints/openai/protocol.py``:
``TokenizeCompletionRequest``, ``TokenizeChatRequest``, ``DetokenizeRequest``), so tools
written for vLLM (its ``bench serve`` aligns prompts with them) work unchanged.

The tokenizer is the engine's (loaded by the server); tokenizing runs on a worker thread, so
a large prompt (up to the body cap) never holds the event loop.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from starlette.concurrency import run_in_threadpool

from pipeline.server.http.errors import SERVER_ERROR, ApiError
from pipeline.server.http.requests import (
    chat_messages,
    check_extras,
    check_message_extras,
    rendering_of,
    tool_specs,
)
from pipeline.server.http.schema import DetokenizeRequest, TokenizeRequest
from pipeline.server.http.state import HttpService
from pipeline.server.limits import check_request_template
from stages.chat_template import check_rendering
from stages.errors import RequestError
from stages.tokenize import render_messages
from stages.tools import check_tool_messages

__all__ = ["detokenize", "tokenize", "version"]


def _tokenizer(service: HttpService) -> Any:
    problem = service.problem()
    if problem is not None:
        raise problem
    if service.tokenizer is None:
        raise ApiError(503, "the tokenizer is not loaded", error_type=SERVER_ERROR)
    return service.tokenizer


async def tokenize(service: HttpService, body: TokenizeRequest) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` of ``body``'s prompt or chat
    messages (vLLM's defaults: special tokens added to a prompt, not to rendered messages),
    the messages rendered with the body's chat template options as a chat request's are.

    Raises:
        ApiError: 400 for neither or both of ``prompt`` and ``messages``, a field this form
            does not take, or chat template options that are invalid (or a template of the
            request's own on a server that does not trust them); 404 for another model;
            503 while nothing is served.
    """
    service.check_model(body.model)
    check_extras(body.model_extra, {})
    tokenizer = _tokenizer(service)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(
            400,
            "give exactly one of prompt (completion form) and messages (chat form)",
            param="prompt",
            code="invalid_value",
        )
    try:
        if body.messages is not None:
            if body.add_special_tokens:
                raise ApiError(
                    400,
                    "add_special_tokens: not supported with messages (the chat template "
                    "places the special tokens)",
                    param="add_special_tokens",
                    code="unsupported_value",
                )
            check_message_extras(body.messages)
            messages = chat_messages(body.messages)
            check_tool_messages(messages, "tokenize")
            tools = tool_specs(body.tools)
            rendering = rendering_of(body)
            check_request_template(rendering, service.trust_request_chat_template)
            check_rendering(rendering, has_messages=True)
            ids = await run_in_threadpool(
                functools.partial(render_messages, tokenizer, messages, tools, rendering=rendering)
            )
        else:
            chat_only = ("tools", "chat_template", "chat_template_kwargs")
            for name in chat_only:
                if getattr(body, name) is not None:
                    raise ApiError(
                        400,
                        f"{name}: only with messages (the chat template renders them)",
                        param=name,
                        code="invalid_value",
                    )
            if not body.add_generation_prompt or body.continue_final_message:
                name = "continue_final_message" if body.continue_final_message else (
                    "add_generation_prompt")  # fmt: skip
                raise ApiError(
                    400,
                    f"{name}: only with messages (the chat template renders them)",
                    param=name,
                    code="invalid_value",
                )
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tuple(
                await run_in_threadpool(tokenizer.encode, body.prompt, add_special_tokens=special)
            )
    except RequestError as error:
        raise ApiError.from_error(error) from None
    info = service.engine.info
    return {
        "count": len(ids),
        "max_model_len": info.max_model_len if info is not None else None,
        "tokens": list(ids),
        "token_strs": (
            list(tokenizer.convert_ids_to_tokens(list(ids))) if body.return_token_strs else None
        ),
    }


async def detokenize(service: HttpService, body: DetokenizeRequest) -> dict[str, Any]:
    """``{"prompt"}``: the text of ``body.tokens``.

    Raises:
        ApiError: 400 for a token id outside the vocabulary; 404 for another model; 503
            while nothing is served.
    """
    service.check_model(body.model)
    check_extras(body.model_extra, {})
    tokenizer = _tokenizer(service)
    info = service.engine.info
    vocab = info.vocab_size if info is not None else len(tokenizer)
    for index, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise ApiError(
                400,
                f"tokens[{index}]: {token} is not a token id (the vocabulary has {vocab})",
                param=f"tokens[{index}]",
                code="invalid_value",
            )
    text = await run_in_threadpool(tokenizer.decode, body.tokens)
    return {"prompt": text}


def version() -> dict[str, str]:
    """``{"version"}``: actorline's version."""
    try:
        return {"version": importlib.metadata.version("actorline")}
    except importlib.metadata.PackageNotFoundError:
        return {"version": "unknown"}
