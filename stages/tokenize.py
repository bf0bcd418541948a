"""The tokenize stage: a prompt string, chat messages or token ids → an EngineRequest.

Ports: ``in`` takes :class:`~stages.messages.GenerateRequest`, and the engine's
:class:`~stages.messages.EngineInfo` (its ``max_model_len`` bounds the text worth
tokenizing); ``out`` sends the
:class:`~stages.messages.EngineRequest` to admit; ``track`` sends the same request to the
frontend's text stages (detokenize registers its state from it); ``rejected`` answers requests
whose input is unusable with a :class:`~stages.messages.RequestRejected`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.runtime.stage import Stage, handles
from stages.chat_template import check_template_kwargs, template_arguments
from stages.errors import InvalidRequestError, PromptTooLongError, RequestError
from stages.messages import (
    ChatMessage,
    ChatRendering,
    EngineInfo,
    EngineRequest,
    GenerateRequest,
    RequestRejected,
    ToolSpec,
)
from stages.recovery import rejection, request_id_of
from stages.tools import (
    fallback_messages,
    message_dicts,
    output_parsing,
    template_parser_hint,
    tool_constraint,
    tool_dicts,
)

__all__ = [
    "TokenizeConfig",
    "TokenizeStage",
    "bad_words_token_ids",
    "load_tokenizer",
    "longest_token_chars",
    "prefetch_tokenizer",
    "render_chat",
    "render_messages",
    "template_renders_tools",
]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizeConfig:
    """``model``: an alias, HF directory or .gguf file (the tokenizer comes with it).
    ``tool_call_parser``: the tool-call parser of requests with tools ("": the one the chat
    template suggests, :func:`stages.tools.template_parser_hint`); ``reasoning_parser``: the
    reasoning parser of every chat request ("": none). Both are named on the request for the
    parse stage (:class:`~stages.messages.OutputParsing`)."""

    model: str
    tool_call_parser: str = ""
    reasoning_parser: str = ""


#: tokenizers being loaded ahead by prefetch_tokenizer, by model: the next load takes one
_PREFETCHED: dict[str, concurrent.futures.Future[Any]] = {}


#: tokenizer classes that are transformers' plain tokenizers-backed class, loaded directly
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load(model: str) -> Any:
    from stages.models import loading, quiet_transformers, resolve_model

    path = resolve_model(model).path
    with loading():
        quiet_transformers()
        if _plain_tokenizer(path):
            # NOTE: the class AutoTokenizer would pick, without AutoTokenizer's import: it
            # pulls in torch and the model registry (3.3-4 s here, against 0.9 s; the
            # frontend's start-up runs beside the engine's, docs/performance.md §3).
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


def _plain_tokenizer(path: Path) -> bool:
    """Whether ``path``'s tokenizer is transformers' plain tokenizers-backed class (its
    ``tokenizer.json`` holds everything; no model-specific Python class)."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict)
        and config.get("tokenizer_class") in _PLAIN_CLASSES
        and not config.get("auto_map")
        and (path / "tokenizer.json").is_file()
    )


def load_tokenizer(model: str) -> Any:
    """The HF tokenizer of ``model`` (resolved like the execute stage resolves it): the one
    :func:`prefetch_tokenizer` started loading, if any (each prefetched object goes to one
    caller), else a fresh load."""
    prefetched = _PREFETCHED.pop(model, None)
    if prefetched is not None:
        with contextlib.suppress(Exception):  # loaded again below, raising for the caller
            return prefetched.result()
    return _load(model)


