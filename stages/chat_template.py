"""A request's own chat-template options, as vLLM takes them on a chat request
(``vllm/entrypoints/openai/chat_completion/protocol.py``, ``ChatCompletionRequest``):
``chat_template`` (a Jinja template used instead of the model's), ``chat_template_kwargs``
(variables the template reads, such as ``enable_thinking``), ``add_generation_prompt`` and
``continue_final_message``, carried as :class:`~stages.messages.ChatRendering`. Pure logic:
the checks the validation core runs where a request enters (:func:`check_rendering`), and the
keyword arguments the tokenize stage gives the tokenizer's ``apply_chat_template``
(:func:`template_arguments`).

**Sandbox.** transformers compiles every chat template, the model's and a request's alike, in
jinja2's ``ImmutableSandboxedEnvironment`` (``transformers/utils/chat_template_utils.py``,
``_compile_jinja_template``): a template sees only the values it is given, cannot reach
Python's internals (no ``__class__``, no ``__globals__``) and cannot change what it is given.
A sandbox does not bound the time a template may loop, though; so the servers refuse a
request that brings its own template unless they were started with
``--trust-request-chat-template`` (vLLM's rule and flag; docs/serving.md), while the Python
API, whose caller is the server's owner, takes one always.

**Nothing ignored.** vLLM drops the ``chat_template_kwargs`` keys that the template does not
read (``vllm/renderers/hf.py``, ``resolve_chat_template_kwargs``); here such a key is refused
with an error naming it, so a request never quietly means something else
(:func:`check_template_kwargs`, run by the tokenize stage, which knows the model's template).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from stages.checks import check_bool, check_bounded_string, describe
from stages.errors import InvalidRequestError
from stages.messages import ChatRendering

__all__ = [
    "MAX_CHAT_TEMPLATE_CHARS",
    "MAX_TEMPLATE_KWARGS_CHARS",
    "RESERVED_TEMPLATE_KWARGS",
    "check_rendering",
    "check_template_kwargs",
    "make_rendering",
    "template_arguments",
    "template_kwargs",
    "template_variables",
]

#: characters of a request's own chat template (the largest templates of released models,
#: with their tool sections, are near 20,000)
MAX_CHAT_TEMPLATE_CHARS = 65_536
#: characters of ``chat_template_kwargs`` as JSON text
MAX_TEMPLATE_KWARGS_CHARS = 65_536
#: ``chat_template_kwargs`` keys a request may not set: the arguments of transformers'
#: ``apply_chat_template`` (vLLM refuses ``chat_template`` and ``tokenize`` among them,
#: ``vllm/renderers/hf.py``), some of which the request's own fields set
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template", "tokenize", "messages", "conversation", "tools", "documents",
        "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
        "return_assistant_tokens_mask", "padding", "truncation", "max_length",
        "tokenizer_kwargs", "processor_kwargs",
    }
)  # fmt: skip
#: the request fields that set a reserved key themselves
_OWN_FIELD = {
    "chat_template": "chat_template",
    "add_generation_prompt": "add_generation_prompt",
    "continue_final_message": "continue_final_message",
    "tools": "tools",
    "messages": "messages",
}


class _GenerationBlock(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` block (it marks the
    assistant's tokens for training) as its plain body: enough to read a template's
    variables, never used to render."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


_PARSER = jinja2.sandbox.ImmutableSandboxedEnvironment(
    extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
)


@functools.lru_cache(maxsize=64)
def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads that it does not set itself (jinja2's
    ``find_undeclared_variables``): what a caller may pass it.

    Raises:
        InvalidRequestError: the template is not valid Jinja (field ``chat_template``).
    """
    try:
        tree = _PARSER.parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise InvalidRequestError(
            f"chat_template: not a valid Jinja template (line {error.lineno}: {error.message})",
            field="chat_template",
        ) from None
    return frozenset(jinja2.meta.find_undeclared_variables(tree))


