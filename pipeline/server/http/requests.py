"""From a request body to engine requests: each choice's prompt and
:class:`~stages.params.SamplingParams`, translated from the body; the engine's validation core
checks each choice once before anything starts
(:meth:`~pipeline.server.http.state.HttpService.check`).

``n`` (1 to :data:`~pipeline.server.http.schema.MAX_N`) asks for that many choices of each
prompt, each its own engine request; with a ``seed``, choice j samples with ``seed + j``
(seeded choices differ, and reproduce), as vLLM's ``n`` does with one seed per sequence.
``prompt`` of /v1/completions may be a list of prompts: choice ``prompt_index * n + j``, at
most :data:`~pipeline.server.http.schema.MAX_CHOICES` in all. A chat request without a
token limit generates up to the model's length (vLLM); /v1/completions defaults to 16 tokens
(OpenAI).

NOTE: nothing here tokenizes. Chat messages go to the engine as messages and its tokenize
stage applies the chat template (on its worker thread for large inputs), so a big prompt
never holds the event loop here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

from pipeline.engine.prompts import Prompt
from pipeline.server.http.errors import ApiError
from pipeline.server.http.schema import (
    ACCEPTED_AT,
    CHAT_ACCEPTED_AT,
    CHAT_ROLES,
    COMPLETION_ACCEPTED_AT,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    MAX_N,
    STREAM_OPTIONS_ACCEPTED_AT,
    ChatCompletionRequest,
    ChatMessageBody,
    CompletionRequest,
    GenerationBody,
    TokenizeRequest,
    ToolBody,
)
from pipeline.server.http.structured import GUIDED_ALIASES, structured_outputs_from
from stages.chat_template import make_rendering
from stages.errors import RequestError
from stages.messages import ChatMessage, ChatRendering, ToolCall, ToolSpec
from stages.params import MAX_LOGPROBS, SamplingParams
from stages.tools import ToolUse

__all__ = [
    "SEED_RANGE",
    "Plan",
    "chat_messages",
    "check_extras",
    "plan_chat",
    "plan_completion",
    "rendering_of",
    "tool_use",
]

_log = logging.getLogger(__name__)

#: seeds are in [0, SEED_RANGE) (:func:`stages.params.validate_sampling`); choice j's seed is
#: the request's + j, modulo this
SEED_RANGE = 2**63

#: body fields accepted only at a value that asks for nothing this server lacks
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda value: value not in (None, 1),
    "suffix": bool,
}
#: body fields that are SamplingParams fields of the same name
_SAMPLING_FIELDS = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The engine requests answering one HTTP request: each choice's prompt and parameters
    (choice ``prompt_index * per_prompt + j``), how many choices each prompt has, how many
    top logprobs each token carries (None: no logprobs), and whether a stream ends with a
    usage chunk. ``tools``: the functions a chat offers (None: none). ``deprecated``: the
    deprecated fields the body used (vLLM's ``guided_*``), for a ``Warning`` header.
    ``rendering``: a chat's template options (None: the model's template as it is).
    ``token_ids``: the answer carries the prompt's and each choice's token ids (vLLM's
    ``return_token_ids``).
    ``echo``: a completion's answer starts with its prompt (``echo_only``: and holds nothing
    else: ``max_tokens`` 0); ``prompt_logprobs``: the body asked for the prompt's scores in
    the answer (vLLM's field; None: not asked)."""

    choices: tuple[tuple[Prompt, SamplingParams], ...]
    per_prompt: int
    logprobs: int | None
    include_usage: bool
    tools: ToolUse | None = None
    deprecated: tuple[str, ...] = ()
    continuous_usage: bool = False
    rendering: ChatRendering | None = None
    token_ids: bool = False
    echo: bool = False
    echo_only: bool = False
    prompt_logprobs: int | None = None


def plan_completion(body: CompletionRequest) -> Plan:
    """The plan of a ``/v1/completions`` body.

    Raises:
        ApiError: 400 naming the field that is invalid or asks for what is not served.
    """
    _check_body_extras(body, COMPLETION_ACCEPTED_AT)
    _check_supported(body)
    n = _choices_per_prompt(body)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    echo = bool(body.echo)
    # NOTE: as vLLM (vllm/entrypoints/openai/completion/protocol.py, to_sampling_params):
    # echo with logprobs scores the prompt with the same top count unless prompt_logprobs
    # says otherwise; echo with max_tokens 0 runs one token and answers the prompt only
    echo_only = echo and max_tokens == 0
    params = _sampling(body, 1 if echo_only else max_tokens, body.logprobs)
    if echo and body.logprobs is not None and body.prompt_logprobs is None:
        params = params.replace(prompt_logprobs=body.logprobs)
    plan = _plan(body, _prompts(body.prompt), params, n)
    return dataclasses.replace(plan, echo=echo, echo_only=echo_only)


