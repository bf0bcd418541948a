"""A request's chat template options (:mod:`stages.chat_template`): the validation core's
checks (sizes, syntax, reserved variables, vLLM's mutual exclusion), and rendering by the real
SmolLM2 tokenizer of the tiny model through :func:`stages.tokenize.render_messages`: a
template of the request's own, its variables, no generation prompt, a continued last message,
and the typed errors of a template that fails, reaches for Python's internals or is given a
variable it never reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from stages.chat_template import (
    MAX_CHAT_TEMPLATE_CHARS,
    check_rendering,
    make_rendering,
    template_arguments,
    template_variables,
)
from stages.errors import InvalidRequestError
from stages.messages import ChatMessage, ChatRendering, GenerateRequest
from stages.params import SamplingParams
from stages.tokenize import render_messages
from stages.validation import validate_generate_request

#: a small template of a request's own: reads a variable of its own (``shout``)
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content | upper if shout else m.content }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
CHAT = (ChatMessage("user", "Hi there"),)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def rendered(tokenizer: Any, messages: Any = CHAT, **options: Any) -> str:
    ids = render_messages(tokenizer, messages, (), rendering=make_rendering(**options))
    return str(tokenizer.decode(ids))


def test_defaults_make_no_rendering_and_render_as_before(tokenizer: Any) -> None:
    assert make_rendering() is None and make_rendering(chat_template_kwargs={}) is None
    assert template_arguments(None) == {"add_generation_prompt": True}
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered(tokenizer) == expected


def test_own_template_with_its_variables(tokenizer: Any) -> None:
    text = rendered(tokenizer, chat_template=TEMPLATE, chat_template_kwargs={"shout": True})
    assert text == "[user]HI THERE\n[assistant]"
    quiet = rendered(tokenizer, chat_template=TEMPLATE, chat_template_kwargs={"shout": False})
    assert quiet == "[user]Hi there\n[assistant]"


def test_without_generation_prompt_and_continuing_the_last_message(tokenizer: Any) -> None:
    plain = rendered(tokenizer, add_generation_prompt=False)
    assert not plain.rstrip().endswith("<|im_start|>assistant")
    assert plain.rstrip().endswith("<|im_end|>")
    history = (*CHAT, ChatMessage("assistant", "The answer is"))
    text = rendered(tokenizer, history, add_generation_prompt=False, continue_final_message=True)
    # the last message stays open: no end-of-turn after it, no new assistant turn
    assert text.endswith("<|im_start|>assistant\nThe answer is"), text


def test_the_models_template_variables_are_read(tokenizer: Any) -> None:
    assert "messages" in template_variables(tokenizer.chat_template)
    with pytest.raises(InvalidRequestError, match=r"enable_thinking.*does not read") as caught:
        rendered(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert caught.value.field == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ raise_exception('no system messages') }}", "no system messages"),
        ("{{ messages.__class__.__mro__ }}", "SecurityError|unsafe|__class__"),
        ("{{ messages.append(1) }}", "SecurityError|unsafe|append"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_a_failing_or_unsafe_template_is_a_typed_error(
    tokenizer: Any, template: str, words: str
) -> None:
    with pytest.raises(InvalidRequestError, match=words) as caught:
        rendered(tokenizer, chat_template=template)
    assert caught.value.field == "chat_template"


def request(rendering: ChatRendering | None, **fields: Any) -> GenerateRequest:
    inputs = fields or {"messages": CHAT}
    return GenerateRequest("r", SamplingParams(), rendering=rendering, **inputs)


@pytest.mark.parametrize(
    ("rendering", "field", "words"),
    [
        (ChatRendering(add_generation_prompt=True, continue_final_message=True),
         "continue_final_message", "cannot be true with add_generation_prompt"),
        (ChatRendering(template="{% for %}"), "chat_template", "not a valid Jinja"),
        (ChatRendering(template="x" * (MAX_CHAT_TEMPLATE_CHARS + 1)), "chat_template",
         "at most"),
        (ChatRendering(template_kwargs="[1]"), "chat_template_kwargs", "JSON object"),
        (ChatRendering(template_kwargs='{"tokenize": true}'), "chat_template_kwargs",
         "tokenize: may not be set"),
        (ChatRendering(template_kwargs='{"add_generation_prompt": false}'),
         "chat_template_kwargs", "use the request's field add_generation_prompt"),
        (ChatRendering(add_generation_prompt=1), "add_generation_prompt", "boolean"),  # type: ignore[arg-type]
    ],
)  # fmt: skip
def test_the_validation_core_refuses_bad_options(
    rendering: ChatRendering, field: str, words: str
) -> None:
    with pytest.raises(InvalidRequestError, match=words) as caught:
        validate_generate_request(request(rendering))
    assert caught.value.field == field and caught.value.request_id == "r"


def test_options_need_chat_messages() -> None:
    options = ChatRendering(add_generation_prompt=False)
    with pytest.raises(InvalidRequestError, match="chat messages only") as caught:
        validate_generate_request(request(options, prompt="Hi"))
    assert caught.value.field == "chat_template"
    validate_generate_request(request(options, prompt="Hi", chat_template=True))
    validate_generate_request(request(options))


def test_kwargs_must_be_json() -> None:
    with pytest.raises(InvalidRequestError, match="JSON values") as caught:
        make_rendering(chat_template_kwargs={"when": object()})
    assert caught.value.field == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError, match="string"):
        make_rendering(chat_template_kwargs={1: True})  # type: ignore[dict-item]
    check_rendering(make_rendering(chat_template_kwargs={"a": [1, {"b": None}]}), has_messages=True)
