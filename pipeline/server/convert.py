"""Conversions between the Generation service's protobuf messages and actorline's Python
types, for the server (proto → engine input, engine output → proto) and the client (Python
input → proto). Every SamplingParams field has a proto counterpart of the same name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pipeline.engine.prompts import Prompt
from pipeline.server import generation_pb2 as pb
from pipeline.server.limits import MAX_EMBEDDING_INPUTS
from stages.errors import InvalidRequestError
from stages.messages import (
    ChatMessage,
    ChatRendering,
    EngineInfo,
    Logprobs,
    RequestOutput,
    ToolCall,
    ToolSpec,
)
from stages.params import SamplingParams
from stages.structured.params import StructuredOutputsParams, validate_structured_outputs
from stages.tools import ToolUse

__all__ = [
    "FINISH_REASONS",
    "SAMPLING_FIELDS",
    "embed_inputs_from_proto",
    "finish_reason_name",
    "model_info_to_proto",
    "prompt_from_proto",
    "rendering_from_proto",
    "request_to_proto",
    "response_from_output",
    "sampling_from_proto",
    "sampling_to_proto",
    "structured_outputs_from_proto",
    "structured_outputs_to_proto",
]

#: SamplingParams field → its default, in declaration order
SAMPLING_FIELDS: dict[str, object] = {
    field.name: field.default for field in dataclasses.fields(SamplingParams)
}
_REPEATED_FIELDS = ("stop", "stop_token_ids", "bad_words")
_MESSAGE_FIELDS = ("structured_outputs",)

#: engine finish reason → proto enum value
FINISH_REASONS: dict[str, int] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
_FINISH_NAMES = {value: name for name, value in FINISH_REASONS.items()}


def finish_reason_name(value: int) -> str | None:
    """The engine's finish reason for a proto enum value (None while running)."""
    return _FINISH_NAMES.get(value)


# -- sampling parameters --------------------------------------------------------------------


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The proto form of ``params``; fields at their default stay unset.

    Raises:
        InvalidRequestError: a value the proto cannot carry (wrong type, out of range),
            naming the field.
    """
    message = pb.SamplingParams()
    for name, default in SAMPLING_FIELDS.items():
        value = getattr(params, name)
        try:
            if name in _MESSAGE_FIELDS:
                if value is not None:
                    message.structured_outputs.CopyFrom(structured_outputs_to_proto(value))
            elif name in _REPEATED_FIELDS:
                getattr(message, name).extend(value)
            elif name == "logit_bias":
                message.logit_bias.update(dict(value))
            elif name == "allowed_token_ids":
                message.allowed_token_ids.extend(value or ())
            elif value is not None and value != default:
                setattr(message, name, value)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"{name} cannot be sent: {exc}", field=name) from None
    if params.max_tokens is None:
        message.until_model_len = True
    return message


def sampling_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """The SamplingParams a request asks for: unset fields take their (vLLM) defaults. The
    values are not validated here (the engine does, naming the field).

    Raises:
        InvalidRequestError: both ``max_tokens`` and ``until_model_len`` are set.
    """
    values: dict[str, object] = {}
    for name in SAMPLING_FIELDS:
        if name in _MESSAGE_FIELDS:
            if message.HasField(name):
                values[name] = structured_outputs_from_proto(message.structured_outputs)
        elif name in _REPEATED_FIELDS:
            values[name] = tuple(getattr(message, name))
        elif name == "logit_bias":
            values[name] = tuple(sorted(message.logit_bias.items()))
        elif name == "allowed_token_ids":
            values[name] = tuple(message.allowed_token_ids) or None
        elif message.HasField(name):
            values[name] = getattr(message, name)
    if message.until_model_len:
        if message.HasField("max_tokens"):
            raise InvalidRequestError(
                "set max_tokens or until_model_len, not both", field="until_model_len"
            )
        values["max_tokens"] = None
    return SamplingParams(**values)  # type: ignore[arg-type]


def structured_outputs_to_proto(params: StructuredOutputsParams) -> pb.StructuredOutputs:
    """The proto form of a constraint (its oneof carries the one constraint set).

    Raises:
        InvalidRequestError: the constraint is malformed (none or two set, ...), naming the
            field.
    """
    validate_structured_outputs(params)
    message = pb.StructuredOutputs(
        disable_any_whitespace=params.disable_any_whitespace,
        disable_additional_properties=params.disable_additional_properties,
    )
    kind = params.kind
    if kind == "choice":
        message.choice.choices.extend(params.choice or ())
    elif kind == "json_object":
        message.json_object = True
    else:
        setattr(message, kind, getattr(params, kind))
    return message


def structured_outputs_from_proto(message: pb.StructuredOutputs) -> StructuredOutputsParams:
    """The constraint a request asks for (not validated here: the engine does; an empty
    oneof gives a constraint with none set, which validation names)."""
    kind = message.WhichOneof("constraint")
    values: dict[str, object] = {
        "disable_any_whitespace": message.disable_any_whitespace,
        "disable_additional_properties": message.disable_additional_properties,
    }
    if kind == "choice":
        values["choice"] = tuple(message.choice.choices)
    elif kind is not None:
        values[kind] = getattr(message, kind)
    return StructuredOutputsParams(**values)  # type: ignore[arg-type]


# -- requests -------------------------------------------------------------------------------


def request_to_proto(
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    request_id: str | None = None,
    chat_template: bool = False,
    rendering: ChatRendering | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest for a text, a conversation (ChatMessage or role/content mappings)
    or token ids; ``rendering``: how the chat template renders it (None: the model's).

    Raises:
        InvalidRequestError: a prompt of another shape, or an unsendable parameter.
    """
    request = pb.GenerateRequest(chat_template=chat_template)
    if rendering is not None:
        options = request.chat_template_options
        options.chat_template = rendering.template
        options.chat_template_kwargs = rendering.template_kwargs
        options.add_generation_prompt = rendering.add_generation_prompt
        options.continue_final_message = rendering.continue_final_message
    if request_id is not None:
        request.request_id = request_id
    if params is not None:
        request.sampling_params.CopyFrom(sampling_to_proto(params))
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)) and prompt:
        token_ids = [token for token in prompt if type(token) is int]
        if len(token_ids) == len(prompt):
            try:
                request.token_ids.ids.extend(token_ids)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"token ids must be in [0, 2**32): {exc}", field="prompt_token_ids"
                ) from None
        else:
            request.messages.SetInParent()
            for item in prompt:
                role, content = _chat_fields(item)
                request.messages.messages.add(role=role, content=content)
    else:
        raise InvalidRequestError(
            f"prompt must be a string, chat messages or token ids, got {prompt!r:.60}",
            field="prompt",
        )
    return request