def prefetch_tokenizer(model: str) -> None:
    """Start loading ``model``'s tokenizer on a thread of its own, for the next
    :func:`load_tokenizer` of this process: a command that will start a pipeline calls this
    first, so that importing transformers and reading the tokenizer (and compiling its chat
    template) overlap the command's own start-up instead of following it (docs/performance.md
    §3)."""
    if model in _PREFETCHED:
        return
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            tokenizer = _load(model)
            if getattr(tokenizer, "chat_template", None):
                # NOTE: transformers caches the compiled template by its text, process-wide
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
                )
        except BaseException as error:
            future.set_exception(error)
        else:
            future.set_result(tokenizer)

    _PREFETCHED[model] = future
    threading.Thread(target=run, name="actorline-tokenizer-prefetch", daemon=True).start()


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input one token of ``tokenizer`` can stand for, or None when
    that is not known: a tokenizer that normalizes its input (NFKC, lower-casing, stripping)
    may turn several characters into fewer, so no bound follows from its vocabulary.

    NOTE: a vocabulary entry spells its token with at least one character per character of
    text it covers (byte-level BPE: one per byte; SentencePiece: one per character, with
    byte-fallback entries like ``<0xE2>`` longer than the byte they cover), so the longest
    entry bounds it.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocabulary = tokenizer.get_vocab()
    return max(map(len, vocabulary), default=0) or None


#: inputs larger than this (characters of text and message contents, plus a few per message)
#: are tokenized on the stage's worker thread rather than on the event loop
LARGE_INPUT = 16_384


def _input_size(request: GenerateRequest) -> int:
    size = len(request.prompt) if isinstance(request.prompt, str) else 0
    for message in request.messages or ():
        content = message.content
        size += 16 + (len(content) if isinstance(content, str) else 0)
    return size


def _text_chars(request: GenerateRequest) -> int:
    """Characters of the request's own text (prompt and message contents): each becomes part
    of the prompt's tokens (a chat template only adds to them)."""
    size = len(request.prompt) if isinstance(request.prompt, str) else 0
    for message in request.messages or ():
        size += len(message.content) if isinstance(message.content, str) else 0
    return size


