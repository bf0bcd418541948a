"""Prompts and parameters as the engine accepts them, checked once before a request enters
the pipeline: the prompt forms of vLLM (text, chat messages, token ids, prompt dicts) and
:class:`~stages.params.SamplingParams`. The request they make is checked whole by the
validation core, :func:`stages.validation.validate_generate_request`; a
:class:`CheckedPrompt` is what it passed, which :meth:`~pipeline.engine.AsyncEngine.generate`
takes without checking again (docs/architecture.md §7.1, "Validate at the boundary")."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from stages.errors import InvalidRequestError
from stages.messages import ChatMessage, ChatRendering, GenerateRequest
from stages.params import SamplingParams
from stages.tools import ToolUse, message_from_dict
from stages.validation import validate_generate_request

__all__ = [
    "CheckedPrompt",
    "Prompt",
    "as_checked",
    "check_prompt",
    "checked_request",
    "is_prompt_dict",
    "make_request",
]

#: what ``generate`` accepts: text, chat messages (dicts with role/content or ChatMessage), or
#: token ids, or vLLM's prompt dicts ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
Prompt = str | Sequence[ChatMessage | Mapping[str, str]] | Sequence[int] | Mapping[str, Any]

#: the keys of vLLM's TextPrompt / TokensPrompt that actorline serves
_PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def is_prompt_dict(item: object) -> bool:
    """Whether ``item`` is a vLLM-style prompt dict (not a chat message)."""
    return isinstance(item, Mapping) and any(key in item for key in _PROMPT_DICT_KEYS)


def _from_prompt_dict(prompt: Mapping[str, Any], request_id: str) -> Any:
    """The text or token ids of a vLLM-style prompt dict.

    Raises:
        InvalidRequestError: not exactly one of the keys, or a value of the wrong type.
    """
    keys = sorted(map(str, prompt))
    if len(keys) != 1 or keys[0] not in _PROMPT_DICT_KEYS:
        raise InvalidRequestError(
            "a prompt dict must be {'prompt': text} or {'prompt_token_ids': [ids]}, "
            f"got the keys {keys}",
            field="prompt",
            request_id=request_id,
        )
    key, value = keys[0], prompt[keys[0]]
    if key == "prompt":
        valid = isinstance(value, str)
    else:
        valid = isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))
    if not valid:
        kind = "a string" if key == "prompt" else "a list of token ids"
        raise InvalidRequestError(
            f"{key} must be {kind}, got {value!r:.60}", field="prompt", request_id=request_id
        )
    return value


def make_request(
    request_id: str,
    prompt: Prompt,
    params: SamplingParams,
    tenant: str,
    chat_template: bool,
    tools: ToolUse | None = None,
    rendering: ChatRendering | None = None,
) -> GenerateRequest:
    """The pipeline's request for ``prompt`` (``tools``: the functions a chat may call;
    ``rendering``: how its chat template renders).

    Raises:
        InvalidRequestError: a prompt of no accepted form (the field is named).
    """
    arrival = time.time()
    use = tools or ToolUse(choice="")
    # NOTE: tools go on every form, so the validation core refuses them beside a plain prompt
    offered: dict[str, Any] = {"tools": use.tools, "tool_choice": use.choice,
               "parallel_tool_calls": use.parallel, "rendering": rendering}  # fmt: skip
    if isinstance(prompt, Mapping):
        prompt = _from_prompt_dict(prompt, request_id)
    if isinstance(prompt, str):
        # NOTE: only "" is refused here: a whitespace-only prompt has tokens and runs, as in
        # vLLM; tokenize refuses a prompt whose token list comes out empty.
        if not prompt:
            raise InvalidRequestError("prompt is empty", field="prompt", request_id=request_id)
        return GenerateRequest(
            request_id, params, prompt=prompt, chat_template=chat_template, tenant=tenant,
            arrival_time=arrival, **offered,
        )  # fmt: skip
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)) and prompt:
        if all(type(token) is int for token in prompt):
            return GenerateRequest(
                request_id, params, prompt_token_ids=tuple(prompt),  # type: ignore[arg-type]
                tenant=tenant, arrival_time=arrival, **offered,
            )  # fmt: skip
        messages = []
        for item in prompt:
            if isinstance(item, ChatMessage):
                messages.append(item)
            elif isinstance(item, Mapping) and (
                isinstance(item.get("content"), str) or "tool_calls" in item
            ):
                # NOTE: the role is not coerced (str(5) would make a role of a number): the
                # validation core refuses a role that is not text.
                messages.append(message_from_dict(item))
            else:
                raise InvalidRequestError(
                    "a prompt list must hold token ids or chat messages "
                    "({'role': ..., 'content': ...})",
                    field="prompt",
                    request_id=request_id,
                )
        return GenerateRequest(
            request_id, params, messages=tuple(messages), tenant=tenant, arrival_time=arrival,
            **offered,
        )  # fmt: skip
    raise InvalidRequestError(
        f"prompt must be a non-empty string, chat messages or token ids, got {prompt!r:.60}",
        field="prompt",
        request_id=request_id,
    )


def checked_request(
    request_id: str,
    prompt: Prompt,
    params: SamplingParams | None,
    tenant: str,
    chat_template: bool,
    *,
    vocab_size: int | None = None,
    tools: ToolUse | None = None,
    rendering: ChatRendering | None = None,
) -> GenerateRequest:
    """The pipeline's request for ``prompt``, checked whole (every field, every prompt form)
    by :func:`~stages.validation.validate_generate_request`; ``params`` None: the defaults.
    ``vocab_size`` (the engine's, once known) bounds token ids.

    Raises:
        InvalidRequestError: naming the field that is wrong.
    """
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            "params must be a SamplingParams", field="params", request_id=request_id
        )
    request = make_request(request_id, prompt, params, tenant, chat_template, tools, rendering)
    validate_generate_request(request, vocab_size=vocab_size)
    return request


@dataclasses.dataclass(frozen=True, slots=True)
class CheckedPrompt:
    """A prompt and its parameters that the validation core passed: made only by
    :func:`check_prompt` (:meth:`~pipeline.engine.AsyncEngine.check`), taken by
    :meth:`~pipeline.engine.AsyncEngine.generate` without checking again. ``request`` is the
    pipeline's request, its id a stand-in until ``generate`` gives it the engine's;
    ``vocab_size``: the vocabulary its token ids were checked against (None: not yet known,
    admit checks them)."""

    request: GenerateRequest
    vocab_size: int | None = None

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def params(self) -> SamplingParams:
        return self.request.params


#: the id a checked prompt carries until ``generate`` gives it the engine's
_STAND_IN_ID = "checked"


def check_prompt(
    prompt: Prompt,
    params: SamplingParams | None,
    *,
    tenant: str = "",
    chat_template: bool = False,
    vocab_size: int | None = None,
    request_id: str | None = None,
    tools: ToolUse | None = None,
    rendering: ChatRendering | None = None,
) -> CheckedPrompt:
    """``prompt`` and ``params`` checked once by the validation core (as
    :func:`checked_request`), for :meth:`~pipeline.engine.AsyncEngine.generate` to send
    later. ``request_id``: the caller's id of the request, named by an error (it is not
    kept: ``generate`` gives the request its own).

    Raises:
        InvalidRequestError: naming the field that is wrong.
    """
    try:
        request = checked_request(
            _STAND_IN_ID, prompt, params, tenant, chat_template, vocab_size=vocab_size,
            tools=tools, rendering=rendering,
        )  # fmt: skip
    except InvalidRequestError as exc:
        exc.request_id = request_id
        raise
    return CheckedPrompt(request, vocab_size)


def as_checked(
    prompt: Prompt | CheckedPrompt,
    params: SamplingParams | None,
    *,
    tenant: str = "",
    chat_template: bool = False,
    vocab_size: int | None = None,
    request_id: str | None = None,
    tools: ToolUse | None = None,
    rendering: ChatRendering | None = None,
) -> CheckedPrompt:
    """``prompt`` as it is if the core checked it already (it carries its parameters,
    tenant and chat-template flag: give none of its own), else :func:`check_prompt`.

    Raises:
        InvalidRequestError: naming the field that is wrong, or (field ``sampling_params``)
            parameters given beside a checked prompt.
    """
    if not isinstance(prompt, CheckedPrompt):
        return check_prompt(
            prompt,
            params,
            tenant=tenant,
            chat_template=chat_template,
            vocab_size=vocab_size,
            request_id=request_id,
            tools=tools,
            rendering=rendering,
        )
    given = params is not None or chat_template or tools or rendering
    if given or tenant not in ("", prompt.tenant):
        raise InvalidRequestError(
            "a checked prompt carries its sampling parameters, tenant and chat template "
            "flag; give them to check(), not to generate()",
            field="sampling_params",
            request_id=request_id,
        )
    return prompt