def _chat_fields(item: object) -> tuple[str, str]:
    if isinstance(item, ChatMessage):
        return item.role, item.content
    if isinstance(item, Mapping) and isinstance(item.get("content"), str):
        return str(item.get("role", "user")), item["content"]
    raise InvalidRequestError(
        "a prompt list must hold token ids or chat messages ({'role': ..., 'content': ...})",
        field="prompt",
    )


def embed_inputs_from_proto(request: pb.EmbedRequest) -> list[Prompt]:
    """The engine prompts of an Embed request's inputs (each checked by the engine later).

    Raises:
        InvalidRequestError: no inputs, more than :data:`~pipeline.server.limits.
            MAX_EMBEDDING_INPUTS`, or an input with nothing set or empty (field
            ``inputs[i]``).
    """
    if not request.inputs:
        raise InvalidRequestError("inputs must hold at least one input", field="inputs")
    if len(request.inputs) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(
            f"inputs may hold at most {MAX_EMBEDDING_INPUTS}, got {len(request.inputs)}",
            field="inputs",
        )
    prompts: list[Prompt] = []
    for index, item in enumerate(request.inputs):
        which = item.WhichOneof("input")
        prompt: Prompt = item.text if which == "text" else list(item.token_ids.ids)
        if which is None or not prompt:
            raise InvalidRequestError(
                f"inputs[{index}] must be a non-empty text or token_ids", field=f"inputs[{index}]"
            )
        prompts.append(prompt)
    return prompts


def prompt_from_proto(request: pb.GenerateRequest) -> Prompt:
    """The engine prompt of a request (not validated here beyond its presence).

    Raises:
        InvalidRequestError: no input is set (field ``input``), or an empty ``messages`` or
            ``token_ids`` list (named by its proto field: the engine would call it
            ``prompt``).
    """
    which = request.WhichOneof("input")
    if which == "text":
        return request.text
    if which == "messages":
        if not request.messages.messages:
            raise InvalidRequestError("messages must hold at least one message", field="messages")
        return [
            ChatMessage(
                message.role or "user",
                message.content,
                tuple(ToolCall(c.id, c.name, c.arguments) for c in message.tool_calls),
                message.tool_call_id,
            )
            for message in request.messages.messages
        ]
    if which == "token_ids":
        if not request.token_ids.ids:
            raise InvalidRequestError("token_ids must hold at least one token", field="token_ids")
        return list(request.token_ids.ids)
    raise InvalidRequestError(
        "the request has no input: set text, messages or token_ids", field="input"
    )