def plan_chat(body: ChatCompletionRequest) -> Plan:
    """The plan of a ``/v1/chat/completions`` body.

    Raises:
        ApiError: 400 naming the field that is invalid or asks for what is not served.
    """
    _check_body_extras(body, CHAT_ACCEPTED_AT)
    _check_supported(body)
    n = _choices_per_prompt(body)
    messages = _chat_messages(body)
    limits = (body.max_completion_tokens, body.max_tokens)
    max_tokens = next((limit for limit in limits if limit is not None), None)
    params = _sampling(body, max_tokens, _chat_logprobs(body))
    plan = _plan(body, [messages], params, n)
    return dataclasses.replace(plan, tools=tool_use(body), rendering=rendering_of(body))


def rendering_of(body: ChatCompletionRequest | TokenizeRequest) -> ChatRendering | None:
    """The chat template options of a chat or ``/tokenize`` body (None: the defaults); the
    engine's validation core checks them.

    Raises:
        ApiError: 400 naming ``chat_template_kwargs`` when it holds what is not JSON.
    """
    try:
        return make_rendering(
            body.chat_template,
            body.chat_template_kwargs,
            body.add_generation_prompt,
            body.continue_final_message,
        )
    except RequestError as error:
        raise ApiError.from_error(error) from None


def _plan(body: GenerationBody, prompts: Sequence[Prompt], params: SamplingParams, n: int) -> Plan:
    if len(prompts) * n > MAX_CHOICES:
        param = "prompt" if len(prompts) > MAX_CHOICES else "n"
        raise ApiError(
            400,
            f"{len(prompts)} prompt(s) times n={n} is {len(prompts) * n} choices; at most "
            f"{MAX_CHOICES} per request",
            param=param,
            code="invalid_value",
        )
    seed = params.seed
    # NOTE: a seed outside [0, SEED_RANGE) is left as it is, for the engine's validation core
    # to refuse naming it (wrapping it would accept -1 as 2**63 - 1).
    if type(seed) is int and 0 <= seed < SEED_RANGE:
        each = [params.replace(seed=(seed + j) % SEED_RANGE) for j in range(n)]
    else:
        each = [params] * n
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    if continuous and not include_usage:
        # NOTE: vLLM ignores it then (vllm/entrypoints/openai/serving_chat.py,
        # include_continuous_usage); here it is refused rather than ignored
        raise ApiError(
            400,
            "stream_options.continuous_usage_stats: needs stream_options.include_usage true",
            param="stream_options.continuous_usage_stats",
            code="invalid_value",
        )
    choices = tuple((prompt, choice) for prompt in prompts for choice in each)
    deprecated = tuple(name for name in GUIDED_ALIASES if getattr(body, name) is not None)
    if deprecated:
        # as vLLM does (vllm/entrypoints/openai/protocol.py, the guided_* fields)
        _log.warning(
            "%s: deprecated; use structured_outputs (%s)",
            ", ".join(deprecated),
            ", ".join(f"{name} -> {GUIDED_ALIASES[name]}" for name in deprecated),
        )
    return Plan(
        choices, n, params.logprobs, include_usage, deprecated=deprecated,
        continuous_usage=continuous, token_ids=bool(body.return_token_ids),
        prompt_logprobs=body.prompt_logprobs,
    )  # fmt: skip


def check_extras(
    extras: dict[str, Any] | None, accepted: dict[str, tuple[object, ...]], where: str = ""
) -> None:
    """Refuse the fields of a body that its model does not declare (``extras``: pydantic's
    ``model_extra``), unless ``accepted`` lists the value as asking for nothing this server
    lacks: nothing sent is silently ignored. ``where``: the param's prefix (``messages[0].``).

    Raises:
        ApiError: 400 ``unsupported_value`` naming the first such field.
    """
    for name, value in (extras or {}).items():
        allowed = accepted.get(name)
        if allowed is not None and any(
            (value == ok and type(value) is type(ok)) or (value is None and ok is None)
            for ok in allowed
        ):
            continue
        param = f"{where}{name}"
        if allowed is None:
            message = f"{param}: this server does not know this field"
        else:
            shown = ", ".join(repr(ok) for ok in allowed if ok is not None)
            message = f"{param}: is not supported (got {value!r:.60}); accepted only as {shown}"
        raise ApiError(400, message, param=param, code="unsupported_value")