class TokenizeStage(Stage):
    inputs = ("in",)
    outputs = ("out", "track", "rejected")

    def __init__(self, config: TokenizeConfig) -> None:
        super().__init__(config)
        self.tokenizer: Any = None
        self._token_chars: int | None = None
        self._tool_parser = config.tool_call_parser
        self._renders_tools = True
        # Set once the engine reports its length: text longer than this has more tokens than
        # the model's length holds, so it is refused without tokenizing it.
        self.max_prompt_chars: int | None = None
        self._max_model_len: int | None = None

    async def start(self) -> None:
        self.tokenizer = await self.run_in_thread(load_tokenizer, self.config.model)
        self._token_chars = longest_token_chars(self.tokenizer)
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, str):
            self._renders_tools = await self.run_in_thread(template_renders_tools, self.tokenizer)
            if not self._tool_parser:
                # NOTE: a template that ignores tools gets the default preamble, whose
                # <tool_call> format the generic parser reads
                hint = template_parser_hint(template) if self._renders_tools else "generic"
                self._tool_parser = hint

    @handles(EngineInfo)
    async def on_engine_info(self, info: EngineInfo) -> None:
        self._max_model_len = info.max_model_len
        if self._token_chars is not None:
            self.max_prompt_chars = info.max_model_len * self._token_chars

    @handles(GenerateRequest)
    async def on_request(self, request: GenerateRequest) -> None:
        try:
            self._check_text_length(request)
            if _input_size(request) > LARGE_INPUT:
                # NOTE: seconds of tokenizer work for a multi-megabyte prompt would stall the
                # frontend's event loop (every stream, the server's health checks); the
                # stage's own thread keeps it free. Small inputs skip the thread's hop.
                token_ids = await self.run_in_thread(self.encode, request)
            else:
                token_ids = self.encode(request)
        except RequestError as error:
            await self.emit(
                "rejected",
                RequestRejected.of(request.request_id, error),
            )
            return
        params = request.params
        keep = params.truncate_prompt_tokens
        if keep is not None:
            # vLLM's rule: the last k tokens; -1: as many as the model's length holds
            # (vllm/entrypoints/renderer.py: a negative value is max_model_len)
            if keep == -1:
                keep = self._max_model_len if self._max_model_len is not None else len(token_ids)
                if request.pooling is not None:
                    keep -= 1  # an embedding's prompt leaves the one token admit requires
            token_ids = token_ids[-keep:]
        constraint = tool_constraint(
            request.tools, request.tool_choice, request.parallel_tool_calls
        )
        if constraint is not None:
            params = params.replace(structured_outputs=constraint)
        parsing = None
        if request.messages is not None and request.pooling is None:
            parsing = output_parsing(
                request, self._tool_parser or "generic", self.config.reasoning_parser
            )
        engine_request = EngineRequest(
            request.request_id,
            token_ids,
            params,
            request.tenant,
            request.arrival_time,
            request.prompt,
            parsing,
            bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else (),
            request.pooling,
            request.lora,
        )
        await self.emit("track", engine_request)
        await self.emit("out", engine_request)

    async def recover(self, message: Any, port: str, error: Exception) -> bool:
        """A request this stage failed on (the tokenizer raised, or the link to admit could
        not carry it) is answered with a typed error; the stage holds nothing per request.
        (Detokenize, told of it on ``track`` already, forgets it on the rejection.)"""
        request_id = request_id_of(message)
        if request_id is None:
            return False
        await self.emit("rejected", rejection(self.name, request_id, error))
        return True

    def _check_text_length(self, request: GenerateRequest) -> None:
        """Refuse text that cannot fit the model before tokenizing it: a tokenizer's working
        memory is a hundred-odd times the text (a 4 MB prompt grew the frontend by 663 MiB
        before admit refused its tokens), and every such prompt would be refused anyway.

        Raises:
            PromptTooLongError: more characters than ``max_model_len`` tokens can cover.
        """
        limit = self.max_prompt_chars
        if limit is None:
            return
        chars = _text_chars(request)
        if chars > limit:
            field = "messages" if request.messages is not None else "prompt"
            raise PromptTooLongError(
                f"the {field} has {chars:,} characters: more tokens than the model's length "
                f"holds (no token of this tokenizer covers more than {self._token_chars} "
                f"characters, and {limit:,} characters already need every position)",
                field=field,
                request_id=request.request_id,
            )

    def encode(self, request: GenerateRequest) -> tuple[int, ...]:
        """Token ids of the request's input. The request was checked whole where it entered
        the engine (:func:`~stages.validation.validate_generate_request`, called by the
        façade: docs/architecture.md §7.1) and is trusted here: exactly one input, text with
        a UTF-8 form, well-formed chat messages. This checks only what the tokenizer alone
        knows.

        Raises:
            InvalidRequestError: a prompt that tokenizes to no tokens, or chat messages for a
                model without a chat template.
        """
        if request.prompt_token_ids is not None:
            return tuple(request.prompt_token_ids)
        if request.messages is not None:
            return render_messages(
                self.tokenizer,
                request.messages,
                request.tools,
                rendering=request.rendering,
                renders_tools=self._renders_tools,
            )
        prompt = request.prompt
        assert prompt is not None  # exactly one input (the validation core)
        # NOTE: as vLLM, whitespace is a prompt like any other; only a prompt without tokens
        # is refused (the model needs at least one position to compute).
        if request.chat_template:
            ids = render_messages(
                self.tokenizer, (ChatMessage("user", prompt),), (), rendering=request.rendering
            )
        else:
            ids = tuple(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not ids:
            raise InvalidRequestError(f"prompt {prompt!r:.40} has no tokens", field="prompt")
        return ids


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences the sampler bans for ``words`` (``bad_words``), as vLLM builds
    them (``vllm/sampling_params.py``, ``update_from_tokenizer``): each word without its
    leading spaces, and with one space before it where that gives other tokens of the same
    count (the word in the middle of a text); no special tokens."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if bare:
            sequences.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            sequences.append(spaced)
    return tuple(dict.fromkeys(sequences))


def render_chat(
    tokenizer: Any, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True
) -> tuple[int, ...]:
    """The token ids of chat ``messages`` (role, content) rendered by the tokenizer's chat
    template, as the tokenize stage renders a chat request (and ``/tokenize`` shows it).

    Raises:
        InvalidRequestError: the model has no chat template.
    """
    chat = tuple(ChatMessage(role, content) for role, content in messages)
    rendering = None if add_generation_prompt else ChatRendering(add_generation_prompt=False)
    return render_messages(tokenizer, chat, (), rendering=rendering)


def render_messages(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec],
    *,
    rendering: ChatRendering | None = None,
    renders_tools: bool | None = None,
) -> tuple[int, ...]:
    """The token ids of chat ``messages`` and the ``tools`` they may call, rendered by the
    tokenizer's chat template (transformers hands ``tools`` to it), or by ``rendering``'s
    own template, with its variables, generation prompt and continuation
    (:class:`~stages.messages.ChatRendering`, checked by the validation core; None: the
    model's template with the generation prompt). transformers renders in jinja2's sandbox
    (:mod:`stages.chat_template`). A template that ignores tools (``renders_tools`` False;
    None: find out, :func:`template_renders_tools`) gets them as the default preamble
    instead, its calls and results written in the ``<tool_call>`` format
    (:func:`stages.tools.fallback_messages`; docs/serving.md, "Tool calling").

    Raises:
        InvalidRequestError: the model has no chat template and the request brings none
            (field ``messages``); the template refused the messages or failed (field
            ``chat_template`` for the request's own template, else ``messages``); a
            ``chat_template_kwargs`` key the template does not read; nothing to continue
            (field ``continue_final_message``).
    """
    own = rendering.template if rendering is not None else ""
    template = own or getattr(tokenizer, "chat_template", None)
    if not template or not isinstance(template, str):
        raise InvalidRequestError(
            "this model has no chat template; send a plain prompt (or a chat_template)",
            field="messages",
        )
    if rendering is not None:
        check_template_kwargs(template, rendering)
    needs_tools = bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)
    if needs_tools and (renders_tools is None or own):
        renders_tools = template_renders_tools(tokenizer, own or None)
    extra: dict[str, Any] = {}
    if needs_tools and not renders_tools:
        dicts = fallback_messages(messages, tools)
    else:
        dicts = message_dicts(messages)
        if tools:
            extra["tools"] = tool_dicts(tools)
    arguments = {**template_arguments(rendering), **extra}
    if arguments.get("continue_final_message") and not (dicts and dicts[-1].get("content")):
        # NOTE: transformers needs text in the last message to find where it ends
        raise InvalidRequestError(
            "continue_final_message: the last message has no text to continue",
            field="continue_final_message",
        )
    try:
        rendered = tokenizer.apply_chat_template(dicts, tokenize=False, **arguments)
    except Exception as error:  # the template's own raise_exception, a missing key, syntax
        whose, field = ("the request's chat_template", "chat_template") if own else (
            "the model's chat template", "messages")  # fmt: skip
        raise InvalidRequestError(
            f"{whose} failed on these messages: {type(error).__name__}: {error!s:.300}",
            field=field,
        ) from None
    if not isinstance(rendered, str):
        raise InvalidRequestError(
            "the chat template did not render text", field="chat_template" if own else "messages"
        )
    return tuple(tokenizer.encode(rendered, add_special_tokens=False))


#: the conversation that tells whether a chat template renders tools
_PROBE = [{"role": "user", "content": "Hi"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_function_7f3a",
            "description": "d",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


def template_renders_tools(tokenizer: Any, template: str | None = None) -> bool:
    """Whether the tokenizer's chat template (or ``template``) renders ``tools``: a
    conversation rendered with a tool and without one comes out different (a template that
    ignores them gets the default preamble, :func:`render_messages`)."""
    own = {"chat_template": template} if template else {}
    try:
        without = tokenizer.apply_chat_template(
            _PROBE, add_generation_prompt=True, tokenize=False, **own
        )
        with_tools = tokenizer.apply_chat_template(
            _PROBE, add_generation_prompt=True, tokenize=False, tools=_PROBE_TOOLS, **own
        )
    except Exception:  # a template that fails on the probe: treat it as ignoring tools
        return False
    return bool(with_tools != without)