# -- outputs --------------------------------------------------------------------------------


def _logprob_to_proto(entry: Logprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        rank=entry.rank,
        top_token_ids=entry.top_token_ids,
        top_logprobs=entry.top_logprobs,
    )


def tools_from_proto(request: pb.GenerateRequest) -> ToolUse | None:
    """The request's tools, tool choice and parallel flag (None: none given); the engine's
    validation core checks them."""
    if (
        not request.tools
        and not request.tool_choice
        and not request.HasField("parallel_tool_calls")
    ):
        return None
    tools = tuple(ToolSpec(tool.name, tool.description, tool.parameters) for tool in request.tools)
    choice = request.tool_choice or ("auto" if tools else "none")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolUse(tools, choice, parallel)


def rendering_from_proto(request: pb.GenerateRequest) -> ChatRendering | None:
    """The request's chat template options (None: not set, or all at their defaults); the
    engine's validation core checks them."""
    if not request.HasField("chat_template_options"):
        return None
    options = request.chat_template_options
    add = options.add_generation_prompt if options.HasField("add_generation_prompt") else True
    rendering = ChatRendering(
        options.chat_template, options.chat_template_kwargs, add, options.continue_final_message
    )
    return None if rendering == ChatRendering() else rendering


def response_from_output(
    output: RequestOutput,
    request_id: str,
    num_sent_tokens: int,
    num_sent_reasoning: int = 0,
    *,
    with_prompt: bool = False,
) -> pb.GenerateResponse:
    """The response for one engine output of a request whose first ``num_sent_tokens``
    tokens (and ``num_sent_reasoning`` characters of reasoning) were already sent: the new
    text, the new token ids (and their logprobs), the new reasoning and the calls so far, and
    on the last output the finish reason, stop reason and usage. ``with_prompt``: the
    prompt's token ids and scores too, when the output has them (send them once)."""
    response = pb.GenerateResponse(
        request_id=request_id,
        delta=output.delta,
        token_ids=output.token_ids[num_sent_tokens:],
        reasoning_delta=output.reasoning[num_sent_reasoning:],
    )
    if output.tool_calls:
        response.tool_calls.extend(
            pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
            for call in output.tool_calls
        )
    if output.logprobs:
        response.logprobs.extend(
            _logprob_to_proto(entry) for entry in output.logprobs[num_sent_tokens:]
        )
    if with_prompt and output.prompt_logprobs is not None:
        response.prompt_token_ids.extend(output.prompt_token_ids or ())
        response.prompt_logprobs.extend(
            _logprob_to_proto(entry) for entry in output.prompt_logprobs if entry is not None
        )
    if output.finish_reason is not None:
        response.finish_reason = FINISH_REASONS.get(output.finish_reason, pb.FINISH_REASON_ERROR)  # type: ignore[assignment]
        if isinstance(output.stop_reason, str):
            response.stop_string = output.stop_reason
        elif isinstance(output.stop_reason, int):
            response.stop_token_id = output.stop_reason
        response.usage.prompt_tokens = output.num_prompt_tokens
        response.usage.completion_tokens = len(output.token_ids)
        response.usage.cached_tokens = output.num_cached_tokens
    return response


def model_info_to_proto(info: EngineInfo, scheduler: str) -> pb.ModelInfo:
    """The ModelInfo for the engine's :class:`~stages.messages.EngineInfo`."""
    return pb.ModelInfo(
        model=info.model,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        kv_cache_blocks=info.num_blocks,
        block_size=info.block_size,
        kv_cache_tokens=info.num_blocks * info.block_size,
        kv_cache_bytes=info.kv_cache_bytes,
        dtype=info.dtype,
        device=info.device,
        scheduler=scheduler,
        prefix_caching=info.enable_prefix_caching,
        eos_token_ids=info.eos_token_ids,
        kv_cache_dtype=info.kv_cache_dtype,
        omp_wait_policy=info.omp_wait_policy,
        draft_model=info.draft_model,
        draft_kv_cache_blocks=info.draft_num_blocks,
        draft_kv_cache_bytes=info.draft_kv_cache_bytes,
        draft_host=info.draft_host,
    )