def _check_body_extras(body: GenerationBody, accepted: dict[str, tuple[object, ...]]) -> None:
    check_extras(body.model_extra, {**ACCEPTED_AT, **accepted})
    if body.stream_options is not None:
        check_extras(body.stream_options.model_extra, STREAM_OPTIONS_ACCEPTED_AT, "stream_options.")
    if isinstance(body, ChatCompletionRequest):
        check_message_extras(body.messages, body.tools)
        if not isinstance(body.tool_choice, str | None):
            check_extras(body.tool_choice.model_extra, {}, "tool_choice.")
            check_extras(body.tool_choice.function.model_extra, {}, "tool_choice.function.")


def check_message_extras(
    messages: Sequence[ChatMessageBody], tools: Sequence[ToolBody] | None = None
) -> None:
    """Refuse the fields of chat ``messages`` (their parts and calls) and ``tools`` that
    their models do not declare (:func:`check_extras`).

    Raises:
        ApiError: 400 ``unsupported_value`` naming the first such field.
    """
    for index, message in enumerate(messages):
        where = f"messages[{index}]."
        check_extras(message.model_extra, {"name": (None,)}, where)
        for call_index, call in enumerate(message.tool_calls or ()):
            call_where = f"{where}tool_calls[{call_index}]."
            check_extras(call.model_extra, {}, call_where)
            check_extras(call.function.model_extra, {}, f"{call_where}function.")
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                check_extras(part.model_extra, {}, f"{where}content[{part_index}].")
    for index, tool in enumerate(tools or ()):
        check_extras(tool.model_extra, {}, f"tools[{index}].")
        check_extras(tool.function.model_extra, {}, f"tools[{index}].function.")


def _check_supported(body: GenerationBody) -> None:
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            400,
            "stream_options: only allowed when stream is true",
            param="stream_options",
            code="invalid_value",
        )
    if body.stream and body.prompt_logprobs is not None:
        # vLLM's rule (vllm/entrypoints/openai/completion/protocol.py, check_logprobs)
        raise ApiError(
            400,
            "prompt_logprobs: not available when stream is true (a stream of /v1/completions "
            "with echo and logprobs carries the prompt's scores in its first chunk)",
            param="prompt_logprobs",
            code="unsupported_value",
        )
    for field, asks_too_much in _UNSUPPORTED.items():
        value = getattr(body, field, None)
        if asks_too_much(value):
            raise ApiError(
                400,
                f"{field}: is not supported (got {value!r:.60})",
                param=field,
                code="unsupported_value",
            )


