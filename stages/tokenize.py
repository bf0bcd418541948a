"""The tokenize stage: a prompt string, chat messages or token ids → an EngineRequest.

Ports: ``in`` takes :class:`~stages.messages.GenerateRequest`; ``out`` sends the
:class:`~stages.messages.EngineRequest` to admit; ``track`` sends the same request to the
frontend's text stages (detokenize registers its state from it); ``rejected`` answers requests
whose input is unusable with a :class:`~stages.messages.RequestRejected`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.runtime.stage import Stage, handles
from stages.errors import InvalidRequestError, RequestError
from stages.failures import rejection, request_id_of
from stages.messages import EngineRequest, GenerateRequest, RequestRejected
from stages.validation import validate_generate_request

__all__ = ["TokenizeConfig", "TokenizeStage", "load_tokenizer"]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizeConfig:
    """``model``: an alias, HF directory or .gguf file (the tokenizer comes with it)."""

    model: str


def load_tokenizer(model: str) -> Any:
    """The HF tokenizer of ``model`` (resolved like the execute stage resolves it)."""
    from stages.models import loading, resolve_model

    with loading():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(resolve_model(model).path)


#: inputs larger than this (characters of text and message contents, plus a few per message)
#: are tokenized on the stage's worker thread rather than on the event loop
LARGE_INPUT = 16_384


def _input_size(request: GenerateRequest) -> int:
    size = len(request.prompt) if isinstance(request.prompt, str) else 0
    for message in request.messages or ():
        content = message.content
        size += 16 + (len(content) if isinstance(content, str) else 0)
    return size


class TokenizeStage(Stage):
    inputs = ("in",)
    outputs = ("out", "track", "rejected")

    def __init__(self, config: TokenizeConfig) -> None:
        super().__init__(config)
        self.tokenizer: Any = None

    async def start(self) -> None:
        self.tokenizer = await self.run_in_thread(load_tokenizer, self.config.model)

    @handles(GenerateRequest)
    async def on_request(self, request: GenerateRequest) -> None:
        try:
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
        engine_request = EngineRequest(
            request.request_id,
            token_ids,
            request.params,
            request.tenant,
            request.arrival_time,
            request.prompt,
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

    def encode(self, request: GenerateRequest) -> tuple[int, ...]:
        """Token ids of the request's input, the request first checked whole by the
        validation core (:func:`~stages.validation.validate_generate_request`: the API checks
        it too, but a caller of the pipeline's entry may not have).

        Raises:
            InvalidRequestError: anything the validation core refuses (no input or several,
                an empty prompt, text without a UTF-8 form, malformed chat messages, token
                ids that are not non-negative int64, a bad sampling parameter), a prompt
                that tokenizes to no tokens, or chat messages for a model without a chat
                template.
        """
        validate_generate_request(request)
        if request.prompt_token_ids is not None:
            return tuple(request.prompt_token_ids)
        if request.messages is not None:
            return self._apply_chat_template([(m.role, m.content) for m in request.messages])
        prompt = request.prompt
        assert prompt is not None  # exactly one input, checked above
        # NOTE: as vLLM, whitespace is a prompt like any other; only a prompt without tokens
        # is refused (the model needs at least one position to compute).
        if request.chat_template:
            ids = self._apply_chat_template([("user", prompt)])
        else:
            ids = tuple(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not ids:
            raise InvalidRequestError(f"prompt {prompt!r:.40} has no tokens", field="prompt")
        return ids

    def _apply_chat_template(self, messages: list[tuple[str, str]]) -> tuple[int, ...]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt", field="messages"
            )
        rendered = self.tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages],
            add_generation_prompt=True,
            tokenize=False,
        )
        return tuple(self.tokenizer.encode(rendered, add_special_tokens=False))