def make_rendering(
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> ChatRendering | None:
    """The :class:`~stages.messages.ChatRendering` of vLLM's four request values (None: all
    at their defaults). Not checked here (:func:`check_rendering` is the validation core's).

    Raises:
        InvalidRequestError: ``chat_template_kwargs`` that is not a mapping of JSON values
            (field ``chat_template_kwargs``).
    """
    if chat_template_kwargs is None or (
        isinstance(chat_template_kwargs, Mapping) and not chat_template_kwargs
    ):
        kwargs = ""
    else:
        if not isinstance(chat_template_kwargs, Mapping):
            raise InvalidRequestError(
                "chat_template_kwargs must be a mapping of names to JSON values, got "
                f"{describe(chat_template_kwargs)}",
                field="chat_template_kwargs",
            )
        if not all(isinstance(key, str) for key in chat_template_kwargs):
            raise InvalidRequestError(
                "chat_template_kwargs: every name must be a string",
                field="chat_template_kwargs",
            )
        try:
            kwargs = json.dumps(dict(chat_template_kwargs), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidRequestError(
                f"chat_template_kwargs must hold JSON values only: {error}",
                field="chat_template_kwargs",
            ) from None
    rendering = ChatRendering(
        chat_template or "", kwargs, add_generation_prompt, continue_final_message
    )
    return None if rendering == ChatRendering() else rendering


def template_kwargs(rendering: ChatRendering) -> dict[str, Any]:
    """The variables ``rendering.template_kwargs`` gives the template (checked already)."""
    if not rendering.template_kwargs:
        return {}
    value = json.loads(rendering.template_kwargs)
    assert isinstance(value, dict)  # check_rendering
    return value


def check_rendering(
    rendering: object, *, has_messages: bool, request_id: str | None = None
) -> None:
    """Check a request's ``rendering`` (None passes): its types, the template's size and
    syntax, ``template_kwargs`` a JSON object of bounded size with no reserved key, and not
    both ``add_generation_prompt`` and ``continue_final_message`` (vLLM's check,
    ``check_generation_prompt``). ``has_messages``: whether the request has chat messages
    (or a prompt it wraps in the template) for the options to render.

    Raises:
        InvalidRequestError: naming the field that is wrong (``chat_template``,
            ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``).
    """
    if rendering is None:
        return
    if not isinstance(rendering, ChatRendering):
        raise InvalidRequestError(
            f"rendering must be a ChatRendering, got {describe(rendering)}",
            field="chat_template",
            request_id=request_id,
        )
    check_bool("add_generation_prompt", rendering.add_generation_prompt, request_id=request_id)
    check_bool("continue_final_message", rendering.continue_final_message, request_id=request_id)
    if not has_messages:
        raise InvalidRequestError(
            "chat_template, chat_template_kwargs, add_generation_prompt and "
            "continue_final_message apply to chat messages only",
            field="chat_template",
            request_id=request_id,
        )
    if rendering.add_generation_prompt and rendering.continue_final_message:
        raise InvalidRequestError(
            "continue_final_message: cannot be true with add_generation_prompt true (set "
            "add_generation_prompt to false to continue the last message)",
            field="continue_final_message",
            request_id=request_id,
        )
    template = check_bounded_string(
        "chat_template",
        rendering.template,
        max_length=MAX_CHAT_TEMPLATE_CHARS,
        what="a Jinja template",
        request_id=request_id,
    )
    if template:
        try:
            template_variables(template)
        except InvalidRequestError as error:
            error.request_id = request_id
            raise
    _check_kwargs_text(rendering.template_kwargs, request_id)


def _check_kwargs_text(text: object, request_id: str | None) -> None:
    text = check_bounded_string(
        "chat_template_kwargs",
        text,
        max_length=MAX_TEMPLATE_KWARGS_CHARS,
        what="a JSON object",
        request_id=request_id,
    )
    if not text:
        return
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            "chat_template_kwargs must be a JSON object (names to values)",
            field="chat_template_kwargs",
            request_id=request_id,
        )
    for key in value:
        if key in RESERVED_TEMPLATE_KWARGS:
            own = _OWN_FIELD.get(key)
            hint = f"; use the request's field {own}" if own else ""
            raise InvalidRequestError(
                f"chat_template_kwargs.{key}: may not be set here (an argument of the "
                f"renderer, not a template variable){hint}",
                field="chat_template_kwargs",
                request_id=request_id,
            )


def check_template_kwargs(template: str, rendering: ChatRendering) -> None:
    """Refuse the ``chat_template_kwargs`` keys that ``template`` (the one that renders: the
    request's or the model's) never reads: they would change nothing.

    Raises:
        InvalidRequestError: naming the first such key (field ``chat_template_kwargs``), or
            a template that is not valid Jinja (field ``chat_template``).
    """
    kwargs = template_kwargs(rendering)
    if not kwargs:
        return
    variables = template_variables(template)
    for key in kwargs:
        if key not in variables:
            whose = "the request's chat_template" if rendering.template else "the model's template"
            raise InvalidRequestError(
                f"chat_template_kwargs.{key}: {whose} does not read this variable, so it "
                "would change nothing",
                field="chat_template_kwargs",
            )


def template_arguments(rendering: ChatRendering | None) -> dict[str, Any]:
    """The keyword arguments of ``apply_chat_template`` for ``rendering`` (None: the
    model's template with the generation prompt)."""
    if rendering is None:
        return {"add_generation_prompt": True}
    arguments: dict[str, Any] = {
        **template_kwargs(rendering),
        "add_generation_prompt": rendering.add_generation_prompt,
    }
    if rendering.continue_final_message:
        arguments["continue_final_message"] = True
    if rendering.template:
        arguments["chat_template"] = rendering.template
    return arguments