def _sampling(body: GenerationBody, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The body's sampling parameters (not yet checked). ``max_tokens`` None: up to the model's
    length; ``logprobs``: top alternatives per token (None: no logprobs)."""
    values: dict[str, Any] = {name: getattr(body, name) for name in _SAMPLING_FIELDS}
    values = {name: value for name, value in values.items() if value is not None}
    if body.stop is not None:
        values["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        values["stop_token_ids"] = tuple(body.stop_token_ids)
    if body.logit_bias:
        values["logit_bias"] = _logit_bias(body.logit_bias)
    if body.allowed_token_ids is not None:
        values["allowed_token_ids"] = tuple(body.allowed_token_ids)
    if body.bad_words:
        values["bad_words"] = tuple(body.bad_words)
    guided = {name: getattr(body, name) for name in GUIDED_ALIASES}
    constraint = structured_outputs_from(body.response_format, body.structured_outputs, guided)
    if constraint is not None:
        values["structured_outputs"] = constraint
    # NOTE: not validated here: the engine's validation core checks every choice once,
    # before any starts (HttpService.check, docs/architecture.md §7.1).
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)


def _logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON keys, strings) as (id, bias) pairs.

    Raises:
        ApiError: 400 naming ``logit_bias`` for a key that is not a token id.
    """
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            raise ApiError(
                400,
                f"logit_bias: keys must be token ids, got {key!r:.40}",
                param="logit_bias",
                code="invalid_value",
            )
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _choices_per_prompt(body: GenerationBody) -> int:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n", code="invalid_value")
    return n


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The prompts of a /v1/completions body (a list of token ids is one prompt)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [cast(list[int], prompt)]
    return list(cast(list[str] | list[list[int]], prompt))


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """``top_logprobs`` (default 0) when ``logprobs`` is true, else None."""
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(
            400,
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
            param="top_logprobs",
            code="invalid_value",
        )
    if not body.logprobs:
        if top:
            raise ApiError(
                400,
                "top_logprobs needs logprobs set to true",
                param="top_logprobs",
                code="invalid_value",
            )
        return None
    return top or 0


def _chat_messages(body: ChatCompletionRequest) -> tuple[ChatMessage, ...]:
    return chat_messages(body.messages)


def chat_messages(bodies: Sequence[ChatMessageBody]) -> tuple[ChatMessage, ...]:
    """Chat messages of a body's ``messages``, their text parts joined.

    Raises:
        ApiError: 400 naming the message that is empty, of an unknown role, or has a part
            that is not text.
    """
    if not bodies:
        raise ApiError(400, "messages must not be empty", param="messages", code="invalid_value")
    messages = []
    for index, message in enumerate(bodies):
        role = CHAT_ROLES.get(message.role)
        if role is None:
            raise ApiError(
                400,
                f"role {message.role!r:.40} is not supported; use one of {', '.join(CHAT_ROLES)}",
                param=f"messages[{index}].role",
                code="invalid_value",
            )
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ApiError(
                    400,
                    "only text content parts are supported",
                    param=f"messages[{index}].content",
                    code="unsupported_value",
                )
            content = "".join(part.text or "" for part in content)
        calls = []
        for call_index, call in enumerate(message.tool_calls or ()):
            if call.type != "function":
                raise ApiError(
                    400,
                    f"type {call.type!r:.40} is not supported; only function calls are",
                    param=f"messages[{index}].tool_calls[{call_index}].type",
                    code="invalid_value",
                )
            calls.append(ToolCall(call.id, call.function.name, call.function.arguments))
        messages.append(ChatMessage(role, content or "", tuple(calls), message.tool_call_id or ""))
    return tuple(messages)


def tool_specs(tools: Sequence[ToolBody] | None) -> tuple[ToolSpec, ...]:
    """The functions of a body's ``tools``.

    Raises:
        ApiError: 400 naming a tool that is not a function.
    """
    specs = []
    for index, tool in enumerate(tools or ()):
        if tool.type != "function":
            raise ApiError(
                400,
                f"tools[{index}].type: {tool.type!r:.40} is not supported; only function tools are",
                param=f"tools[{index}].type",
                code="invalid_value",
            )
        function = tool.function
        parameters = "" if function.parameters is None else json.dumps(function.parameters)
        specs.append(ToolSpec(function.name, function.description or "", parameters))
    return tuple(specs)


def tool_use(body: ChatCompletionRequest) -> ToolUse | None:
    """The body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` for the engine
    (None: none of them given); the engine's validation core checks names and schemas.

    Raises:
        ApiError: 400 naming a tool that is not a function, a ``tool_choice`` object that
            does not name a function, or ``strict`` asked of a choice that is not enforced.
    """
    if body.tools is None and body.tool_choice is None and body.parallel_tool_calls is None:
        return None
    specs = tool_specs(body.tools)
    choice = body.tool_choice
    if choice is None:
        name = "auto" if specs else "none"
    elif isinstance(choice, str):
        name = choice
        if name not in ("none", "auto", "required"):
            raise ApiError(
                400,
                f"tool_choice: must be none, auto, required or a function object, got {name!r:.40}",
                param="tool_choice",
                code="invalid_value",
            )
    else:
        if choice.type != "function":
            raise ApiError(
                400,
                f"tool_choice.type: must be 'function', got {choice.type!r:.40}",
                param="tool_choice.type",
                code="invalid_value",
            )
        name = choice.function.name
    for index, tool in enumerate(body.tools or ()):
        if tool.function.strict and name in ("none", "auto"):
            # NOTE: auto's calls are parsed from what the model wrote, not enforced
            raise ApiError(
                400,
                f"tools[{index}].function.strict: true is enforced only with tool_choice "
                "required or a named function",
                param=f"tools[{index}].function.strict",
                code="unsupported_value",
            )
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolUse(specs, name, parallel)
